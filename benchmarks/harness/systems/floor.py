"""``floor``: the smallest pure-Python ring doing unison's round trip (issue 9), the floor that
unison's dispatch is read against in every run.

Kept deliberately minimal: no envelope, no refs, no locks, no bookkeeping. One shared segment
(a ``memfd``, so nothing appears in /dev/shm and the kernel frees it with its last mapping),
handed to the ``spawn`` workers as a file descriptor. Layout, in 8-byte words:

    word 0            SEQ    the controller's command number (0 before the first command)
    word 1            LEN    the pickled command's length
    word 2            CTRL   1 while the controller sleeps on an ack
    word 8 + i        SLEEP  1 while worker i sleeps on a command
    word ACK + 8 i    ACK    the last SEQ worker i finished; the word after it, its reply
    byte PAYLOAD      the pickled ``(op, fid, fn, args)`` command, written once for all N:
                      the function itself only the first time (``fn`` None after that:
                      the workers keep it by ``fid``, as unison's do)

The controller writes the payload, then LEN, then SEQ; a worker that sees the new SEQ reads the
payload, runs it, writes its reply, then its ACK. Each side waits the same way: yield the CPU
(``os.sched_yield``) while re-reading the word, for up to 200 µs; then raise its sleeping
flag, re-read, and sleep on its own eventfd for at most 1 s. A writer writes the sleeper's
eventfd only when that flag is up.

Ordering assumptions: CPython stores an aligned 8-byte word through ``memoryview.cast("Q")``
with one move, and x86-64 keeps stores in program order and loads in program order (TSO),
so a reader that sees the new SEQ (or ACK) sees what was written before it. Pure Python
cannot emit a fence, so the store-then-load handshake "raise flag, re-read" against "write
SEQ, read flag" can lose a wake-up in theory (StoreLoad reordering); the 1 s timeout turns
that into latency, never a hang. A weakly ordered host (ARM) would need real fences.

Only commands whose pickle fits PAYLOAD_BYTES and replies that are small non-negative ints
(or None) travel: dispatch, dispatch_script_fn and gather_small, plus start, idle and the CPU
hog workload. put and fetch are not offered.

A worker leaves when the controller goes: it sleeps with the read end of a pipe whose only
write end the controller holds, and that end hangs up when the controller exits, killed or not.
The controller's sleep likewise wakes when a worker exits (its process sentinel).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import select
import time
from collections.abc import Callable, Sequence
from multiprocessing import reduction
from typing import Any

from harness.systems.base import (
    CALL,
    RUN,
    STOP,
    System,
    died,
    execute,
    spawn,
    stop_processes,
    worker_setup,
)
from harness.tasks import small_value

SEQ, LEN, CTRL, SLEEP, ACK = 0, 1, 2, 8, 64
"""Word indices of the segment (ACK: worker i's ack word is ACK + 8 * i, its reply the next)."""
PAYLOAD_BYTES = 1 << 16
SPIN_NS = 200_000
"""How long a waiter yields before it sleeps."""
SLEEP_MS = 1000
"""The longest sleep: the cost of a lost wake-up."""
NONE = (1 << 64) - 1
"""The reply word for a reply of None."""


def _size(n: int) -> int:
    return 8 * (ACK + 8 * n) + PAYLOAD_BYTES


def _payload(n: int) -> int:
    return 8 * (ACK + 8 * n)


class _Fd:
    """A file descriptor that a ``spawn`` child receives as the same open file."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Callable[[Any], int], tuple[Any]]:
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup: Any) -> int:
    return int(dup.detach())


def _wait(q: memoryview, idx: int, old: int, flag: int, efd: int,
          poller: select.poll) -> list[tuple[int, int]]:
    """Return once ``q[idx] != old``: yield-spin up to SPIN_NS, then sleep on ``efd`` with
    ``q[flag]`` up. Returns [] when the word changed, else the poll events of the other
    registered descriptors that woke the sleep (a hang-up, a process exit)."""
    if q[idx] != old:
        return []
    clock, yield_ = time.perf_counter_ns, os.sched_yield
    end = clock() + SPIN_NS
    while True:
        yield_()
        if q[idx] != old:
            return []
        if clock() > end:
            break
    while True:
        q[flag] = 1
        if q[idx] != old:
            q[flag] = 0
            return []
        events = poller.poll(SLEEP_MS)
        q[flag] = 0
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(efd)
        if q[idx] != old:
            return []
        other = [e for e in events if e[0] != efd]
        if other:
            return other


def _worker(mem: int, n: int, rank: int, efd: int, ctrl_efd: int, alive: int) -> None:
    worker_setup()
    mm = mmap.mmap(mem, _size(n))
    os.close(mem)
    buf = memoryview(mm)
    q = buf.cast("Q")
    poller = select.poll()
    poller.register(efd, select.POLLIN)
    poller.register(alive, select.POLLIN)  # hangs up when the controller goes
    ack, start = ACK + 8 * rank, _payload(n)
    fns: dict[int, Any] = {}  # fid -> the function, sent once
    last = 0
    while True:
        if _wait(q, SEQ, last, SLEEP + rank, efd, poller):
            return  # the controller is gone
        last = q[SEQ]
        op, fid, fn, args = pickle.loads(buf[start:start + q[LEN]])
        if fn is None:
            fn = fns.get(fid)
        else:
            fns[fid] = fn
        if op == STOP:
            reply = None
        else:
            reply = execute(op, fn, args)
        q[ack + 1] = NONE if reply is None else reply
        q[ack] = last
        if q[CTRL]:
            os.eventfd_write(ctrl_efd, 1)
        if op == STOP:
            return


class FloorSystem(System):
    name = "floor"
    description = ("the floor: a minimal pure-Python shared-memory ring, yield-spin 200 µs "
                   "then eventfd sleep (harness/systems/floor.py)")
    workloads = frozenset({"dispatch", "dispatch_script_fn", "gather_small", "start", "idle",
                           "dispatch_hogs"})

    def __init__(self) -> None:
        self._procs: list[Any] = []
        self._fds: list[int] = []
        self._mm: mmap.mmap | None = None
        self._buf: memoryview | None = None
        self._q: memoryview | None = None
        self._seq = 0
        self._n = 0
        self._ctrl_efd = -1
        self._efds: list[int] = []
        self._alive_w: int | None = None
        self._poller = select.poll()
        self._fids: dict[Any, int] = {}  # function -> its id on the workers

    def start(self, n: int) -> None:
        self._n = n
        self._fids = {}  # fresh workers hold no function yet
        mem = os.memfd_create("unison-bench-floor", os.MFD_CLOEXEC)
        self._fds.append(mem)
        os.ftruncate(mem, _size(n))
        self._mm = mmap.mmap(mem, _size(n))
        self._buf = memoryview(self._mm)
        self._q = self._buf.cast("Q")
        flags = os.EFD_NONBLOCK | os.EFD_CLOEXEC
        self._ctrl_efd = os.eventfd(0, flags)
        self._efds = [os.eventfd(0, flags) for _ in range(n)]
        alive_r, self._alive_w = os.pipe()
        self._fds += [self._ctrl_efd, *self._efds, alive_r, self._alive_w]
        ctx = spawn()
        for rank in range(n):
            proc = ctx.Process(
                target=_worker, daemon=True, name=f"bench-floor-{rank}",
                args=(_Fd(mem), n, rank, _Fd(self._efds[rank]), _Fd(self._ctrl_efd),
                      _Fd(alive_r)))
            self._procs.append(proc)
            proc.start()
        self._poller.register(self._ctrl_efd, select.POLLIN)
        for proc in self._procs:
            self._poller.register(proc.sentinel, select.POLLIN)
        os.close(alive_r)  # the workers hold it now; the controller keeps only the write end
        self._fds.remove(alive_r)

    def _publish(self, op: int, fn: Any, args: Sequence[Any]) -> int:
        """Write the command once for all N workers, waking those asleep; its number."""
        q, buf = self._q, self._buf
        assert q is not None and buf is not None
        fid = self._fids.get(fn, 0)
        fresh = fn is not None and not fid  # its first call: it travels once, then its id
        if fresh:
            fid = len(self._fids) + 1
        data = pickle.dumps((op, fid, fn if fresh else None, args), protocol=5)
        if len(data) > PAYLOAD_BYTES:
            raise ValueError(f"floor: a command of {len(data)} bytes exceeds {PAYLOAD_BYTES}")
        if fresh:
            self._fids[fn] = fid
        start = _payload(self._n)
        buf[start:start + len(data)] = data
        q[LEN] = len(data)
        seq = self._seq = self._seq + 1
        q[SEQ] = seq
        for rank, efd in enumerate(self._efds):
            if q[SLEEP + rank]:
                os.eventfd_write(efd, 1)
        return seq

    def _roundtrip(self, op: int, fn: Any, args: Sequence[Any]) -> list[int | None]:
        q = self._q
        assert q is not None
        seq = self._publish(op, fn, args)
        out: list[int | None] = []
        for rank in range(self._n):
            ack = ACK + 8 * rank
            if _wait(q, ack, seq - 1, CTRL, self._ctrl_efd, self._poller):
                raise died(self._procs) or RuntimeError("a floor worker is gone")
            reply = q[ack + 1]
            out.append(None if reply == NONE else reply)
        return out

    def call(self, fn: Callable[..., object], args: Sequence[Any]) -> None:
        self._roundtrip(CALL, fn, tuple(args))

    def gather_small(self) -> list[int]:
        return [int(v or 0) for v in self._roundtrip(RUN, small_value, ())]

    def put(self, value: Any) -> None:
        raise NotImplementedError("floor carries small commands only")

    def hold(self, nbytes: int) -> None:
        raise NotImplementedError("floor carries small commands only")

    def fetch(self) -> list[Any]:
        raise NotImplementedError("floor carries small commands only")

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def close(self, graceful: bool = True) -> None:
        if graceful and self._q is not None and len(self._procs) == self._n:
            self._publish(STOP, None, ())  # not waited for: stop_processes joins them
        if self._alive_w is not None:  # its hang-up tells any worker still waiting to leave
            self._fds.remove(self._alive_w)
            os.close(self._alive_w)
            self._alive_w = None
        stop_processes(self._procs, graceful)
        self._procs = []
        if self._q is not None:
            self._q.release()
        if self._buf is not None:
            self._buf.release()
        if self._mm is not None:
            self._mm.close()
        self._q = self._buf = self._mm = None
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
