"""Does a round's time depend on where each process's code sits in its address space (issue 9)?

    python benchmarks/layouts.py [--workers 4] [--workload dispatch|gather_small]
                                 [--sessions 6] [--seconds 0.3]

Where a session's processes outnumber the CPUs, each CPU runs several of them in turns, so
they share its caches, TLBs and branch predictors. unison forks its local workers from one
zygote per session (unison.launch.zygote), so they share one address-space layout. This
runs sessions in two arms, in turns: ``forked`` (as unison starts them) and ``apart``
(the zygote turned off: each worker a fresh interpreter, which address-space randomization
gives a layout of its own, as before the zygote). A floor system
(harness/systems/floor.py) starts beside each session, for reference. In each session the
controller is held on each CPU in turn, with the workers held one to a CPU as
``cpu_affinity=None`` holds them. For each block: the median µs, and the CPU time each of
unison's processes took per round (/proc/PID/sched); then, per arm, the median over all
blocks and their range. Each session's line says at how many addresses its workers' first
mappings start (1: one layout).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.measure import Loop, time_loop
from harness.report import command_line, cpu_model, source_revision
from harness.systems import make_system
from unison.launch import zygote


@contextmanager
def workers_apart() -> Iterator[None]:
    """The local launcher starts each worker as an interpreter of its own."""
    real = zygote.usable
    zygote.usable = lambda env: False
    try:
        yield
    finally:
        zygote.usable = real


def cpu_time(pid: int) -> float:
    """Nanoseconds process ``pid``'s main thread has run (/proc/PID/sched)."""
    with open(f"/proc/{pid}/sched") as f:
        for line in f:
            if line.startswith("se.sum_exec_runtime"):
                return float(line.split(":")[1]) * 1e6
    raise RuntimeError(f"/proc/{pid}/sched has no se.sum_exec_runtime")


def first_mapping(pid: int) -> str:
    """Where process ``pid``'s lowest mapping starts (its executable, unless randomized)."""
    with open(f"/proc/{pid}/maps") as f:
        return f.readline().split("-")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--workload", default="dispatch", choices=["dispatch", "gather_small"])
    parser.add_argument("--sessions", type=int, default=6, help="per arm")
    parser.add_argument("--seconds", type=float, default=0.3)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs; {source_revision()}; command: "
          f"{command_line(sys.argv[1:])}")
    cpus = sorted(os.sched_getaffinity(0))
    blocks: dict[str, dict[str, list[float]]] = {arm: {"unison": [], "floor": []}
                                                 for arm in ("forked", "apart")}
    for i in range(2 * args.sessions):
        arm = ("forked", "apart")[i % 2]
        unison, floor = make_system("unison"), make_system("floor")
        try:
            floor.start(args.workers)  # first: a start beside unison's workers is a crowd
            if arm == "apart":
                with workers_apart():
                    unison.start(args.workers)
            else:
                unison.start(args.workers)
            for system in (floor, unison):  # past what is left of their starts
                time_loop(getattr(system, args.workload), Loop(0, 1, 10**7, args.seconds))
            held = [sorted(os.sched_getaffinity(pid)) for pid in unison.worker_pids()]
            pids = [os.getpid(), *unison.worker_pids()]
            bases = {first_mapping(pid) for pid in pids[1:]}
            print(f"{arm} session {i // 2}, workers held on {held}, their first mappings at "
                  f"{len(bases)} address{'es' if len(bases) > 1 else ''}", flush=True)
            for cpu in cpus:
                os.sched_setaffinity(0, [cpu])
                got = {}
                for name, system in (("unison", unison), ("floor", floor)):
                    loop = Loop(warmup=200, min_iters=1, max_iters=10**7,
                                budget_s=args.seconds)
                    before = [cpu_time(pid) for pid in pids]
                    times = time_loop(getattr(system, args.workload), loop)
                    if name == "unison":
                        rounds = len(times) + loop.warmup
                        used = [(cpu_time(pid) - b) / rounds / 1000
                                for pid, b in zip(pids, before)]
                    got[name] = statistics.median(times) / 1000
                    blocks[arm][name].append(got[name])
                print(f"  controller on CPU {cpu}: unison {got['unison']:5.1f} µs, floor "
                      f"{got['floor']:5.1f} µs; unison's CPU µs a round: controller "
                      f"{used[0]:.1f}, workers {' '.join(f'{u:.1f}' for u in used[1:])}",
                      flush=True)
        finally:
            os.sched_setaffinity(0, cpus)
            unison.close()
            floor.close()
    print(f"\n{args.workload} at N={args.workers}, µs: median of the blocks (range)\n")
    print("| workers' layouts | unison | floor | unison / floor |\n|---|--:|--:|--:|")
    for arm, each in blocks.items():
        u, f = statistics.median(each["unison"]), statistics.median(each["floor"])
        print(f"| {arm} | {u:.1f} ({min(each['unison']):.1f}-{max(each['unison']):.1f}) | "
              f"{f:.1f} ({min(each['floor']):.1f}-{max(each['floor']):.1f}) | {u / f:.2f}x |")


if __name__ == "__main__":
    main()
