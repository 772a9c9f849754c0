"""Dispatch beside CPU hogs, as a timeline: is a slow median steady, or a mode that comes
and goes (issue 9)?

    python benchmarks/hogs_timeline.py --workers 1 8 --seconds 3 [--systems unison,pipe]

The full run's ``dispatch_hogs`` cell is one median over 0.6 s; a mode that lasts a second
decides it, or misses it. This starts the same hogs (harness.measure), then prints, for each
0.1 s of dispatch rounds: the median µs, the rounds run, and for unison the controller's
run delay per round (µs it spent runnable but off the core, from
/proc/thread-self/schedstat) with ``C`` where most of its rounds found it crowded (its
waits sleeping at once: unison.pacing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.measure import HOGS, hogs
from harness.report import cpu_model, source_revision
from harness.systems import System, make_system
from unison.pacing import crowd, run_delay

BLOCK = 0.1  # seconds per printed point


def _run_delay_ns() -> int:
    got = run_delay()
    return 0 if got is None else got[0]


def timeline(name: str, n: int, seconds: float, count: int) -> str:
    system = make_system(name)
    system.start(n)
    try:
        for _ in range(200):
            system.dispatch()
        with hogs(count):
            return f"{name} N={n}: " + " ".join(_points(name, system, seconds))
    finally:
        system.close()


def _points(name: str, system: System, seconds: float) -> list[str]:
    """Dispatch rounds for ``seconds``: one point per BLOCK (see the module's docstring)."""
    clock = time.perf_counter
    points: list[str] = []
    start = block_start = clock()
    delay = _run_delay_ns()
    rounds: list[float] = []
    crowded = 0
    while clock() - start < seconds:
        t0 = clock()
        system.dispatch()
        t1 = clock()
        rounds.append(t1 - t0)
        crowded += crowd.until > t1
        if t1 - block_start >= BLOCK:
            now = _run_delay_ns()
            point = f"{statistics.median(rounds) * 1e6:.0f}/{len(rounds)}"
            if name.startswith("unison"):
                point += f"/{(now - delay) / len(rounds) / 1e3:.0f}"
                point += "C" if 2 * crowded > len(rounds) else ""
            points.append(point)
            delay, rounds, crowded, block_start = now, [], 0, t1
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--systems", default="unison,pipe")
    parser.add_argument("--hogs", type=int, default=HOGS)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}; {source_revision()}; {args.hogs} hogs; each point: median µs "
          "/ rounds in 0.1 s [/ controller's run delay µs per round, C: crowded]\n")
    for n in args.workers:
        for name in args.systems.split(","):
            print(timeline(name, n, args.seconds, args.hogs), flush=True)


if __name__ == "__main__":
    main()
