"""Allreduce between workers, timed inside the workers: unison's shared memory against
torch.distributed's gloo (and mpi4py where installed), side by side in one run.

    unison      unison.allreduce(x) on numpy float32, Session(N) (shared-memory backend)
    gloo        torch.distributed.all_reduce(t) on a float32 tensor, in a Session(N,
                collectives="torch") whose workers made the gloo group; raw gloo, nothing else
    unison-torch  unison.allreduce(t) through the torch backend (a shared-memory arrival
                barrier, then gloo)

Each worker times every round with perf_counter_ns after warm-up rounds; a round's time is
the slowest worker's (the rounds are in lockstep), and the table shows the median and p99.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

import unison

SIZES = {"4KiB": 4 << 10, "16MiB": 16 << 20}


def _rounds(nbytes: int, quick: bool) -> tuple[int, int]:
    if nbytes <= 64 << 10:
        return (20, 200) if quick else (300, 3000)
    return (2, 5) if quick else (5, 40)


def _time_unison(nbytes: int, warm: int, rounds: int) -> list[int]:
    x = np.ones(nbytes // 4, np.float32)
    for _ in range(warm):
        unison.allreduce(x)
    out = []
    for _ in range(rounds):
        t = time.perf_counter_ns()
        unison.allreduce(x)
        out.append(time.perf_counter_ns() - t)
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


def _lockstep(per_worker: list[list[int]]) -> list[int]:
    return [max(r) for r in zip(*per_worker)]


def measure(workers: list[int], quick: bool = False) -> list[dict[str, Any]]:
    rows = []
    have_torch = True
    try:
        import torch  # noqa: F401
    except ImportError:
        have_torch = False
    for n in workers:
        for label, nbytes in SIZES.items():
            warm, rounds = _rounds(nbytes, quick)
            row: dict[str, Any] = {"n": n, "size": label}
            with unison.Session(n) as sess:
                row["unison"] = _lockstep(sess.run(_time_unison, nbytes, warm, rounds))
            if have_torch:
                with unison.Session(n, collectives="torch") as sess:
                    row["gloo"] = _lockstep(sess.run(_time_torch, nbytes, warm, rounds, True))
                    row["unison-torch"] = _lockstep(
                        sess.run(_time_torch, nbytes, warm, rounds, False))
            rows.append(row)
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    systems = [s for s in ("unison", "gloo", "unison-torch") if any(s in r for r in rows)]
    lines = ["| allreduce float32 | N | " + " | ".join(systems) + " | gloo / unison |",
             "|---|--:|" + "--:|" * len(systems) + "--:|"]
    for r in rows:
        cells = []
        for s in systems:
            v = r.get(s)
            if v:
                srt = sorted(v)
                cells.append(f"{_us(statistics.median(srt))} / {_us(srt[int(len(srt) * .99)])}")
            else:
                cells.append("-")
        ratio = (statistics.median(r["gloo"]) / statistics.median(r["unison"])
                 if r.get("gloo") and r.get("unison") else None)
        shown = f"{ratio:.1f}x" if ratio else "-"
        lines.append(f"| {r['size']} (µs, median / p99) | {r['n']} | " + " | ".join(cells)
                     + f" | {shown} |")
    return "\n".join(lines)


def _us(ns: float) -> str:
    us = ns / 1000
    return f"{us:.3g}" if us < 100 else f"{us:.0f}"


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="unison bench-collectives", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="2,4")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    rows = measure([int(w) for w in args.workers.split(",")], args.quick)
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
