"""Read a shared array on every worker, call after call: each call's page faults and read
time per worker, the first call against the later ones.

    python benchmarks/shared_reads.py [--workers 2] [--mib 64] [--calls 4]
    PYTHONPATH=/tmp/wt/src python benchmarks/shared_reads.py ...   # another revision's tree

A ``sess.empty()`` array lives in the session's shared memory; each call that passes it
hands every worker a view of it. A worker that mapped each view anew faulted on its pages
at every call; one that maps the arena once faults only the first time (issue 9,
forty-fourth pass).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

import unison
from harness.report import header


def read_pages(x: np.ndarray) -> tuple[int, float]:
    """This worker's page faults and ms reading one byte of each page of ``x``."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    x.view(np.uint8)[::4096].sum()
    ms = (time.perf_counter() - start) * 1e3
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args()
    print(header(sys.argv[1:]))
    with unison.Session(args.workers) as sess:
        shared = sess.empty(args.mib << 17)  # float64
        shared[:] = 1.0
        for call in range(1, args.calls + 1):
            got = sess.run(read_pages, shared)
            cells = ", ".join(f"{faults} faults {ms:.2f} ms" for faults, ms in got)
            print(f"call {call}: {cells}")


if __name__ == "__main__":
    main()
