"""How a call that outlasts run's spin comes back (issue 9, fifty-first pass).

    python benchmarks/long_calls.py [--workers 2] [--rounds 100] [--hogs 0]

For each workload, ``--rounds`` runs of one call to every worker: a busy loop of D ms, or a
sleep of D ms times the worker's rank (workers that end apart). Printed: the median round
less the call's own length (the longest worker's D), in µs; how many rounds took run's
quick path (``Router.quick``: every reply read and decoded in one step, else a wait's poll
and delivery); and the controller's CPU per round, in µs. ``--hogs`` adds CPU hogs beside
(a loaded host, a CI machine's). Compare revisions by running it under each one's
``PYTHONPATH=<tree>/src``, turns alternated.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import unison
from harness.measure import hogs
from harness.report import cpu_model


def busy(ms: float) -> int:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass
    return unison.rank()


def apart(ms: float) -> int:
    time.sleep(ms / 1000 * unison.rank())
    return unison.rank()


WORKLOADS: list[tuple[str, Callable[[float], int], float]] = [
    ("busy 0.5 ms", busy, 0.5), ("busy 2 ms", busy, 2.0), ("busy 5 ms", busy, 5.0),
    ("rank x 2 ms apart", apart, 2.0),
]


def measure(sess: unison.Session, fn: Callable[[float], int], ms: float, rounds: int,
            workers: int) -> tuple[float, int, float]:
    """(median round less the call's length in µs, quick rounds, controller CPU µs/round)."""
    router: Any = sess._router  # (internal: the quick path's outcome is not public)
    quick = router.quick
    hits = 0

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal hits
        got = quick(*args, **kwargs)
        hits += got is not None
        return got

    length = ms if fn is busy else ms * (workers - 1)
    sess.run(fn, ms)
    router.quick = counted
    try:
        times = []
        cpu = time.process_time()
        for _ in range(rounds):
            t = time.perf_counter()
            sess.run(fn, ms)
            times.append(time.perf_counter() - t)
        cpu = time.process_time() - cpu
    finally:
        del router.quick
    return (statistics.median(times) * 1e6 - length * 1e3, hits, cpu / rounds * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--hogs", type=int, default=0)
    args = parser.parse_args()
    print(f"# unison from {Path(unison.__file__).parent}; {cpu_model()}; "
          f"N={args.workers}, {args.hogs} hog(s)")
    with unison.Session(args.workers) as sess, hogs(args.hogs):
        for name, fn, ms in WORKLOADS:
            over, hits, cpu = measure(sess, fn, ms, args.rounds, args.workers)
            print(f"{name:>20}: round - call {over:7.1f} µs, quick {hits:3d}/{args.rounds}, "
                  f"controller CPU {cpu:6.1f} µs/round")


if __name__ == "__main__":
    main()
