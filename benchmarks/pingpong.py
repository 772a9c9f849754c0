"""Point-to-point latency between two workers: ``unison.send`` then ``unison.recv`` back,
timed inside worker 0 (the shared-memory collectives' mailboxes and their waits).

    python benchmarks/pingpong.py [--exchanges 3000] [--repeats 5]
    PYTHONPATH=<tree>/src python benchmarks/pingpong.py     # another revision's, to compare

Prints the median and each repetition's µs per exchange (one send and one recv on each
worker). Run two revisions in turns to compare them: a figure from another run means
little on a 2-core host.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import unison
from harness.report import command_line, cpu_model, source_revision


def pingpong(exchanges: int) -> float:
    """µs per exchange, as this worker saw it."""
    me = unison.rank()
    start = time.perf_counter()
    for i in range(exchanges):
        if me == 0:
            unison.send(i, 1)
            unison.recv(1)
        else:
            unison.recv(0)
            unison.send(i, 0)
    return (time.perf_counter() - start) / exchanges * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--exchanges", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(f"CPU: {cpu_model()}; {source_revision()}; command: "
          f"{command_line(sys.argv[1:] if argv is None else argv)}")
    with unison.Session(2) as sess:
        sess.run(pingpong, max(1, args.exchanges // 10))  # warm: imports, first waits
        took = [sess.run(pingpong, args.exchanges)[0] for _ in range(args.repeats)]
    print(f"send/recv ping-pong, N=2: median {statistics.median(took):.2f} µs per exchange "
          f"({', '.join(f'{t:.2f}' for t in took)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
