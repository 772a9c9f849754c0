"""Round trips with the controller and each worker held on a chosen CPU (issue 9).

    python benchmarks/placement.py [--systems unison,floor] [--workers 4]
                                   [--places "0|0011,0|0111,0|1111,free"] [--blocks 4]
                                   [--hogs 0]

With more processes than cores (N=4 on 2 CPUs: five processes) the scheduler puts them in
groups on the CPUs, and a round trip's time depends on which group the controller is in:
each CPU runs its processes' turns one after the other, so a round takes about as long as
the busiest CPU's turns. The groups change from one second to the next, and a block of a
benchmark can land in either (gather_small at N=4 read in two modes, 18 and 22 µs, within
one session). This holds the processes where ``--places`` says, one placement at a time, in
turns across the systems (each placement's blocks for every system, then the next), and
prints each system's median µs per placement and unison's ratio to the others.

A placement is ``C|W``: the controller's CPU, then each worker's, one digit per worker in
rank order (``0|0111``: the controller and worker 0 on CPU 0, workers 1-3 on CPU 1);
``*|0101`` lets the scheduler place the controller alone, ``free`` every process. Every
process is let go onto every CPU again at the end. The other systems' workers sleep while
one system is timed (their waits give up their spin after 200 µs), wherever they are.
``--hogs`` runs that many CPU-bound processes (harness.measure's) throughout, free to run
on any CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.measure import Loop, hogs, time_loop
from harness.report import command_line, cpu_model, source_revision
from harness.systems import make_system
from harness.systems.base import System


def parse_place(text: str, n: int, cpus: set[int]) -> tuple[int | None, list[int]] | None:
    """``C|W`` as (controller's CPU, None for ``*``; workers' CPUs); None for ``free``."""
    if text == "free":
        return None
    ctl, _, workers = text.partition("|")
    if not ((ctl.isdigit() or ctl == "*") and workers.isdigit() and len(workers) == n):
        raise ValueError(
            f"placement {text!r}: 'C|W' with C a CPU or *, one digit per worker ({n}), or free")
    place = (None if ctl == "*" else int(ctl)), [int(c) for c in workers]
    if not {*([] if place[0] is None else [place[0]]), *place[1]} <= cpus:
        raise ValueError(f"placement {text!r}: this process may run on CPUs {sorted(cpus)}")
    return place


def hold(pids: list[int], place: tuple[int | None, list[int]] | None, cpus: set[int]) -> None:
    """Hold this process and ``pids`` on ``place``'s CPUs (None: let them run anywhere)."""
    os.sched_setaffinity(0, cpus if place is None or place[0] is None else {place[0]})
    for i, pid in enumerate(pids):
        os.sched_setaffinity(pid, cpus if place is None else {place[1][i]})


def block_median(round_trip: Callable[[], object], seconds: float) -> float:
    """The median µs of the round trips made in ``seconds``."""
    loop = Loop(warmup=20, min_iters=1, max_iters=10**7, budget_s=seconds)
    return statistics.median(time_loop(round_trip, loop)) / 1000


def measure(names: list[str], workload: str, n: int, places: list[str], blocks: int,
            seconds: float) -> dict[tuple[str, str], list[float]]:
    """Each (system, placement)'s block medians in µs."""
    cpus = os.sched_getaffinity(0)
    parsed = {text: parse_place(text, n, cpus) for text in places}
    systems: dict[str, System] = {name: make_system(name) for name in names}
    got: dict[tuple[str, str], list[float]] = {(s, p): [] for s in names for p in places}
    every: list[int] = []
    try:
        for system in systems.values():
            system.start(n)
            every += system.worker_pids()
            for _ in range(500):
                getattr(system, workload)()
        for text, place in parsed.items():
            for i in range(blocks):
                turn = list(systems.items())
                for name, system in turn if i % 2 == 0 else reversed(turn):
                    hold([], None, cpus)
                    for other in every:
                        os.sched_setaffinity(other, cpus)
                    hold(system.worker_pids(), place, cpus)
                    got[name, text].append(block_median(getattr(system, workload), seconds))
    finally:
        for pid in every:
            try:
                os.sched_setaffinity(pid, cpus)
            except OSError:
                pass  # gone already
        os.sched_setaffinity(0, cpus)
        for system in systems.values():
            system.close()
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="unison,floor",
                        help="comma-separated, unison first (the ratios are unison's)")
    parser.add_argument("--workload", default="gather_small", choices=["dispatch", "gather_small"])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--places", default="0|0011,0|0111,0|1111,free")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=0.3)
    parser.add_argument("--hogs", type=int, default=0)
    args = parser.parse_args(argv)
    names, places = args.systems.split(","), args.places.split(",")
    if names[0] != "unison" or len(names) < 2:
        parser.error("--systems: unison first, then the systems it is read against")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs; {source_revision()}; command: "
          f"{command_line(sys.argv[1:] if argv is None else argv)}")
    try:
        with hogs(args.hogs):
            got = measure(names, args.workload, args.workers, places, args.blocks, args.seconds)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"\n{args.workload} at N={args.workers}, µs (median of {args.blocks} blocks)\n")
    print("| placement | " + " | ".join(names) + " | "
          + " | ".join(f"unison / {name}" for name in names[1:]) + " |")
    print("|---|" + "--:|" * (2 * len(names) - 1))
    for text in places:
        mid = {name: statistics.median(got[name, text]) for name in names}
        print(f"| {text} | " + " | ".join(f"{mid[name]:.1f}" for name in names) + " | "
              + " | ".join(f"{mid['unison'] / mid[name]:.2f}x" for name in names[1:]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
