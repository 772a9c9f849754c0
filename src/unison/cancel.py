"""Cancellation: a board in shared memory that the controller writes and every worker reads
before each call, and a signal that interrupts a call already running.

    controller: ref.cancel()                        worker r
      board.post(id): table[id % TABLE] = id,        before a call: running[r] = id,
                      fence                            last[r] = id, fence,
                                                       table[id % TABLE] == id? skip it
      running[r] == id? -> signal worker r           (signal) handler: running[r] is a
      wait until running[r] != id, or report           cancelled id -> raise Cancelled there
        that r is stuck in C code                    after the call: running[r] = 0, fence,
                                                       table[id % TABLE] == id? Cancelled

The controller posts, fences, then reads each worker's running word, and keeps reading it
while it waits: either the worker sees the cancellation before it starts (and skips the
call), or the controller sees it running (and signals it, once). The signal is a system
call, so the worker's handler sees the post. It goes to the worker's main thread (tgkill),
not to the process: the kernel may hand a process's signal to any thread that does not
block it (the pipe channel's reader, a BLAS pool), and then a sleep in the main thread never
wakes, as only the main thread runs Python's handlers.

Python runs a signal handler at the next bytecode of the main thread, so a function in
Python code, or in a C call that returns on EINTR (time.sleep, a blocking read, a regex),
gets ``Cancelled`` at once; a C call that never returns to Python cannot be interrupted,
and ``cancel`` says so after its wait.

One memfd per session (``unison-<session>-cancel``): a table of TABLE words, where a
cancelled id lives at ``id % TABLE``, then one cache line per worker (its running word,
then the last call id it entered). A worker looks up the call it is about to run, however
many cancellations came since its last look (a ring of recent ones, as before, forgot the
oldest: behind 256 cancellations of queued calls, a worker ran cancelled calls). The
memfd's pages are made as posts touch them.

A slot holds one id, and ids TABLE apart share it: a worker that finds another id there
runs its call. So ``post`` never writes over an id some worker may still look up (one still
queued or running: ids reach each worker in increasing order, so a worker whose last word
is past it, or on it and no longer running it, never looks again); it raises instead, and
nothing is cancelled. Counting ring space did not bound this: calls to one worker do not
fill another's ring, and a cancel of a finished call, 2**20 ids on, un-cancelled a queued
one. A call every worker is past is not posted at all (it changes nothing).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from unison import _native, _proctree
from unison._native import fence as _fence
from unison.channel.arena import sealed_memfd

_ring = _native.load("_ring")  # Mark in C (unison/_ring.c), or None: _Mark below

__all__ = ["SIGNAL", "Board", "Cancelled", "Mark", "refusal"]

TABLE = 1 << 20
_LINE = 8  # words per cache line
_RUNNING = TABLE  # word index of worker 0's line
SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2
"""The signal that interrupts a running call (a real-time one, which no library uses)."""
SIGNAL_NAME = "SIGRTMIN+3" if hasattr(signal, "SIGRTMIN") else "SIGUSR2"

_RESIGNAL = 0.1  # s: how long a worker may stay inside a cancelled call before another signal

def _load_tgkill() -> Callable[[int, int, int], int] | None:
    try:
        tgkill: Callable[[int, int, int], int] = ctypes.CDLL(None, use_errno=True).tgkill
        return tgkill
    except (OSError, AttributeError):  # a libc without it (glibc before 2.30): the process
        return None


_tgkill = _load_tgkill()


def signal_main_thread(pid: int, sig: int) -> None:
    """Send ``sig`` to the main thread of process ``pid`` (its thread id is its pid)."""
    if _tgkill is None:
        os.kill(pid, sig)
        return
    if _tgkill(pid, pid, sig) != 0:
        err = ctypes.get_errno()
        if err == errno.ESRCH:
            raise ProcessLookupError(err, os.strerror(err))
        raise OSError(err, os.strerror(err))


def refusal(pid: int) -> str:
    """How process ``pid`` keeps SIGNAL out: "ignores" it (its disposition), "blocks" it
    (its main thread's mask, where the signal goes), or "stopped" (its process is: the
    signal waits until it continues; a process stopped inside the handler also shows SIGNAL
    blocked, as the kernel blocks it while its handler runs), as /proc/<pid>/status says;
    else ""."""
    bit = 1 << (int(SIGNAL) - 1)
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f if b":" in line)
    except OSError:
        return ""
    if fields.get(b"State", b"").strip().startswith((b"T", b"t")):
        return "stopped"
    for key, how in ((b"SigIgn", "ignores"), (b"SigBlk", "blocks")):
        if int(fields.get(key, b"0"), 16) & bit:
            return how
    return ""


class Cancelled(BaseException):
    """Raised inside a worker's function when the controller cancels its call: at the next
    Python bytecode. A BaseException, like KeyboardInterrupt, so that ``except Exception``
    in user code does not swallow it."""


class Board:
    """The shared board; ``Board(n)`` on the controller, ``Board(n, fd=...)`` on a worker."""

    def __init__(self, num_workers: int, name: str = "", fd: int = -1) -> None:
        size = 8 * (_RUNNING + _LINE * num_workers)
        self.owner = fd < 0
        if self.owner:
            fd = sealed_memfd(f"{name}-cancel", size)
        self.fd = fd
        try:
            self._mm = mmap.mmap(fd, size)
        except BaseException:
            if self.owner:  # ours: a failed start must not leave it open
                os.close(fd)
            raise
        self._q = memoryview(self._mm).cast("Q")
        self._marks: dict[int, Mark] = {}
        self._ranks: dict[int, tuple[int, ...]] = {}  # slot -> the workers of the id in it
        self._lock = threading.Lock()  # posts from several threads: one look-and-write each

    # -- controller --------------------------------------------------------------------------

    def post(self, call_id: int, ranks: Sequence[int]) -> bool:
        """Cancel ``call_id`` on its workers ``ranks``: those that have not started it skip
        it. False where every one of them is past it (nothing to do, nothing written);
        RuntimeError where its slot holds an id TABLE away that a worker may still look up
        (written over, that call would run after all)."""
        slot = call_id % TABLE
        with self._lock:
            if self.past(call_id, ranks):
                return False
            held = int(self._q[slot])
            if held and held != call_id:
                behind = [r for r in self._ranks[slot] if not self.past(held, (r,))]
                if behind:
                    raise RuntimeError(
                        f"cannot cancel call #{call_id}: it shares its slot on the "
                        f"cancellation board (ids modulo {TABLE}) with call #{held}, cancelled "
                        f"earlier and not yet reached by worker(s) {behind}; written over, "
                        "that call would run after all. Nothing was cancelled: once those "
                        f"workers are past #{held} (sync them), cancel again"
                    )
            self._ranks[slot] = tuple(ranks)
            self._q[slot] = call_id
        _fence()
        return True

    def past(self, call_id: int, ranks: Sequence[int]) -> bool:
        """Whether every worker of ``ranks`` is done with ``call_id`` (never looks it up
        again): it entered a later call, or this one and left it. Last before running: a
        worker stores them the other way round, so a worker on its way in is not missed."""
        q = self._q
        for r in ranks:
            line = _RUNNING + _LINE * r
            last = q[line + 1]
            if last < call_id or (last == call_id and q[line] == call_id):
                return False
        return True

    def running(self, rank: int) -> int:
        """The call worker ``rank`` is inside now (0: none)."""
        return int(self._q[_RUNNING + _LINE * rank])

    def stop(self, call_id: int, ranks: Sequence[int], pids: Sequence[int],
             starts: Sequence[int | None], timeout: float) -> tuple[list[int], set[int]]:
        """Post ``call_id``, signal each worker of ``ranks`` seen inside it (``pids`` by
        rank, each the process that started at ``starts``: a worker that died inside the
        call leaves its word set, and its pid may be another program's by now), and wait up
        to ``timeout`` for them to leave it (inf: as long as one lives inside it). Returns the
        ranks still inside, and those of them whose process ended (their word stays set)."""
        if not self.post(call_id, ranks):
            return [], set()
        signalled: dict[int, float] = {}  # rank -> when we last signalled it
        gone: set[int] = set()
        end = time.monotonic() + timeout
        nap = 20e-6
        while True:
            inside = [r for r in ranks if self.running(r) == call_id]
            now = time.monotonic()
            for r in inside:
                # again if it is still inside a while later: a signal that found the call
                # not yet begun, or lost (seen in the chaos loop, cause not found), is
                # harmless to repeat: the handler raises only in a cancelled call
                if r not in gone and now - signalled.get(r, -1.0) >= _RESIGNAL:
                    signalled[r] = now
                    if pids[r] == os.getpid():  # worker 0 inline in us: never signal ourself
                        continue
                    if not _proctree.same(pids[r], starts[r]):
                        gone.add(r)  # it ended: the session hears of it on its next wait
                        continue
                    try:
                        signal_main_thread(pids[r], SIGNAL)
                    except ProcessLookupError:
                        gone.add(r)  # it died: the session hears of it on its next wait
            if not inside or gone.issuperset(inside) or time.monotonic() >= end:
                return inside, gone
            time.sleep(nap)
            nap = min(2 * nap, 5e-3)

    # -- worker --------------------------------------------------------------------------------

    def is_cancelled(self, call_id: int) -> bool:
        return self._q[call_id % TABLE] == call_id

    def mark(self, rank: int) -> Mark:
        """Worker ``rank``'s word: ``enter(call_id)`` before each call, ``leave()`` after it
        (in C where _ring was built: a worker pays them on every call)."""
        mark = self._marks.get(rank)
        if mark is None:
            running = _RUNNING + _LINE * rank
            mark = (_Mark(self._q, running) if _ring is None
                    else _ring.Mark(self._mm, running, TABLE))
            self._marks[rank] = mark
        return mark

    def close(self) -> None:
        for mark in self._marks.values():
            mark.close()
        self._marks.clear()
        self._q.release()
        try:
            self._mm.close()
        except BufferError:
            pass
        if self.owner:
            os.close(self.fd)


class Mark(Protocol):
    """A worker's word on the board: which call it runs (0: none)."""

    def enter(self, call_id: int, /) -> bool:
        """About to run ``call_id``: say so (running, then last), then whether it is
        cancelled (skip it then)."""

    def leave(self) -> bool:
        """Done with the call: say so, then whether it was cancelled (where its signal was
        blocked or ignored, the call returned all the same: it ends cancelled here)."""

    def close(self) -> None:
        """Let go of the board's memory."""


class _Mark:
    """Mark in pure Python (no _ring): the same stores, the fence a lock."""

    def __init__(self, q: memoryview, running: int) -> None:
        self._q: memoryview | _Closed = q
        self._running = running

    def enter(self, call_id: int, /) -> bool:
        q = self._q
        q[self._running] = call_id
        q[self._running + 1] = call_id  # after running: see Board.past
        _fence()  # else the load below may pass the store (x86 allows it), and a post the
        return q[call_id % TABLE] == call_id  # controller made meanwhile goes unseen by both

    def leave(self) -> bool:
        q = self._q
        call_id = q[self._running]
        q[self._running] = 0
        _fence()  # as in enter: a post whose controller saw the call running is seen below
        return call_id != 0 and q[call_id % TABLE] == call_id

    def close(self) -> None:
        self._q = _CLOSED


class _Closed:
    """A closed _Mark's words: a use after Board.close says what C's Mark says, not
    "operation forbidden on released memoryview object" (and costs the open one nothing)."""

    def __getitem__(self, index: int) -> int:
        raise ValueError("the board is closed")

    def __setitem__(self, index: int, value: int) -> None:
        raise ValueError("the board is closed")


_CLOSED = _Closed()
