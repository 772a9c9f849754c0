"""How long ``sess.close()`` takes, by the number of workers (issue 9, thirty-eighth pass:
a worker's end, ``unison.worker._end``).

    python benchmarks/close_time.py [--workers 1 2 8] [--sessions 15]

Opens ``--sessions`` sessions of each size in turn, runs one call in each, and times its
close until every worker has exited (close waits for that). Prints the median, the least
and the most, in ms. Read two revisions side by side with ``PYTHONPATH`` on a worktree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import unison
from harness.report import header
from harness.tasks import noop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--sessions", type=int, default=15)
    args = parser.parse_args()
    print(header(sys.argv[1:]))
    for n in args.workers:
        took = []
        for _ in range(args.sessions):
            sess = unison.Session(n)
            sess.run(noop)
            start = time.perf_counter()
            sess.close()
            took.append((time.perf_counter() - start) * 1e3)
        print(f"N={n}: close {statistics.median(took):.1f} ms (median of {len(took)}; "
              f"{min(took):.1f}-{max(took):.1f})")


if __name__ == "__main__":
    main()
