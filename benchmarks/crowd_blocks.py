"""What each process did in each block beside CPU hogs, and what pacing.crowd made of it.

    python benchmarks/crowd_blocks.py [--system unison-pipe] [--workload gather_small|dispatch]
                                      [--workers 1] [--hogs 2] [--blocks 12] [--seconds 0.3]

A unison session and the Pipe baseline take turns, a block each (as benchmarks/blocks.py
runs them). For each block: the median round, then for the controller and each worker their
time on the CPU and runnable but off it, and their switches onto it, per round
(/proc/<pid>/schedstat), and the CPU each last ran on; for unison's blocks, whether each side
judged the machine crowded (``pacing.crowd``: its long-yield rate and its verdict). It
found the pipe channel's slow mode beside two hogs (docs/benchmarks.md, "Issue 9,
thirty-second pass"): both processes on one CPU, each holding it for 26-30 µs while the other
was runnable, with no verdict on either side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.measure import Loop, hogs, time_loop
from harness.report import header
from harness.systems import make_system
from harness.systems.unison_session import UnisonSystem
from unison import pacing


def verdict() -> tuple[float, bool]:
    """This process's long-yield rate and whether it judges the machine crowded now."""
    return round(pacing.crowd.rate, 3), pacing.crowd.until > pacing._clock()


def _schedstat(pid: int) -> list[int]:
    with open(f"/proc/{pid}/schedstat") as f:
        return [int(x) for x in f.read().split()[:3]]


def _last_cpu(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])  # field 39, "processor"


def block(round_trip: Callable[[], object], seconds: float, pids: Sequence[int]) -> str:
    """Round trips for ``seconds``: the median, and each process's schedstat per round."""
    before = [_schedstat(p) for p in pids]
    times = time_loop(round_trip, Loop(warmup=0, min_iters=1, max_iters=10**7,
                                       budget_s=seconds))
    after = [_schedstat(p) for p in pids]
    n = len(times)
    parts = [f"{statistics.median(times) / 1000:6.1f} µs, {n} rounds"]
    for who, pid, b, a in zip(["controller", *(f"w{i}" for i in range(len(pids) - 1))],
                              pids, before, after):
        parts.append(f"{who}: on {(a[0] - b[0]) / n / 1000:.1f} off {(a[1] - b[1]) / n / 1000:.1f}"
                     f" switches {(a[2] - b[2]) / n:.2f} cpu{_last_cpu(pid)}")
    return " | ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--system", choices=["unison", "unison-pipe", "unison-inline"],
                   default="unison-pipe")
    p.add_argument("--workload", choices=["dispatch", "gather_small"], default="gather_small")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--hogs", type=int, default=2)
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--seconds", type=float, default=0.3)
    args = p.parse_args()
    print(header(sys.argv[1:]))
    name = args.system
    with hogs(args.hogs):
        systems = {name: make_system(name), "pipe": make_system("pipe")}
        try:
            for system in systems.values():
                system.start(args.workers)
                system.dispatch()
            for i in range(args.blocks):
                turn = list(systems.items())
                for label, system in turn if i % 2 == 0 else reversed(turn):
                    pids = [os.getpid(), *system.worker_pids()]
                    line = block(getattr(system, args.workload), args.seconds, pids)
                    if isinstance(system, UnisonSystem):
                        sess = system._sess
                        line += (f" | crowd: controller {verdict()}, "
                                 f"workers {sess.run(verdict)}")
                    print(f"block {i} {label:12} {line}", flush=True)
        finally:
            for system in systems.values():
                system.close()


if __name__ == "__main__":
    main()
