"""Fetch a large value from every worker: the best of ``--rounds`` ``ref.gather()`` times.

    python benchmarks/large_reply.py --channel pipe --mib 1 32
    PYTHONPATH=/tmp/wt/src python benchmarks/large_reply.py ...   # another revision's tree

A value returned by a call stays on its worker; ``gather`` asks for it and reads it back
whole (on the pipe channel: pickled, through each worker's reply pipe). Run two revisions
in turns to compare them (issue 9, thirty-first pass: the pipe channel's reply reads).
"""

from __future__ import annotations

import argparse
import time

import unison


def filled(nbytes: int) -> bytes:
    return b"z" * nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--channel", default="pipe")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mib", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with unison.Session(args.workers, channel=args.channel) as sess:
        for mib in args.mib:
            ref = sess.call(filled, mib << 20)
            sess.sync()
            best = float("inf")
            for _ in range(args.rounds):
                start = time.perf_counter()
                ref.gather()
                best = min(best, time.perf_counter() - start)
            print(f"{args.channel}: {mib} MiB from each of {args.workers} workers: "
                  f"{best * 1000:.1f} ms (best of {args.rounds})")


if __name__ == "__main__":
    main()
