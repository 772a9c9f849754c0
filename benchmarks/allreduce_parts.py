"""Where a small allreduce's time goes, inside the workers: the whole call against its parts.

    python benchmarks/allreduce_parts.py --workers 1 2 4 [--kib 4] [--rounds 5000]

Each worker times ``unison.allreduce(x)`` of a float32 array (``whole``), the same into an
array made once (``into``: ``unison.allreduce(x, out=out)``, as MPI's ``Allreduce(x, out)``
is timed in benchmarks/collectives.py), then the call that
runs its steps in C where they were built (``c_steps``: unison/_coll.c, with the generation's
bookkeeping around it); ``python`` is what is left: choosing the backend, checking the input,
the result array. Then it runs the steps of the numpy path (dtypes and ops the C steps do not
take, or a build without them) by hand, timing each:

    copy     the input into this worker's slot (and its size and signature words)
    meet     publish what it calls, arrive, wait for every peer, check their records
    reduce   read every peer's slot and reduce, in rank order
    depart   arrive at the second phase and wait for every peer (the slots may be reused)

At N=1 nobody waits and no cache line crosses a core: ``python`` there is the least any
allreduce through this backend costs. Medians over the workers of each one's mean per
round; µs.

It reaches into the backend's private steps (``ShmCollectives._publish`` and friends), as
benchmarks/layers.py does into the channel: a measurement tool, not an API.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import unison
from harness.report import cpu_model

STEPS = ("copy", "meet", "reduce", "depart")  # the numpy path's
PARTS = ("whole", "into", "c_steps", *STEPS)


def timed_parts(kib: int, rounds: int) -> dict[str, float]:
    """Run in each worker: mean µs per round of the whole allreduce, then of each part."""
    from unison import collective
    from unison.collective import shm
    from unison.collective.checks import array_signature, descriptor

    coll = collective._shm
    assert coll is not None, "this session has no shared-memory collectives"
    x = np.ones(kib * 256, np.float32)
    warm = max(100, rounds // 10)
    for _ in range(warm):
        unison.allreduce(x)
    clock = time.perf_counter_ns
    start = clock()
    for _ in range(rounds):
        unison.allreduce(x)
    whole = (clock() - start) / rounds
    into = np.empty_like(x)
    for _ in range(warm):
        unison.allreduce(x, out=into)
    start = clock()
    for _ in range(rounds):
        unison.allreduce(x, out=into)
    whole_into = (clock() - start) / rounds

    which, ranks = coll.scope(False)
    desc = descriptor("allreduce", "sum")
    sig = array_signature(x)
    out = np.empty_like(x)
    c_steps = float("nan")
    plan = coll._small_plan("sum", x, False) if coll._c is not None else ()
    if plan:  # built, and small enough
        for _ in range(warm):
            coll._allreduce_c(x, out, plan)
        start = clock()
        for _ in range(rounds):
            coll._allreduce_c(x, out, plan)
        c_steps = (clock() - start) / rounds
    me = coll._w[coll.rank]
    mine = coll._view(coll.lay.slot[coll.rank], x)
    spent = dict.fromkeys(STEPS, 0)
    for i in range(warm + rounds):
        t0 = clock()
        gen = coll._next(which, ranks, 1, desc)
        coll._q[me + shm._NBYTES] = x.nbytes
        coll._q[me + shm._SIG] = sig
        np.copyto(mine, x)
        t1 = clock()
        coll._meet(which, ranks, gen, desc, 0)
        t2 = clock()
        shm._reduce_into(out, [coll._view(coll.lay.slot[j], x) for j in ranks], np.add)
        t3 = clock()
        coll._finish(which, ranks, gen | 1, desc)
        t4 = clock()
        if i >= warm:
            spent["copy"] += t1 - t0
            spent["meet"] += t2 - t1
            spent["reduce"] += t3 - t2
            spent["depart"] += t4 - t3
    return {"whole": whole / 1e3, "into": whole_into / 1e3, "c_steps": c_steps / 1e3,
            **{k: v / rounds / 1e3 for k, v in spent.items()}}


def measure(workers: list[int], kib: int, rounds: int) -> list[dict[str, Any]]:
    rows = []
    for n in workers:
        with unison.Session(n) as sess:
            per_worker = sess.run(timed_parts, kib, rounds, timeout=600)
        row: dict[str, Any] = {"N": n}
        for part in PARTS:
            row[part] = statistics.median(w[part] for w in per_worker)
        row["python"] = row["whole"] - row["c_steps"]
        rows.append(row)
    return rows


def render(rows: list[dict[str, Any]], kib: int) -> str:
    cols = ["whole", "into", "c_steps", "python", *STEPS]
    lines = [f"allreduce of {kib} KiB float32, µs per round (median over the workers); "
             "copy to depart: the numpy path's steps", "",
             "| N | " + " | ".join(cols) + " |", "|--:|" + "--:|" * len(cols)]
    for row in rows:
        lines.append(f"| {row['N']} | " + " | ".join(f"{row[c]:.2f}" for c in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--kib", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5000)
    args = parser.parse_args(argv)
    print(f"# {cpu_model()}, {os.cpu_count()} CPUs, CPython {platform.python_version()}")
    print(render(measure(args.workers, args.kib, args.rounds), args.kib))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
