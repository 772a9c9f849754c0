"""What unison's own Python costs per round on each side, the other side taken out (issue 9).

    python benchmarks/python_cost.py [--rounds 20000]                 # µs per round
    python benchmarks/python_cost.py --instructions [--rounds 20000]  # under valgrind
    python benchmarks/python_cost.py --instructions --parts   # + a worker's loop in parts
    python benchmarks/python_cost.py --cold [--rounds 300]    # each round after a sweep

On a 2-core host the controller's Python before the send and after the last reply, and a
worker's between taking a command and publishing its reply, add straight to every round
(docs/benchmarks.md, "Issue 9, sixth pass"); but a round's time swings by 2x from one minute
to the next there. So this measures each side's Python alone:

    controller   a real Session(2) whose channel's send does nothing and whose waits find
                 the workers done at once (dispatch: ``sess.call(noop); sess.sync()``) or
                 the replies already in (run: ``sess.run(small_value)``, each worker's reply
                 made beforehand in the tree's own format)
    worker       ``worker.serve`` in this process, fed commands made beforehand by the tree's
                 own ``call_msg`` (dispatch: a CALL that frees the previous result; run: a
                 CALL that asks for the result back), replying into a list; with the shm
                 collectives and the cancellation board a worker's loop tells of each call
    floor        the floor system's controller (harness/systems/floor.py), its waits
                 finding every worker done at once, its workers paused (SIGSTOP) and
                 marked awake: what the same rounds need at least

``--instructions`` re-runs this script under valgrind's callgrind, counting only inside the
rounds (they run through ``map``, and only ``map_next`` is counted), and prints
instructions per round: the same on every run of the same code, so two revisions compare
to the percent on a noisy host (``PYTHONPATH=<tree>/src`` picks the revision). Without it,
the best and the median µs per round of 7 timed fills.

``--cold`` times the controllers' rounds one at a time, warm (back to back) and cold (each
after copying 16 MiB, which leaves none of the round's code and data in the caches): the
median µs of each; and a worker's loop the same way, from handing it a command to its
asking for the next (unison's: its take from the ring and the ring's put not counted; the
floor worker's: all its steps). The cold time is what a round costs by the cache lines it
touches, not by its instructions; in a real round trip a process sharing the core evicts
part of them.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import marshal
import os
import pickle
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import unison
from harness.report import cpu_model, source_revision
from harness.tasks import noop, small_value
from unison import protocol

WORKLOADS = ("controller dispatch", "controller run", "worker dispatch", "worker run",
             "floor dispatch", "floor run")
PARTS = ("worker dispatch, no board", "worker dispatch, no collectives",
         "worker dispatch, neither", "floor worker dispatch")
"""``--parts``: a worker's loop without the cancellation board's or the collectives' steps
around each call, or without both; and the floor's worker doing the same command."""


def _reply(req_id: int, value: int) -> bytes:
    """A worker's reply to run, as this tree's worker makes it."""
    reply = (req_id, protocol.OK, value)
    if not hasattr(protocol, "dumps_plain"):  # revisions before it pickled replies
        return pickle.dumps(reply, 5)
    return protocol.dumps_plain(reply, getattr(protocol, "PLAIN", 4))


@contextlib.contextmanager
def stubbed(sess: unison.Session) -> Iterator[None]:
    """``sess``'s channel sends nothing and finds every worker done, until the block ends
    (then the channel is whole again: close() must reach the real workers). The workers
    hold both functions first, so that no round defines one."""
    sess.run(noop)
    sess.run(small_value)
    chan: Any = sess._chan  # its methods replaced on the instance: Any for mypy
    own = dict(chan.__dict__)  # send_plain may be the C ring's, set on the instance
    chan.send = lambda data, ranks, buffers=(), *, deadline=None: None
    chan.send_plain = lambda data, ranks: True
    chan.wait_done = lambda ranks, mark, timeout: True
    chan.unreported = lambda ranks: False
    # sync's first look finds them done here, and a look that does asks the kernel whether
    # a worker died meanwhile (one epoll_wait, 0.57 µs of 2.1 on 2026-12-04). In a real round
    # that look comes before the workers finish and misses, and none is asked: not counted
    chan._death_seen = lambda: False
    try:
        yield
    finally:
        for name in ("send", "send_plain", "wait_done", "unreported", "recv", "plain_values",
                     "_death_seen"):
            if name in own:
                chan.__dict__[name] = own[name]
            else:
                chan.__dict__.pop(name, None)


def controller_rounds(sess: unison.Session, work: str, count: int) -> Iterator[object]:
    """``count`` rounds of ``work`` on ``sess``, inside ``stubbed``, as a ``map``."""
    if work == "dispatch":
        def one(_: int) -> None:
            sess.call(noop)
            sess.sync()
        return map(one, range(count))
    first = next(sess._ids) + 1  # run draws two ids a round, its request's first
    replies = {req: [(r, _reply(req, 7)) for r in range(sess.num_workers)]
               for req in range(first, first + 2 * count + 2, 2)}
    expect = sess._router._expect[0]
    chan: Any = sess._chan
    chan.recv = lambda timeout, watch=None: replies[expect[0].req_id]
    # run's quick path (Router.quick): the values at once; the C look that would read and
    # decode the workers' replies is not counted (its Python is: the calls around it)
    values = [7] * sess.num_workers
    chan.plain_values = lambda ranks, req_id, timeout: values.copy()

    def once(_: int) -> None:
        sess.run(small_value)
    return map(once, range(count))


class _Replies:
    """A worker channel that keeps the replies (the worker's side of ``worker rounds``)."""

    oob_replies = False

    def __init__(self) -> None:
        self.got: list[bytes] = []

    def reply(self, data: bytes, buffers: object = ()) -> None:
        self.got.append(data)

    def reply_plain(self, msg: tuple[Any, ...], version: int) -> bool:
        self.got.append(marshal.dumps(msg, version))  # what the shm channel's C does
        return True

    def ack(self) -> None:
        self.got.append(b"")

    def unreported(self, count: int) -> None:
        pass


def worker_rounds(work: str, count: int, board_on: bool = True, coll_on: bool = True,
                  between: Callable[[], None] | None = None) -> Iterator[object]:
    """``count`` commands of ``work`` through ``worker.serve`` in this process, as a
    ``map`` of one call; with the board and the collectives a Session gives it, unless
    told otherwise. ``between``: called before each command is handed over (``--cold``)."""
    from unison import worker
    from unison.cancel import Board
    from unison.collective.shm import Layout, ShmCollectives

    board = Board(2) if board_on else None  # what a worker's loop calls around each call
    coll = None
    if coll_on:
        fd = os.memfd_create("unison-python-cost", os.MFD_CLOEXEC)
        os.ftruncate(fd, Layout(2, 1).size)
        coll = ShmCollectives(fd, 0, 2, 1)
        os.close(fd)  # mapped now
    loop = worker.Loop()
    loop.fns[1] = small_value if work == "run" else noop
    made: list[tuple[bytes, list[Any]]] = []
    for i in range(2, count + 12):  # run: reply to request i; dispatch: free the one before
        frees = None if work == "run" or i == 2 else (i - 1,)
        made.append((protocol.call_msg(frees, i, 1, None, None, i if work == "run" else 0), []))
    chan = _Replies()
    warm = iter(made[:10])  # the loop's first commands import what it needs: not counted
    worker.serve(chan, coll, board, loop, recv=lambda: next(warm, None))  # type: ignore[arg-type]
    chan.got.clear()
    cmds = iter(made[10:])
    if between is None:
        recv = lambda: next(cmds, None)
    else:
        recv = lambda: (between(), next(cmds, None))[1]

    def serve(_: int) -> None:
        worker.serve(chan, coll, board, loop, recv=recv)  # type: ignore[arg-type]
        if work == "run" and len(chan.got) != count:
            raise RuntimeError(f"{len(chan.got)} replies to {count} runs")
    return map(serve, range(1))


def _each(between: Callable[[], None], count: int) -> Iterator[int]:
    """1 .. count, ``between()`` called before each."""
    for seq in range(1, count + 1):
        between()
        yield seq


def floor_worker_rounds(count: int, between: Callable[[], None] | None = None
                        ) -> Iterator[object]:
    """``count`` dispatch commands through the floor worker's steps (harness/systems/floor.py,
    ``_worker``'s loop after its wait: read the command, unpickle it, run it, write the
    reply and the ack, look at the controller's flag), in this process, as a ``map``;
    ``between`` as worker_rounds'."""
    import mmap

    from harness.systems import floor
    from harness.systems.base import CALL, execute

    mm = mmap.mmap(-1, floor._size(2))
    buf = memoryview(mm)
    q = buf.cast("Q")
    start, ack = floor._payload(2), floor.ACK
    cmd = pickle.dumps((CALL, 1, None, ()), protocol=5)
    buf[start:start + len(cmd)] = cmd
    q[floor.LEN] = len(cmd)
    fns: dict[int, Any] = {1: noop}

    seqs = range(1, count + 1) if between is None else _each(between, count)

    def serve(_: int) -> None:
        for seq in seqs:
            q[floor.SEQ] = seq  # the controller's part
            last = q[floor.SEQ]
            op, fid, fn, args = pickle.loads(buf[start:start + q[floor.LEN]])
            if fn is None:
                fn = fns.get(fid)
            else:
                fns[fid] = fn
            reply = execute(op, fn, args)
            q[ack + 1] = floor.NONE if reply is None else reply
            q[ack] = last
            if q[floor.CTRL]:
                raise RuntimeError("nobody sleeps here")
    return map(serve, range(1))


@contextlib.contextmanager
def floor_rounds(work: str, count: int) -> Iterator[Iterator[object]]:
    """``count`` rounds of the floor system's controller (harness/systems/floor.py), its
    waits finding every worker done at once, as a ``map``."""
    from harness.systems import floor

    system = floor.FloorSystem()
    system.start(2)
    system.dispatch()
    system.gather_small()  # the workers hold both functions now
    real = floor._wait
    floor._wait = lambda *args: []
    pids = system.worker_pids()
    for pid in pids:  # paused, and not asleep: no command wakes them (a spinning worker
        os.kill(pid, signal.SIGSTOP)  # is what the real rounds mostly meet)
    assert system._q is not None
    for r in range(2):
        system._q[floor.SLEEP + r] = 0
    try:
        yield map(lambda _: system.dispatch() if work == "dispatch" else system.gather_small(),
                  range(count))
    finally:
        floor._wait = real
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        system.close()


@contextlib.contextmanager
def rounds(workload: str, count: int, sess: unison.Session) -> Iterator[Iterator[object]]:
    if workload in PARTS:
        yield (floor_worker_rounds(count) if workload.startswith("floor") else worker_rounds(
            "dispatch", count, board_on=workload.endswith("collectives"),
            coll_on=workload.endswith("board")))
        return
    side, work = workload.split()
    if side == "floor":
        with floor_rounds(work, count) as it:
            yield it
    else:
        yield controller_rounds(sess, work, count) if side == "controller" else worker_rounds(
            work, count)


def timed(workload: str, count: int) -> tuple[float, float]:
    """The best and the median µs per round of 7 fills of ``count`` rounds."""
    per: list[float] = []
    with unison.Session(2) as sess, stubbed(sess):
        for _ in range(7):
            with rounds(workload, count, sess) as it:
                gc.disable()
                start = time.perf_counter()
                for _ in it:
                    pass
                per.append((time.perf_counter() - start) / count * 1e6)
                gc.enable()
    return min(per), statistics.median(per)


def counted(workload: str, count: int) -> int:
    """Instructions per round, counted by callgrind inside ``map_next`` only."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        subprocess.run(
            ["valgrind", "--tool=callgrind", "--collect-atstart=no",
             "--toggle-collect=map_next", f"--callgrind-out-file={out}", sys.executable,
             __file__, "--child", workload, "--rounds", str(count)],
            check=True, capture_output=True)
        for line in out.read_text().splitlines():
            if line.startswith(("totals:", "summary:")):
                return int(line.split()[1]) // count
    raise RuntimeError("callgrind wrote no totals")


CONTROLLERS = tuple(w for w in WORKLOADS if not w.startswith("worker"))
"""The workloads whose rounds can be timed one at a time (a worker's run as one call)."""
SWEEP = 16 << 20
"""Bytes copied before each cold round: past the L2 of one core and most of an L3's share."""


def cold_timed(workload: str, count: int) -> tuple[float, float]:
    """The median µs of a round of ``workload``: back to back, and after a sweep each."""
    src, dst = bytearray(SWEEP // 2), bytearray(SWEEP // 2)
    clock = time.perf_counter_ns
    medians = []
    with unison.Session(2) as sess, stubbed(sess):
        for cold in (False, True):
            with rounds(workload, count + 20, sess) as it:
                for _ in range(20):
                    next(it)
                took = []
                gc.disable()
                for _ in range(count):
                    if cold:
                        dst[:] = src
                    start = clock()
                    next(it)
                    took.append(clock() - start)
                gc.enable()
            medians.append(statistics.median(took) / 1000)
    return medians[0], medians[1]


WORKERS_COLD = ("worker dispatch", "worker run", "floor worker dispatch")
"""``--cold`` for a worker: each round from taking its command to asking for the next."""


def worker_cold_timed(workload: str, count: int) -> tuple[float, float]:
    """cold_timed for a worker's loop: the median µs from handing over a command to the
    loop's asking for the next (the channel's take and the real ring's put not counted),
    back to back and with a sweep before each command."""
    src, dst = bytearray(SWEEP // 2), bytearray(SWEEP // 2)
    clock = time.perf_counter_ns
    medians = []
    for cold in (False, True):
        took: list[int] = []
        began = [0]

        def between(cold: bool = cold, took: list[int] = took, began: list[int] = began
                    ) -> None:
            now = clock()
            if began[0]:
                took.append(now - began[0])
            if cold:
                dst[:] = src
            began[0] = clock()
        it = (floor_worker_rounds(count + 20, between) if workload.startswith("floor")
              else worker_rounds(workload.split()[1], count + 20, between=between))
        gc.disable()
        for _ in it:
            pass
        gc.enable()
        medians.append(statistics.median(took[20:]) / 1000)
    return medians[0], medians[1]


def _child(workload: str, count: int) -> None:
    with unison.Session(2) as sess, stubbed(sess), rounds(workload, count, sess) as it:
        gc.disable()
        for _ in it:
            pass
        gc.enable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under valgrind (callgrind) instead of timing")
    parser.add_argument("--parts", action="store_true", help="also " + ", ".join(PARTS))
    parser.add_argument("--cold", action="store_true",
                        help="the controllers' rounds warm and each after a cache sweep")
    parser.add_argument("--child", choices=WORKLOADS + PARTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.rounds)
        return
    if args.instructions and shutil.which("valgrind") is None:
        sys.exit("python_cost.py --instructions needs valgrind on PATH")
    print(f"CPU: {cpu_model()}; {source_revision()}, from {Path(unison.__file__).parent}; "
          f"command: python benchmarks/python_cost.py"
          f"{' --instructions' if args.instructions else ''}{' --parts' if args.parts else ''}"
          f"{' --cold' if args.cold else ''}"
          f" --rounds {args.rounds}\n")
    workloads = WORKLOADS + PARTS if args.parts else WORKLOADS
    if args.cold:
        print("| workload | warm µs | cold µs |\n|---|--:|--:|")
        for w in CONTROLLERS:
            warm, cold = cold_timed(w, args.rounds)
            print(f"| {w} | {warm:.2f} | {cold:.2f} |", flush=True)
        for w in WORKERS_COLD:
            warm, cold = worker_cold_timed(w, args.rounds)
            print(f"| {w} | {warm:.2f} | {cold:.2f} |", flush=True)
    elif args.instructions:
        print("| workload | instructions per round |\n|---|--:|")
        for w in workloads:
            print(f"| {w} | {counted(w, args.rounds)} |", flush=True)
    else:
        print("| workload | best µs | median µs |\n|---|--:|--:|")
        for w in workloads:
            best, median = timed(w, args.rounds)
            print(f"| {w} | {best:.2f} | {median:.2f} |", flush=True)


if __name__ == "__main__":
    main()
