"""How long a deadlock of point-to-point waits takes to be raised (issue 9, twenty-sixth pass).

    python benchmarks/deadlocks.py [--repeats 20]

Each kind of cycle that unison.collective.shm raises instead of hanging on, ``--repeats``
times in one session per N: every rank sends RING + 1 messages to the next before
receiving any (``send``), or receives from the next first (``recv``). A repetition is
timed from the call to the WorkerError; the table shows the median and the slowest, and a
repetition that ends any other way stops the run. A waiter looks for a cycle every 50 ms
and raises on the second look that reads the same, so about 0.1 s is the design.
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
from unison.collective.shm import RING


def cycle(kind: str) -> None:
    """This rank's part of a cycle through every rank: each waits on the next."""
    me, n = unison.rank(), unison.world_size()
    after, before = (me + 1) % n, (me - 1) % n
    if kind == "send":
        for i in range(RING + 1):
            unison.send(i, after)
        for _ in range(RING + 1):
            unison.recv(before)
    else:
        unison.recv(after)
        unison.send(me, before)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 3])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    print(f"CPU: {cpu_model()}; {source_revision()}; command: "
          f"{command_line(sys.argv[1:] if argv is None else argv)}\n")
    print("| cycle | N | s to the error, median | slowest |\n|---|--:|--:|--:|")
    for n in args.workers:
        with unison.Session(n) as sess:
            for kind in ("send", "recv"):
                took = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    try:
                        sess.run(cycle, kind, timeout=30)
                    except unison.WorkerError as exc:
                        if not any("a deadlock: worker" in str(e) for e in exc.errors.values()):
                            raise
                    else:
                        raise RuntimeError(f"a {kind} cycle at N={n} completed")
                    took.append(time.perf_counter() - start)
                print(f"| {kind} | {n} | {statistics.median(took):.3f} | {max(took):.3f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
