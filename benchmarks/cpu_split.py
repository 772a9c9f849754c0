"""Where a dispatch round trip's time goes on shared cores (issue 9): the CPU each process
(controller and workers) uses per round, and how often each was switched out involuntarily,
for unison and the floor system, one after the other.

    python benchmarks/cpu_split.py --workers 2 4 [--rounds 5000] [--systems unison,floor]

Read from /proc/PID/task/*/schedstat (CPU ns) and /proc/PID/task/*/status
(nonvoluntary_ctxt_switches) before and after the timed rounds. A process that spins uses
CPU while it waits, so the figures show who held a core, not only who worked: with more
busy processes than cores, two processes taking turns on one core show as ~1 switch each
per round and a CPU share near half the round.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.systems import make_system
from harness.systems.base import System


def _counters(pid: int) -> tuple[int, int]:
    """(CPU ns, involuntary context switches) of every thread of ``pid``."""
    cpu = switches = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            cpu += int(f.read().split()[0])
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                if line.startswith("nonvoluntary_ctxt_switches"):
                    switches += int(line.split()[1])
    return cpu, switches


def split(system: System, rounds: int) -> tuple[float, list[tuple[float, float]]]:
    """µs per round, and per process (controller first) its CPU µs and switches per round."""
    for _ in range(1000):
        system.dispatch()
    pids = [os.getpid(), *(p for p in system.worker_pids() if p != os.getpid())]
    gc.disable()
    try:
        before = [_counters(p) for p in pids]
        start = time.perf_counter()
        for _ in range(rounds):
            system.dispatch()
        took = time.perf_counter() - start
        after = [_counters(p) for p in pids]
    finally:
        gc.enable()
    per = [((a[0] - b[0]) / rounds / 1e3, (a[1] - b[1]) / rounds) for a, b in zip(after, before)]
    return took / rounds * 1e6, per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5000)
    parser.add_argument("--systems", default="unison,floor")
    args = parser.parse_args()
    print("| system | N | µs per round | per process (controller first): CPU µs / "
          "involuntary switches per round |")
    print("|---|--:|--:|---|")
    for n in args.workers:
        for name in args.systems.split(","):
            system = make_system(name)
            system.start(n)
            try:
                wall, per = split(system, args.rounds)
            finally:
                system.close()
            cells = ", ".join(f"{cpu:.1f} / {sw:.2f}" for cpu, sw in per)
            print(f"| {name} | {n} | {wall:.1f} | {cells} |")


if __name__ == "__main__":
    main()
