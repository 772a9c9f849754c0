"""One arena block's life in one process: placed by the writer, viewed by a reader (a
command's copy-on-write view, as a worker makes), read a byte a page, dropped; µs each.

    python benchmarks/view_cost.py [--kib 128] [--rounds 3000]
    PYTHONPATH=/tmp/wt/src python benchmarks/view_cost.py ...   # another revision's tree

Before the forty-fourth pass of issue 9 each view was an mmap and a munmap of its own;
since, a view is a window into one mapping of the file, and its end reads pagemap.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

from harness.report import header
from unison.channel.arena import Arena, ArenaReader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kib", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3000)
    args = parser.parse_args()
    print(header(sys.argv[1:]))
    writer = Arena(f"unison-view-cost-{os.getpid()}", 1)
    reader = ArenaReader(os.dup(writer.fd), 0, 1)
    value = np.ones(args.kib << 7)  # float64
    try:
        for rounds in (args.rounds // 10 + 1, args.rounds):  # a warm-up, then the timing
            start = time.perf_counter()
            for _ in range(rounds):
                view = reader.view(writer.place([value], [0])[0])
                np.frombuffer(view, np.uint8)[::4096].sum()
                del view
        took = (time.perf_counter() - start) / args.rounds * 1e6
        print(f"{args.kib} KiB: {took:.1f} us per place, view, read and drop")
    finally:
        gc.collect()
        writer.close()
        os.close(reader.fd)


if __name__ == "__main__":
    main()
