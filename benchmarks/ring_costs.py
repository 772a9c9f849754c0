"""What one message costs on each side of the shm channel, without any waiting (issue 9):
the command ring's send and a worker's receive, both ends in this process, fed a backlog;
a worker's plain reply (run's: ``reply_plain``) and the controller's read of it
(``plain_values``, one reply a look);
then, with a real worker, ``sess.sync()`` alone and a worker's cost per CALL from a backlog;
then a worker loop's own steps around each call, a loop's cost taken off: the store-load
fence, the cancellation board's enter and leave, the collectives' end.
Run once with the C ring and once with the pure-Python one (``UNISON_PURE=1``), side by side.

    python benchmarks/ring_costs.py [--messages 10000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import unison
from unison import _native
from unison.cancel import Board
from unison.channel import shm
from unison.collective.shm import Layout, ShmCollectives
from unison.protocol import OK, PLAIN, call_msg


def noop() -> None:
    pass


def measure(messages: int) -> dict[str, float]:
    """Medians of 5 repetitions, µs per message."""
    chan = shm.ShmChannel(1, "ring-costs")
    worker = shm.ShmWorkerChannel(chan.endpoint(0)[0])
    msg = call_msg(None, 7, 3, None, None, 0)
    clock = time.perf_counter
    out: dict[str, list[float]] = {"send": [], "recv": [], "reply": [], "values": []}
    reply, ranks = (5, OK, 7), (0,)
    try:
        for _ in range(5):
            t0 = clock()
            for _ in range(messages):
                chan.send(msg, ranks)
            t1 = clock()
            for _ in range(messages):
                worker.recv()
            out["send"].append((t1 - t0) / messages * 1e6)
            out["recv"].append((clock() - t1) / messages * 1e6)
            took = [0.0, 0.0]
            for _ in range(messages):  # one at a time: the reply ring holds a few hundred
                t0 = clock()
                assert worker.reply_plain(reply, PLAIN)
                t1 = clock()
                assert chan.plain_values(ranks, 5, 1.0) == [7]
                took[0] += t1 - t0
                took[1] += clock() - t1
            out["reply"].append(took[0] / messages * 1e6)
            out["values"].append(took[1] / messages * 1e6)
    finally:
        del worker
        chan.close()
    with unison.Session(1) as sess:
        sess.run(noop)
        for _ in range(500):
            sess.sync()
        syncs, backlog = [], []
        for _ in range(5):
            t0 = clock()
            for _ in range(2000):
                sess.sync()
            syncs.append((clock() - t0) / 2000 * 1e6)
            t0 = clock()
            for _ in range(messages):
                sess.call(noop)
            sess.sync()  # the worker works through the backlog: its cost per CALL bounds this
            backlog.append((clock() - t0) / messages * 1e6)
        out["sync alone"], out["call from a backlog"] = syncs, backlog
    out.update(loop_steps(messages * 10))
    return {k: statistics.median(v) for k, v in out.items()}


def loop_steps(calls: int) -> dict[str, list[float]]:
    """µs a call of the steps a worker's loop takes around each call (worker.serve), each
    timed in a loop of ``calls`` with an empty loop's time taken off; 5 repetitions."""
    board = Board(2)
    fd = os.memfd_create("unison-ring-costs", os.MFD_CLOEXEC)
    os.ftruncate(fd, Layout(2, 1).size)
    coll = ShmCollectives(fd, 0, 2, 1)
    os.close(fd)  # mapped now
    mark = board.mark(0)
    enter, leave, end, fence = mark.enter, mark.leave, coll.end, _native.fence
    clock = time.perf_counter

    def empty() -> None:
        for _ in range(calls):
            pass

    def fences() -> None:
        for _ in range(calls):
            fence()

    def boards() -> None:
        for i in range(calls):
            enter(i)
            leave()

    def ends() -> None:
        for i in range(calls):
            end(i)

    out: dict[str, list[float]] = {"fence": [], "board": [], "coll end": []}
    try:
        for _ in range(5):
            took = []
            for run in (empty, fences, boards, ends):
                t0 = clock()
                run()
                took.append(clock() - t0)
            for key, t in zip(out, took[1:]):
                out[key].append(max(0.0, t - took[0]) / calls * 1e6)
    finally:
        coll.close()
        board.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=10000)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps({"native": shm.NATIVE, **measure(args.messages)}))
        return 0
    rows = []
    for pure in ("", "1"):
        env = {**os.environ, "UNISON_PURE": pure}
        done = subprocess.run([sys.executable, __file__, "--one", "--messages",
                               str(args.messages)], env=env, capture_output=True, text=True,
                              check=True)
        rows.append(json.loads(done.stdout.splitlines()[-1]))
    keys = [k for k in rows[0] if k != "native"]
    print("| µs per message, or per call of a loop step (median of 5) | "
          + " | ".join(keys) + " |")
    print("|---|" + "--:|" * len(keys))
    for row in rows:
        name = "C ring" if row["native"] else "pure-Python ring"
        print(f"| {name} | " + " | ".join(f"{row[k]:.3f}" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
