"""Dispatch beside CPU hogs, unison against the pipe in alternating blocks (issue 9).

    python benchmarks/hogs_blocks.py --workers 1 [--blocks 12] [--seconds 0.5] [--hogs 2]

The full run's ``dispatch_hogs`` cells are one median each over 0.6 s, taken one system after
the other; beside hogs both systems swing by 2x from one second to the next
(benchmarks/hogs_timeline.py), so a single pair of cells can say either. This starts the
same hogs (harness.measure), one unison Session and one pipe system, then alternates blocks
of ``seconds`` of dispatch rounds between them, and prints each block's median µs and the
median of the blocks' medians. ``PYTHONPATH=<tree>/src`` picks the revision of unison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.measure import _HOG, Loop, time_loop
from harness.report import cpu_model, source_revision
from harness.systems import make_system


def block(round_trip: Callable[[], object], seconds: float) -> float:
    """The median µs of the round trips made in ``seconds`` (harness.measure's timed loop)."""
    loop = Loop(warmup=20, min_iters=1, max_iters=10**7, budget_s=seconds)
    return statistics.median(time_loop(round_trip, loop)) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--hogs", type=int, default=2)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}; {source_revision()}; command: python benchmarks/hogs_blocks.py "
          f"--workers {args.workers} --blocks {args.blocks} --seconds {args.seconds} "
          f"--hogs {args.hogs}")
    hogs = [subprocess.Popen([sys.executable, "-c", _HOG, str(os.getpid())])
            for _ in range(args.hogs)]
    systems = {name: make_system(name) for name in ("unison", "pipe")}
    medians: dict[str, list[float]] = {name: [] for name in systems}
    try:
        for system in systems.values():
            system.start(args.workers)
            system.dispatch()
        for _ in range(args.blocks):
            for name, system in systems.items():
                medians[name].append(block(system.dispatch, args.seconds))
    finally:
        for system in systems.values():
            system.close()
        for hog in hogs:
            hog.kill()
            hog.wait()
    for name, got in medians.items():
        print(f"{name:7s} N={args.workers}: " + " ".join(f"{m:.0f}" for m in got)
              + f" | median {statistics.median(got):.1f} µs")
    ratio = statistics.median(medians["pipe"]) / statistics.median(medians["unison"])
    print(f"pipe / unison: {ratio:.2f}x (above 1: unison is faster)")


if __name__ == "__main__":
    main()
