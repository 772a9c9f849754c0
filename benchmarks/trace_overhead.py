"""What tracing costs (issue 13): the dispatch round trip ``sess.run(noop)`` with the trace
off and on, interleaved in blocks in one session so that the machine's noise hits both.

    python benchmarks/trace_overhead.py --workers 2 4 [--rounds 4000]

A traced block runs inside ``sess.trace()`` (its start and stop, one round trip each, are
outside the timed calls). Prints medians and p99 (µs) and the ratio of the medians
(target: at most 1.10x).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import unison
from harness.measure import percentile
from harness.report import cpu_model
from harness.tasks import noop

BLOCK = 200


def measure(n: int, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"off": [], "on": []}
    clock = time.perf_counter
    with unison.Session(n) as sess:
        for _ in range(300):
            sess.run(noop)
        for block in range(2 * rounds // BLOCK):
            traced = block % 2 == 1
            out = times["on" if traced else "off"]
            if traced:
                with sess.trace():
                    for _ in range(BLOCK):
                        t = clock()
                        sess.run(noop)
                        out.append(clock() - t)
            else:
                for _ in range(BLOCK):
                    t = clock()
                    sess.run(noop)
                    out.append(clock() - t)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=4000)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}; command: python benchmarks/trace_overhead.py --workers "
          f"{' '.join(map(str, args.workers))} --rounds {args.rounds}\n")
    print("| N | off median µs | on median µs | off p99 | on p99 | on / off |")
    print("|---|---|---|---|---|---|")
    for n in args.workers:
        t = measure(n, args.rounds)
        off, on = (statistics.median(t[k]) * 1e6 for k in ("off", "on"))
        p_off, p_on = (percentile(sorted(t[k]), 99) * 1e6 for k in ("off", "on"))
        print(f"| {n} | {off:.1f} | {on:.1f} | {p_off:.1f} | {p_on:.1f} | {on / off:.3f}x |")


if __name__ == "__main__":
    main()
