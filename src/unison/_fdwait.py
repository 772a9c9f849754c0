"""Waits on file descriptors in poll(2), never select(2).

select refuses any fd at or above FD_SETSIZE (1024) with ``ValueError: filedescriptor out of
range in select()``, and a controller serving HTTP under load, or any program with a
thousand files or sockets open, has such fds (so may a worker whose user code opened many).
These helpers answer as select's read and write lists did, a closed fd included (OSError,
EBADF), so the callers' handling stays as it was; only the limit is gone.
"""

from __future__ import annotations

import errno
import math
import os
import select
from collections.abc import Sequence

__all__ = ["FdSet", "poll_fds", "poll_ms", "readable", "reuse"]

_MAX_MS = 2**31 - 1
"""The longest wait poll takes (a C int of milliseconds: some 24 days)."""

_GONE = select.POLLNVAL
"""poll's answer for an fd that is not open, where select raised EBADF."""
_IN = select.POLLIN | select.POLLHUP | select.POLLERR
_OUT = select.POLLOUT | select.POLLERR
"""What select counted as readable, and as writable (Linux's POLLIN_SET, POLLOUT_SET)."""


def poll_ms(timeout: float | None) -> int | None:
    """``timeout`` in seconds (None: no limit) as poll's milliseconds: rounded up, so a small
    positive timeout sleeps a millisecond rather than turning into a busy loop of 0, and a
    negative one is 0, never poll's -1 (wait for ever)."""
    if timeout is None:
        return None
    if timeout <= 0:
        return 0
    return math.ceil(min(timeout * 1000, _MAX_MS))


def _bad(fd: int) -> OSError:
    return OSError(errno.EBADF, os.strerror(errno.EBADF), fd)


def poll_fds(read: Sequence[int], write: Sequence[int] = (),
             timeout: float | None = 0.0) -> tuple[list[int], list[int]]:
    """select's read and write lists for ``read`` and ``write`` within ``timeout`` seconds
    (None: no limit): readable includes end of file and errors, as select's does. One poll
    object made for the call: for waits off the hot paths (FdSet for those)."""
    poller = select.poll()
    events: dict[int, int] = {}
    for fd in read:
        events[fd] = events.get(fd, 0) | select.POLLIN
    for fd in write:
        events[fd] = events.get(fd, 0) | select.POLLOUT
    for fd, mask in events.items():
        poller.register(fd, mask)
    got = poller.poll(poll_ms(timeout))
    readable_fds: list[int] = []
    writable_fds: list[int] = []
    for fd, ev in got:
        if ev & _GONE:
            raise _bad(fd)
        asked = events[fd]
        if asked & select.POLLIN and ev & _IN:
            readable_fds.append(fd)
        if asked & select.POLLOUT and ev & _OUT:
            writable_fds.append(fd)
    return readable_fds, writable_fds


def readable(fds: Sequence[int], timeout: float | None = 0.0) -> list[int]:
    """The fds of ``fds`` readable (or at end of file, or in error) within ``timeout``
    seconds (None: no limit), as select's read list."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return _read(poller.poll(poll_ms(timeout)))


def _read(got: list[tuple[int, int]]) -> list[int]:
    """The fds of a poll of fds registered for reading only: each is readable (or at end of
    file, or in error); one not open raises EBADF, as select did."""
    out = []
    for fd, ev in got:
        if ev & _GONE:
            raise _bad(fd)
        out.append(fd)
    return out


class FdSet:
    """A fixed set of fds to wait on for reading, in one poll object made once: no list to
    build and check at each look, as a select of the list had, and no limit. A poll object
    refuses a second poll() at once (RuntimeError): a thread that meets another's makes one
    of its own for that look."""

    __slots__ = ("_poller", "fds")

    def __init__(self, fds: Sequence[int]) -> None:
        self.fds = tuple(fds)
        self._poller = self._make()

    def _make(self) -> select.poll:
        poller = select.poll()
        for fd in self.fds:
            poller.register(fd, select.POLLIN)
        return poller

    def readable(self, timeout: float | None = 0.0) -> list[int]:
        """As ``readable(self.fds, timeout)``."""
        ms = poll_ms(timeout)
        try:
            got = self._poller.poll(ms)
        except RuntimeError as exc:  # another thread polls this set now; anything else (a
            if str(exc) != _CONCURRENT:  # signal handler's RuntimeError) is not ours to eat
                raise
            got = self._make().poll(ms)
        return _read(got) if got else []


_CONCURRENT = "concurrent poll() invocation"
"""CPython's message where a poll object is already polled by another thread."""


def reuse(old: FdSet | None, fds: Sequence[int]) -> FdSet:
    """``old`` where it holds ``fds`` (in order), else a new set of them: for a wait whose
    fds change now and then (comparing a few ints costs less than a select's list)."""
    key = tuple(fds)
    if old is not None and old.fds == key:
        return old
    return FdSet(key)
