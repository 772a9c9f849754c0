"""Two or more systems in alternating blocks of one workload, in one process (issue 9).

    python benchmarks/blocks.py [--systems unison,floor] [--workloads dispatch gather_small]
                                [--workers 2 4] [--hogs 0] [--blocks 12] [--seconds 0.5]

The full run (benchmarks/run.py) measures one system after the other, a single median each.
The machine drifts between them: unison / floor for dispatch at N=2 read 0.98x, 1.54x and
1.68x in three full runs of one hour, and beside hogs both unison and the pipe swing by 2x
from one second to the next (benchmarks/hogs_timeline.py). So one pair of cells can say
either. This starts every system at once (and ``--hogs`` CPU hogs, harness.measure's), then
runs blocks of ``seconds`` of the workload's round trips on each in turn, the order reversed
every other block so that a trend hits both alike, and prints each block's median µs, the
median of the blocks' medians, and unison's ratio to each other system (below 1: unison is
faster). ``PYTHONPATH=<tree>/src`` picks the revision of unison.

With that ratio comes a 90% interval for it: the blocks resampled in their pairs (block i
of unison with block i of the other system, from the same turn), 2000 times, the ratio of
the medians taken each time. A turn runs the systems in ``--systems`` order, the next one in
reverse (U F P, then P F U), so a pair's two blocks are next to each other only for the
system after unison; for the others, the blocks of the systems between them ran in between.
A ratio whose whole interval is under a target meets it on this run; one whose interval
straddles it is at the line, and another run may read either way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.measure import Loop, hogs, interval, tail, time_loop
from harness.report import cpu_model, cpu_ticks, source_revision, steal
from harness.systems import make_system


def block(round_trip: Callable[[], object], seconds: float) -> list[int]:
    """The ns of each round trip made in ``seconds`` (harness.measure's timed loop)."""
    loop = Loop(warmup=20, min_iters=1, max_iters=10**7, budget_s=seconds)
    return time_loop(round_trip, loop)


def measure(names: list[str], workloads: list[str], n: int, blocks: int, seconds: float
            ) -> tuple[dict[tuple[str, str], list[float]], dict[tuple[str, str], list[int]]]:
    """Each (system, workload)'s block medians (µs) and all its rounds (ns) at ``n``
    workers, the systems alternating."""
    systems = {name: make_system(name) for name in names}
    medians: dict[tuple[str, str], list[float]] = {
        (name, w): [] for name in names for w in workloads}
    rounds: dict[tuple[str, str], list[int]] = {key: [] for key in medians}
    try:
        for system in systems.values():
            system.start(n)
            system.dispatch()
        for workload in workloads:
            for i in range(blocks):
                turn = list(systems.items())
                for name, system in turn if i % 2 == 0 else reversed(turn):
                    got = block(getattr(system, workload), seconds)
                    medians[name, workload].append(statistics.median(got) / 1000)
                    rounds[name, workload] += got
    finally:
        for system in systems.values():
            system.close()
    return medians, rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="unison,floor",
                        help="comma-separated, a unison system first (unison, unison-pipe, "
                             "unison-tcp, unison-inline: the ratios are its)")
    parser.add_argument("--workloads", nargs="+", default=["dispatch", "gather_small"],
                        choices=["dispatch", "gather_small"])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hogs", type=int, default=0)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args()
    names = args.systems.split(",")
    if not names[0].startswith("unison") or len(names) < 2:
        parser.error("--systems: a unison system first, then the systems it is read against")
    ours = names[0]
    print(f"CPU: {cpu_model()}; {source_revision()}; command: python benchmarks/blocks.py "
          f"--systems {args.systems} --workloads {' '.join(args.workloads)} --workers "
          f"{' '.join(map(str, args.workers))} --hogs {args.hogs} --blocks {args.blocks} "
          f"--seconds {args.seconds}")
    with hogs(args.hogs):
        for n in args.workers:
            ticks = cpu_ticks()
            medians, rounds = measure(names, args.workloads, n, args.blocks, args.seconds)
            for workload in args.workloads:
                mid = {name: statistics.median(medians[name, workload]) for name in names}
                for name in names:
                    print(f"{workload} N={n} {name:8s}: "
                          + " ".join(f"{m:.1f}" for m in medians[name, workload])
                          + f" | median {mid[name]:.1f} µs")
                ratios = []
                for name in names[1:]:
                    low, high = interval(medians[ours, workload], medians[name, workload])
                    ratios.append(f"{ours} / {name}: {mid[ours] / mid[name]:.2f}x "
                                  f"(90%: {low:.2f}-{high:.2f})")
                print(f"{workload} N={n} " + ", ".join(ratios) + f" (below 1: {ours} is faster)")
                for name in names:
                    ratio, share = tail(rounds[name, workload])
                    print(f"{workload} N={n} {name}: p99/median {ratio:.2f}, {share:.2f}% "
                          "of rounds at 3x+")
            print(f"N={n}: CPU time stolen by the hypervisor meanwhile: "
                  f"{steal(ticks, cpu_ticks())}", flush=True)


if __name__ == "__main__":
    main()
