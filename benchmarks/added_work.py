"""How much a µs of Python on each side adds to a round trip (issue 9).

    python benchmarks/added_work.py [--workers 2 4] [--extra 5 10 20] [--reps 5]

Each round is one dispatch (a call to every worker, then a wait for all), with D µs of busy
loop added either on the controller (before the call) or in the called function (on every
worker). Printed: the median round in µs for D = 0 and each extra D, and the growth over
D = 0. A growth of D means that side's Python adds one for one; more means it also holds up
the others (a worker on the controller's core, on a 2-core host). Same run, turns interleaved,
for the floor system and unison.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.report import cpu_model, source_revision
from harness.systems import make_system

SYSTEMS = ("floor", "unison")
TURN = 0.3  # seconds of rounds per measurement


def busy(seconds: float) -> None:
    """The added work: a busy loop (a function of this module, so workers can import it)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def per_round(call: Callable[[Callable[..., object], tuple[float, ...]], None],
              controller: float, worker: float) -> float:
    """µs per round of ``call(busy, (worker,))``, with ``controller`` s of busy loop first."""
    start = time.perf_counter()
    rounds = 0
    while time.perf_counter() - start < TURN:
        for _ in range(50):
            if controller:
                busy(controller)
            call(busy, (worker,))
        rounds += 50
    return (time.perf_counter() - start) / rounds * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--extra", type=float, nargs="+", default=[5, 10, 20],
                        help="µs of added work")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}; {source_revision()}; command: python benchmarks/added_work.py "
          f"--workers {' '.join(map(str, args.workers))} "
          f"--extra {' '.join(f'{d:g}' for d in args.extra)} --reps {args.reps}\n")
    cells = [("controller", d) for d in args.extra] + [("worker", d) for d in args.extra]
    print("| system | N | none | " + " | ".join(f"+{d:g} µs on the {side}"
                                                  for side, d in cells) + " |")
    print("|---|--:|--:|" + "--:|" * len(cells))
    for n in args.workers:
        for name in SYSTEMS:
            system = make_system(name)
            system.start(n)
            try:
                for _ in range(1000):
                    system.call(busy, (0.0,))
                got: dict[tuple[str, float], list[float]] = {}
                for _ in range(args.reps):
                    for side, d in [("none", 0.0), *cells]:
                        s = d * 1e-6
                        got.setdefault((side, d), []).append(per_round(
                            system.call, s if side == "controller" else 0.0,
                            s if side == "worker" else 0.0))
                base = statistics.median(got[("none", 0.0)])
                row = [f"{statistics.median(got[c]):.1f} (+{statistics.median(got[c]) - base:.1f})"
                       for c in cells]
                print(f"| {name} | {n} | {base:.1f} | " + " | ".join(row) + " |", flush=True)
            finally:
                system.close()


if __name__ == "__main__":
    main()
