"""Dispatch beside CPU hogs, as a timeline: is a slow median steady, or a mode that comes
and goes (issue 9)?

    python benchmarks/hogs_timeline.py --workers 1 8 --seconds 3 [--systems unison,pipe]
                                       [--workload dispatch|gather_small] [--hogs 2]

The full run's ``dispatch_hogs`` cell is one median over 0.6 s; a mode that lasts a second
decides it, or misses it. This starts the same hogs (harness.measure), then prints, for each
0.1 s of dispatch rounds: the median µs, the rounds run, and for unison the controller's
run delay per round (µs it spent runnable but off the core, from
/proc/thread-self/schedstat) with ``C`` where most of its rounds found it crowded (its
waits sleeping at once: unison.pacing); and, for every system, ``=`` where most of the
point's samples (one each SAMPLE seconds) found the controller on worker 0's CPU. After
each timeline, the median of the points with ``=`` and of those without.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.measure import HOGS, hogs
from harness.report import header
from harness.systems import System, make_system
from unison.pacing import crowd, run_delay
from unison.placement import last_cpu

BLOCK = 0.1  # seconds per printed point
SAMPLE = 0.01  # seconds between looks at where the controller and worker 0 run


def _run_delay_ns() -> int:
    got = run_delay()
    return 0 if got is None else got[0]


def timeline(name: str, n: int, seconds: float, count: int, workload: str) -> str:
    system = make_system(name)
    system.start(n)
    try:
        for _ in range(200):
            getattr(system, workload)()
        with hogs(count):
            points = _points(name, system, seconds, workload)
    finally:
        system.close()
    text = f"{name} N={n}: " + " ".join(point for point, _, _ in points)
    for label, shared in (("on worker 0's CPU", True), ("apart", False)):
        medians = [median for _, median, together in points if together == shared]
        if medians:
            text += (f"\n  {label}: {len(medians)} points, median "
                     f"{statistics.median(medians):.1f} µs")
    return text


def _points(name: str, system: System, seconds: float,
            workload: str) -> list[tuple[str, float, bool]]:
    """Rounds for ``seconds``: one point per BLOCK (see the module's docstring), with its
    median µs and whether the controller mostly ran on worker 0's CPU."""
    clock = time.perf_counter
    round_trip = getattr(system, workload)
    worker0 = system.worker_pids()[0]
    points: list[tuple[str, float, bool]] = []
    start = block_start = next_sample = clock()
    delay = _run_delay_ns()
    rounds: list[float] = []
    crowded = together = samples = 0
    while clock() - start < seconds:
        t0 = clock()
        round_trip()
        t1 = clock()
        rounds.append(t1 - t0)
        crowded += crowd.until > t1
        if t1 >= next_sample:
            next_sample = t1 + SAMPLE
            mine = last_cpu()
            together += mine is not None and mine == last_cpu(worker0)
            samples += 1
        if t1 - block_start >= BLOCK:
            now = _run_delay_ns()
            median = statistics.median(rounds) * 1e6
            point = f"{median:.0f}/{len(rounds)}"
            if name.startswith("unison"):
                point += f"/{(now - delay) / len(rounds) / 1e3:.0f}"
                point += "C" if 2 * crowded > len(rounds) else ""
            shared = 2 * together > samples
            points.append((point + ("=" if shared else ""), median, shared))
            delay, rounds, crowded, block_start = now, [], 0, t1
            together = samples = 0
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--systems", default="unison,pipe")
    parser.add_argument("--hogs", type=int, default=HOGS)
    parser.add_argument("--workload", default="dispatch", choices=["dispatch", "gather_small"])
    args = parser.parse_args()
    print(header(sys.argv[1:]))
    print(f"{args.hogs} hogs; {args.workload}; each "
          "point: median µs / rounds in 0.1 s [/ controller's run delay µs per round, C: "
          "crowded] [=: the controller on worker 0's CPU]\n")
    for n in args.workers:
        for name in args.systems.split(","):
            print(timeline(name, n, args.seconds, args.hogs, args.workload), flush=True)


if __name__ == "__main__":
    main()
