"""The flags of ``benchmarks/run.py``, and the run they start: measure, print, write."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from harness import report
from harness.measure import FULL, QUICK, WORKLOADS, ScriptCall, run_benchmark
from harness.systems import SYSTEMS, available, describe, mpi

_ONE_MEASUREMENT = (
    "\nEach cell is one measurement of some tens of milliseconds: at 4 KiB, unison / mpi read "
    "0.87x to 2.29x at N=2 on one host (2026-12-06). `python benchmarks/collectives.py --turns 8 "
    "--workers 2,4` measures unison and MPI in turns, with the ratio's 90% interval "
    "(issue 9's figures in the sections below).\n")
"""Said under the allreduce table: its cells are single measurements, which swing."""


def int_list(text: str) -> list[int]:
    """``--workers 1,2,4``: positive ints, comma-separated (also used by compare_revs.py)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4,8, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers like 1,2,4,8, got {text!r}")
    return values


def _choices(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(bad) or 'empty list'}: choose from {', '.join(allowed)}"
            )
        return values

    return parse


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/run.py",
        description="Dispatch, gather, put, fetch, start and idle costs of unison and its "
                    "baselines, and allreduce against gloo.",
    )
    p.add_argument("--workers", type=int_list, default=[1, 2, 4, 8],
                   help="comma-separated worker counts (default 1,2,4,8)")
    p.add_argument("--quick", action="store_true",
                   help="few iterations and short windows: a smoke test, not a measurement")
    p.add_argument("--only", type=_choices(WORKLOADS), default=list(WORKLOADS),
                   help=f"workloads to run (default all: {','.join(WORKLOADS)})")
    p.add_argument("--systems", type=_choices(SYSTEMS), default=None,
                   help=f"systems to run (default every available one of {','.join(SYSTEMS)})")
    p.add_argument("--fetch-mib", type=_positive, default=64,
                   help="MiB of float64 each worker returns in the fetch workload (default 64)")
    p.add_argument("--out", type=Path, help="markdown file whose results section to rewrite")
    p.add_argument("--plot", type=Path, help="PNG of latency against N (needs matplotlib)")
    p.add_argument("--json", type=Path, help="write every number as JSON here")
    return p.parse_args(argv)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None, script: ScriptCall | None = None) -> int:
    """Run the benchmark. ``script`` is the function of the user's script (and its
    arguments) that ``dispatch_script_fn`` calls; benchmarks/run.py passes its own. In a rank
    of the mpi4py system's mpiexec job (which runs this same script), serve that job instead."""
    if (job := os.environ.get(mpi.JOB_ENV)) is not None:
        return mpi.job_main(job, script)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    systems: list[str] = []
    for name in args.systems or SYSTEMS:
        if available(name):
            systems.append(name)
        elif args.systems:
            _log(f"[bench] skipping {name}: its package is not importable here")
    workers: list[int] = args.workers
    workloads = [w for w in WORKLOADS if w in args.only]
    if "dispatch_script_fn" in workloads and script is None:
        _log("[bench] dispatch_script_fn needs a function of the script: run benchmarks/run.py")
        return 2
    per_system = [w for w in workloads if w != "allreduce"]
    plan = QUICK if args.quick else FULL
    _log(f"[bench] systems {', '.join(systems)}; N = {', '.join(map(str, workers))}; "
         f"workloads {', '.join(workloads)}{' (quick)' if args.quick else ''}")

    machine = report.machine_info()  # before the run: it says how quiet the host was
    busy = machine["busy_before"]
    if busy.endswith("%") and float(busy[:-1]) > 20:
        _log(f"[bench] warning: the host's CPUs are {busy} busy before the run; "
             "the numbers will be noisy")
    t0 = time.perf_counter()
    ticks = report.cpu_ticks()
    try:
        cells = run_benchmark(systems, workers, per_system, plan, _log, script,
                              args.fetch_mib << 20) if per_system else []
        collective_table = ""
        if "allreduce" in workloads and [n for n in workers if n >= 2]:
            import collectives

            _log("[bench] allreduce inside the workers: unison against gloo")
            rows = collectives.measure([n for n in workers if 2 <= n <= 4] or
                                       [min(n for n in workers if n >= 2)], args.quick)
            collective_table = collectives.render(rows)
    except KeyboardInterrupt:
        _log("[bench] interrupted; everything started was stopped")
        return 130
    machine["steal"] = report.steal(ticks, report.cpu_ticks())
    _log(f"[bench] done in {time.perf_counter() - t0:.1f} s; CPU time stolen by the "
         f"hypervisor meanwhile: {machine['steal']}")

    command = report.command_line(argv)
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    print(report.render_table(cells, systems, workers))
    for title, table in (
        (report.FLOOR_RATIO_TITLE, report.render_floor_ratios(cells, systems, workers)),
        (report.PIPE_RATIO_TITLE, report.render_ratios(cells, systems, workers)),
        (report.SCRIPT_RATIO_TITLE, report.render_script_ratios(cells, systems, workers)),
        ("", collective_table),
    ):
        if table:
            print(f"\n{title}\n\n{table}" if title else f"\n{table}")

    plot_ref = None
    if args.plot:
        title = (f"unison bench, {date}: {machine['nproc']} CPUs ({machine['cpu']}), "
                 f"{machine['python']}")
        if report.write_plot(cells, systems, workers, args.plot, title):
            _log(f"[bench] wrote {args.plot}")
            base = args.out.parent if args.out else Path.cwd()
            plot_ref = os.path.relpath(args.plot.resolve(), base.resolve())
        else:
            _log("[bench] matplotlib is not installed: skipping --plot "
                 "(pip install matplotlib, or the 'bench' extra)")
    if args.out:
        section = report.render_section(cells, systems, workers, command, date, machine,
                                        args.quick, plot_ref)
        if collective_table:
            section += ("\nAllreduce of float32 between the workers, timed inside them "
                        "(`benchmarks/collectives.py`; a round counts the slowest worker):\n\n"
                        + collective_table + "\n" + _ONE_MEASUREMENT)
        report.update_section(args.out, section)
        _log(f"[bench] updated {args.out}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "command": command, "date": date, "machine": machine, "quick": args.quick,
            "workers": workers, "workloads": workloads,
            "systems": {s: describe(s) for s in systems},
            "results": [asdict(c) for c in cells],
        }, indent=1) + "\n", encoding="utf-8")
        _log(f"[bench] wrote {args.json}")
    return 1 if any(c.error for c in cells) else 0
