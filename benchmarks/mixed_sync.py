"""A mixed session (shared memory for the workers on this host, TCP for the others, as on a
Ray cluster with actors beside the driver): ``call`` then ``sync``, and ``run``, round trip
by round trip.

    python benchmarks/mixed_sync.py [--local 2] [--remote 1] [--blocks 6] [--seconds 0.3]

All workers run on this machine: tests/test_mixed.py's launcher starts each as a Ray actor
would (``connect_command``) and says which ranks are local, so the others join over
loopback TCP. Prints each block's median of the two rounds, in alternating blocks, and how
many commands each TCP worker was sent per ``call``-``sync`` round (1 where sync sends no
SYNC). ``PYTHONPATH=<tree>/src`` picks the revision of unison.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import unison
from harness.measure import block_medians
from harness.report import header
from harness.tasks import noop
from test_mixed import SpawnLauncher  # type: ignore[import-not-found]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local", type=int, default=2, help="workers over shared memory")
    p.add_argument("--remote", type=int, default=1, help="workers over TCP")
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--seconds", type=float, default=0.3)
    args = p.parse_args()
    print(header(sys.argv[1:]))
    n = args.local + args.remote
    launcher = SpawnLauncher(local=range(args.local))
    try:
        with unison.Session(n, launcher=launcher, start_timeout=60) as sess:
            def call_sync() -> None:
                sess.call(noop)
                sess.sync()

            def run() -> None:
                sess.run(noop)

            run()  # defines noop
            tcp = sess._chan.tcp  # type: ignore[attr-defined]
            remote = range(args.local, n)
            sent = sum(tcp._sent[r] for r in remote)
            rounds = 2000
            for _ in range(rounds):
                call_sync()
            per_round = (sum(tcp._sent[r] for r in remote) - sent) / rounds / args.remote
            medians = block_medians({"call+sync": call_sync, "run": run}, args.blocks,
                                    args.seconds)
    finally:
        launcher.stop(0)
    print(f"N={n} ({args.local} over shared memory, {args.remote} over TCP)")
    for name, got in medians.items():
        print(f"{name:9}: {' '.join(f'{m:.1f}' for m in got)} | median "
              f"{statistics.median(got):.1f} µs")
    print(f"commands sent to each TCP worker per call+sync round: {per_round:.2f}")


if __name__ == "__main__":
    main()
