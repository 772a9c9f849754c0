"""CPU of a controller thread that waits (sync) while the workers run a long call: the
router wakes every wait slice (0.5 s, or hang_timeout/4), and each slice should sleep, not
spin again.

    python benchmarks/waiting_cpu.py [--seconds 6]
    PYTHONPATH=/tmp/wt/src python benchmarks/waiting_cpu.py ...   # another revision's tree

Per case: a session of 2 (local workers with three hang_timeouts, then workers that join
over TCP, which a launcher gives no pidfds for), one thread sends an 8 s call (mostly
asleep, with a little CPU so that hang_timeout sees progress) and syncs; the waiting
thread's CPU time and wake-ups are read from /proc/<pid>/task/<tid>/schedstat over
``--seconds``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import unison
from harness.hand import hand_session
from harness.report import header


def nap(seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:
        time.sleep(0.05)
        sum(range(1_500_000))


def _schedstat(tid: int) -> tuple[int, int]:
    with open(f"/proc/{os.getpid()}/task/{tid}/schedstat") as f:
        on_cpu, _, runs = map(int, f.read().split()[:3])
    return on_cpu, runs


@contextlib.contextmanager
def _session(kind: str, hang: float | None) -> Iterator[unison.Session]:
    """A session of 2: local workers, or workers started by hand that join over TCP
    (``unison worker --connect``, as srun or a Ray actor would: no pidfds to watch)."""
    if kind == "local":
        with unison.Session(2, hang_timeout=hang) as sess:
            yield sess
        return
    with hand_session(2) as sess:
        yield sess

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args()
    print(header(sys.argv[1:]))
    cases: list[tuple[str, float | None]] = [("local", None), ("local", 2.0), ("local", 0.4),
                                              ("tcp", None)]
    for kind, hang in cases:
        with _session(kind, hang) as sess:
            sess.run(int, 1)
            tids: list[int] = []

            def waiter(sess: unison.Session = sess, tids: list[int] = tids) -> None:
                tids.append(threading.get_native_id())
                sess.call(nap, args.seconds + 2)
                sess.sync()

            thread = threading.Thread(target=waiter)
            thread.start()
            time.sleep(0.5)
            a = _schedstat(tids[0])
            t0 = time.monotonic()
            time.sleep(args.seconds)
            took = time.monotonic() - t0
            b = _schedstat(tids[0])
            runs = max(1, b[1] - a[1])
            share = (b[0] - a[0]) / 1e9 / took * 100
            print(f"{kind:5} hang_timeout={hang!s:5} waiting thread: {share:.3f}% of a core, "
                  f"{(b[1] - a[1]) / took:.1f} wake-ups/s, "
                  f"{(b[0] - a[0]) / runs / 1e3:.0f} us each")
            thread.join()


if __name__ == "__main__":
    main()
