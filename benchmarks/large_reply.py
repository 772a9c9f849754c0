"""Move a large value each way: the best of ``--rounds`` times of ``ref.gather()`` (every
worker's value back) and of ``sess.put(value); sess.sync()`` (one value out to every worker).

    python benchmarks/large_reply.py [--channel shm] [--kinds bytes str array] [--mib 1 32]
    PYTHONPATH=/tmp/wt/src python benchmarks/large_reply.py ...   # another revision's tree

A value returned by a call stays on its worker; ``gather`` asks for it and reads it back
whole. ``--kinds``: bytes, str, or a numpy array of uint8 (the way out of band, the one to
compare with). Run two revisions in turns to compare them (issue 9, thirty-first pass: the
pipe channel's reply reads; thirty-seventh: bytes out of band, long strings pickled).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

import unison
from harness.report import header


def filled(kind: str, nbytes: int) -> Any:
    if kind == "bytes":
        return b"z" * nbytes
    if kind == "str":
        return "z" * nbytes
    return np.full(nbytes, 122, dtype=np.uint8)


def best_of(rounds: int, step: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--channel", default="shm")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kinds", nargs="+", default=["bytes"], choices=["bytes", "str", "array"])
    parser.add_argument("--mib", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(header(sys.argv[1:]))
    with unison.Session(args.workers, channel=args.channel) as sess:
        for kind in args.kinds:
            for mib in args.mib:
                ref = sess.call(filled, kind, mib << 20)
                sess.sync()
                back = best_of(args.rounds, ref.gather)
                ref.free()
                value = filled(kind, mib << 20)

                def put(value: Any = value) -> None:
                    sess.put(value)
                    sess.sync()

                out = best_of(args.rounds, put)
                print(f"{args.channel}: {kind} of {mib} MiB: gather from {args.workers} workers "
                      f"{back * 1000:.1f} ms, put to them {out * 1000:.1f} ms "
                      f"(best of {args.rounds})")


if __name__ == "__main__":
    main()
