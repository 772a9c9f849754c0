"""Fresh sessions one after another: does a session sometimes start in a slow mode and keep it?

    python benchmarks/session_modes.py [--workers 2 4] [--sessions 12] [--seconds 0.3]

The full run (benchmarks/run.py) measures one session per cell, blocks.py one session per
system for all its blocks: either can catch a session that runs slower than the others for
its whole life (where the processes landed, say). This opens ``--sessions`` sessions in
turn, times ``sess.call(noop); sess.sync()`` for ``seconds`` twice in each (right after a
warm-up, then again), and prints each session's two medians in µs, so a slow session shows
as a pair apart from the rest, and a slow start as a first figure above its second.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import unison
from harness.measure import Loop, time_loop
from harness.report import header
from harness.tasks import noop


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--seconds", type=float, default=0.3)
    args = p.parse_args()
    print(header(sys.argv[1:]))
    for n in args.workers:
        pairs = []
        for _ in range(args.sessions):
            with unison.Session(n) as sess:
                def dispatch() -> None:
                    sess.call(noop)
                    sess.sync()

                got = [statistics.median(time_loop(dispatch, Loop(
                    warmup=warmup, min_iters=1, max_iters=10**7, budget_s=args.seconds)))
                    / 1000 for warmup in (200, 0)]
            pairs.append(got)
        print(f"dispatch N={n}, each session's two medians (µs): "
              + " ".join(f"{a:.1f}/{b:.1f}" for a, b in pairs))
        print(f"dispatch N={n}: sessions' medians {min(min(x) for x in pairs):.1f}-"
              f"{max(max(x) for x in pairs):.1f} µs", flush=True)


if __name__ == "__main__":
    main()
