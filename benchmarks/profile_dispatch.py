"""Profile the dispatch round trip (call + sync) with py-spy, controller and workers apart.

    .venv/bin/python benchmarks/profile_dispatch.py --workers 2 --seconds 8

Runs the dispatch loop for a while and, in parallel, ``py-spy record --format raw`` on the
controller and on worker 0 (with --idle, so time spent spinning or sleeping shows up too),
then prints each one's top frames by own time (folded stacks in /tmp/unison-profile-*.txt).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import threading
import time

import unison


def noop() -> None:
    pass


def _top(path: str, thread: str, limit: int = 16) -> list[tuple[float, str]]:
    """Own time per frame, over the samples of the thread whose stack shows ``thread``."""
    own: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not count.isdigit() or thread not in stack:
                continue
            leaf = stack.split(";")[-1]
            own[leaf] += int(count)
            total += int(count)
    return [(100 * c / max(total, 1), leaf) for leaf, c in own.most_common(limit)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=8.0)
    args = p.parse_args()
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    with unison.Session(args.workers) as sess:
        worker0 = sess.run(os.getpid)[0]
        stop = threading.Event()
        rounds = [0]

        def loop() -> None:
            while not stop.is_set():
                sess.call(noop)
                sess.sync()
                rounds[0] += 1

        t = threading.Thread(target=loop)
        t.start()
        time.sleep(0.5)
        procs = {}
        for who, pid in (("controller", os.getpid()), ("worker0", worker0)):
            out = f"/tmp/unison-profile-{who}.txt"
            procs[who] = (out, subprocess.Popen(
                [spy, "record", "--pid", str(pid), "--duration", str(int(args.seconds)),
                 "--rate", "200", "--format", "raw", "--idle", "--nonblocking",
                 "--output", out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        start, r0 = time.perf_counter(), rounds[0]
        for _, proc in procs.values():
            proc.wait()
        rate = (rounds[0] - r0) / (time.perf_counter() - start)
        stop.set()
        t.join()
    print(f"N={args.workers}: {1e6 / rate:.1f} us per call+sync while profiled "
          "(py-spy's sampling slows it)")
    for who, (out, _) in procs.items():
        thread = "loop (" if who == "controller" else "serve ("
        print(f"\n{who}, the thread running {thread[:-2]}(): own time by frame (% of samples)")
        for pct, leaf in _top(out, thread):
            print(f"  {pct:5.1f}%  {leaf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
