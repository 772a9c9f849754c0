"""Where a session's spread workers stand after a passing crowd, block by block (issue 9).

    python benchmarks/held_again.py [--workers 4] [--workload dispatch|gather_small]
                                    [--blocks 12] [--seconds 0.3]

Where a session's processes outnumber the CPUs, its local workers are held one to a CPU
(unison.placement) and let go at the first crowded verdict, for the rest of the session.
This starts unison and the floor system side by side, as benchmarks/blocks.py does: the
floor's start, right after unison's, is a passing crowd for unison's session. Then blocks
of rounds, the systems in turns, and after each block: each system's median µs, the CPUs
each unison worker may use, and how long ago unison's crowd ended (s; negative: it lasts
that much longer). With PYTHONPATH set to another tree's src, that tree's unison runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.measure import Loop, time_loop
from harness.report import command_line, cpu_model, source_revision
from harness.systems import make_system
from unison.pacing import crowd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--workload", default="dispatch", choices=["dispatch", "gather_small"])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=0.3)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs; {source_revision()}; command: "
          f"{command_line(sys.argv[1:])}")
    unison, floor = make_system("unison"), make_system("floor")
    try:
        unison.start(args.workers)
        floor.start(args.workers)
        start = time.perf_counter()
        for i in range(args.blocks):
            medians = {}
            turn = [("unison", unison), ("floor", floor)]
            for name, system in turn if i % 2 == 0 else reversed(turn):
                loop = Loop(warmup=20, min_iters=1, max_iters=10**7, budget_s=args.seconds)
                got = time_loop(getattr(system, args.workload), loop)
                medians[name] = statistics.median(got) / 1000
            now = time.perf_counter()
            held = [sorted(os.sched_getaffinity(pid)) for pid in unison.worker_pids()]
            print(f"{now - start:5.1f} s  unison {medians['unison']:5.1f} µs  floor "
                  f"{medians['floor']:5.1f} µs  unison's workers may use {held}  crowd "
                  f"ended {now - crowd.until:.1f} s ago", flush=True)
    finally:
        unison.close()
        floor.close()


if __name__ == "__main__":
    main()
