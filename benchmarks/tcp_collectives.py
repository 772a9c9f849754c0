"""A session whose workers join over TCP with collectives="torch" (as on a cluster: gloo
across hosts), on loopback: what a call, a small allreduce, and a rank that leaves a call
before its collective cost.

    python benchmarks/tcp_collectives.py [--workers 2] [--calls 3000] [--reduces 500]
    PYTHONPATH=/tmp/wt/src python benchmarks/tcp_collectives.py ...   # another revision

Workers are started by hand (``unison worker --connect``), as srun or ssh would, so the
session's collectives go through torch.distributed, not shared memory. Prints the median of
``sess.run(noop)`` in µs; the median of a call that writes one key to a store the controller
serves (a TCPStore, as the session's: what a rank's mark at a call's end costs, which is why
a call that ran no collective writes none); the mean of ``--reduces`` allreduces of 4 floats
inside one call (best of 3 calls) in µs; and how long a ``sess.run`` takes to raise where
rank 1 raises before the allreduce its peers run, then where it returns before it (the
fastest and slowest of 3 tries, s; the call's timeout, 30 s, where the peers wait: before
issue 9's forty-seventh pass for the first, before its forty-eighth for the second).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import unison
from harness.hand import hand_session
from harness.report import header


def noop() -> None:
    return None


_CLIENT: list[Any] = []  # (this module's, in the worker: imported there by reference)


def set_key(port: int) -> None:
    """One write to the store the controller serves at ``port``, as a rank's mark."""
    if not _CLIENT:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        _CLIENT.append(TCPStore("127.0.0.1", port, None, False))
    _CLIENT[0].set(f"mark/{unison.rank()}", "1 0 0")


def _median_us(call: Any, count: int) -> float:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def reduces(count: int) -> float:
    import torch

    x = torch.ones(4)
    start = time.perf_counter()
    for _ in range(count):
        unison.allreduce(x)
    return (time.perf_counter() - start) / count * 1e6


def leaves(how: str) -> float:
    """Rank 1 leaves the call before the allreduce its peers run: it raises, or returns."""
    import torch

    if unison.rank() == 1:
        if how == "raises":
            raise ValueError("left before its collective")
        return 0.0
    return float(unison.allreduce(torch.ones(1))[0])


def left(sess: unison.Session, how: str) -> list[float]:
    """How long ``run(leaves)`` takes to raise, 3 tries (30: it timed out, and no more)."""
    raised = []
    for _ in range(3):
        start = time.perf_counter()
        try:
            sess.run(leaves, how, timeout=30)
        except unison.WorkerError:
            raised.append(time.perf_counter() - start)
        except TimeoutError:  # (the peers still wait: the next run would too)
            return [*raised, 30.0]
        sess.run(noop)
    return raised


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--reduces", type=int, default=500)
    args = parser.parse_args()
    print(header(sys.argv[1:]))
    with hand_session(args.workers, collectives="torch") as sess:
        for _ in range(300):
            sess.run(noop)
        print(f"run(noop): median {_median_us(lambda: sess.run(noop), args.calls):.1f} us")
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        import tcp_collectives as me  # its set_key by reference: its client is kept

        store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        sess.run(me.set_key, store.port)
        took = _median_us(lambda: sess.run(me.set_key, store.port), args.calls)
        print(f"run(a call that writes one store key, as a mark): median {took:.1f} us")
        best = min(min(sess.run(reduces, args.reduces)) for _ in range(3))
        print(f"allreduce of 4 floats: {best:.1f} us")
        for how in ("raises", "returns"):
            tries = left(sess, how)
            print(f"a rank {how} before its collective: its peers raised in "
                  f"{min(tries):.2f}-{max(tries):.2f} s ({len(tries)} tries)")


if __name__ == "__main__":
    main()
