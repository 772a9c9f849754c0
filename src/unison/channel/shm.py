"""The shared-memory channel: one command ring written once for all workers, one reply ring
per worker, and an arena for large buffers.

    controller                          control segment (memfd)                 worker r
    send(msg, ranks) --> entry [len|nbufs|flags, rank mask, payload, buffer descs]
                         at cmd_write; cmd_write += size ----------------->  spin/yield, then
                         wake r only if r sleeps (eventfd) ---------------->  sleep on eventfd;
                                                                              copy payload out,
                                                                              cmd_read[r] = pos
    recv() <------------ reply ring r [len|flags, descs, bytes],      <--  reply(data, buffers)
                         reply_write[r]                                       wakes us only if
      spin/yield, then sleep on our eventfd (+ the workers' pidfds);          we sleep
      a worker wakes us only when our "sleeping" flag is up

Ordering. A writer publishes the payload first, then the position that covers it; x86 keeps
stores in order (TSO), and CPython never reorders them, so a reader that sees the position
sees the payload. The sleep handshake ("set my flag, re-check the position" against
"publish the position, check the flag") needs a store-load fence on each side:
``unison._native.fence`` (one C call where _ring was built, else a lock taken: a locked
instruction). Every sleep also has a 1 s
timeout, so a lost wake-up could only cost latency, never a hang. Hosts with weaker memory
models (ARM) would need real fences around the position stores: use ``channel="pipe"`` there.

Waiting (unison.pacing). Spinning with ``sched_yield`` for up to 200 us catches the reply of
a quick call without a kernel wake-up (tens of us on these machines); past that the waiter
sleeps on its eventfd (the controller also on the fds given to ``started``), so an idle
session costs no CPU. On a crowded machine (a yield that lost the core to a stranger's time
slice) waits sleep at once for a while: a woken sleeper preempts the stranger. A writer
waiting for room in a full ring polls with a Pacer instead.

The fast paths in C. Publishing a plain entry (no buffers, room at the head), taking the
next entry on a worker (publish progress, skip others' entries and wrap markers, copy one
plain entry out), a worker's plain reply, and the controller's collection of plain replies
run in unison/_ring.c where it was built at install, with real fences:
4-5 us of interpreter steps each in Python, well under 1 us in C. The protocol is the
same, so either side may run either; ``UNISON_PURE=1`` picks Python. The pure-Python ring
has the same shortcuts: ``send_plain``, ``reply_plain`` and ``_values_py`` (run's replies
read and decoded in one look).

Progress. Each worker publishes its *done* position (every command before it has run) when
it comes back for the next one, and how many errors it holds that nobody fetched; the
controller's ``wait_done`` spins, then sleeps on a second eventfd, on those words. So
``sync`` costs no message (see session/api.py).

Positions (ring.py). Every ring position only grows; its offset is ``pos & mask``. An entry
never straddles a ring's end: the writer marks the rest of the lap ``_WRAP`` and skips it.

Messages over a quarter of the ring, and pickle-5 buffers of 64 KiB or more, go through the
arena (see arena.py) instead of the ring, so no message is ever too large.

Replies take the same way back: each worker writes into a reply arena of its own (a memfd
the controller made), and a reply entry carries the descriptors of its buffers (and of its
pickle too, when that is over a quarter of the reply ring). The controller maps them, so a
fetched array lies on the very pages the worker wrote, copied once; a block is reused only
once the controller's arrays over it are gone, so a result stays valid whatever the worker
does next.

Bytes from the other side. Every word a reader takes from the other process is checked
before it is used, in C and in Python alike, with O(1) comparisons: a published position
at most a ring ahead, an entry inside its ring and below that position, known flags,
descriptors inside the arena (ArenaReader.view). So no input makes a reader read outside
a ring, map past the arena's end (SIGBUS), loop or replay stale entries. A controller that
meets a malformed reply ends that worker's stream there, as a closed TCP connection does:
``(rank, None)`` after the replies before it, the reason in ``where(rank)``; the session
then kills the worker and raises WorkerDied. A worker that meets a malformed command
raises ``Malformed`` (an OSError) and leaves. What a well-framed entry carries is unpickled
as it is: the workers run the user's own code and are trusted like it
(tests/test_ring_fuzz.py says what is checked and what is not).
"""

from __future__ import annotations

import mmap
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from unison import _native
from unison._fdwait import FdSet
from unison._native import fence as _fence
from unison.channel import (
    IDLE_S,
    MAX_BUFFERS,
    Channel,
    Reply,
    SendTimeout,
    WorkerChannel,
    meddled,
    too_many_buffers,
)
from unison.channel.arena import Arena, ArenaReader, Malformed, create_file, sealed_memfd
from unison.channel.ring import Ring
from unison.pacing import (
    CALM,
    LONG_YIELD,
    SPIN,
    Pacer,
    busy_budget,
    crowd,
    hand_over,
    spin,
)
from unison.protocol import ARRAY, OK, array_value, dumps_plain, loads_plain

_clock, _yield = time.perf_counter, os.sched_yield

MAX_WORKERS = 64
CMD_RING = 1 << 21
REPLY_RING = 1 << 20
SLEEP = 1.0
_LINE = 64
_WRAP = (1 << 64) - 1
_OOB = 1  # entry flag: the payload is a descriptor of an arena block
_MORE = 1 << 32  # reply flag: more chunks of this message follow
_INDIRECT = 1 << 33  # reply flag: the body is one descriptor of an arena block holding it
_NDESC = 40  # reply head: the body's number of buffer descriptors, from this bit up
_REPLY_BAD = (1 << _NDESC) - (1 << 34)  # reply head: bits no writer sets
_ENTRY = 16  # command entry header bytes
_CTL_SLEEP = _LINE // 8  # index of the controller's sleeping flag (waiting for replies)
_CTL_DONE = _CTL_SLEEP + 1  # index of its flag "waiting for workers' progress"
_CTL_ASYNC = _CTL_SLEEP + 2  # index of its flag "an event loop waits on the reply eventfd"
_NO_VIEWS: list[memoryview] = []
_DESC = 24

# the C fast paths (unison/_ring.c), or None; a build for another layout than the one above
# (what _ring.c hard-codes of it) warns and is refused, once, here
_ring = _native.load("_ring", {
    "ENTRY": _ENTRY, "DESC": _DESC, "WRAP": _WRAP, "MAX_WORKERS": MAX_WORKERS, "OK": OK,
    "ARRAY": ARRAY, "FLAGS": _MORE.bit_length() - 1})  # FLAGS: a head's lowest flag bit
NATIVE = _ring is not None
"""Whether the command ring's fast paths run in C here (else pure Python, same protocol)."""

_CMD = Ring(CMD_RING)
_REPLY = Ring(REPLY_RING)
_CMD_MASK = _CMD.mask  # the hot paths inline Ring.offset
_REPLY_MASK = _REPLY.mask
_INLINE_MAX = CMD_RING // 4  # larger messages go through the arena
_REPLY_INLINE = REPLY_RING // 4  # larger reply bodies go through the reply arena
REPLY_KEEP = 1 << 27  # bytes of freed reply blocks a worker keeps backed for reuse


def _align8(n: int) -> int:
    return (n + 7) & ~7


class _Layout:
    """Byte offsets in the control segment; the same on both sides."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.cmd_write = 0  # line 0, controller-written
        self.ctl_sleep = _LINE  # line 1, controller-written
        worker0 = 2 * _LINE
        # per worker: line A (worker-written): cmd_read, sleeping, reply_write, done,
        # unreported; line B (controller-written): reply_read
        self.cmd_read = [worker0 + 2 * _LINE * r for r in range(n)]
        self.sleeping = [o + 8 for o in self.cmd_read]
        self.reply_write = [o + 16 for o in self.cmd_read]
        self.done = [o + 24 for o in self.cmd_read]  # every command before it has run
        self.unreported = [o + 32 for o in self.cmd_read]  # errors nobody fetched
        self.reply_read = [o + _LINE for o in self.cmd_read]
        self.cmd_ring = worker0 + 2 * _LINE * n
        self.reply_ring = [self.cmd_ring + CMD_RING + REPLY_RING * r for r in range(n)]
        self.size = self.cmd_ring + CMD_RING + REPLY_RING * n


class ShmChannel(Channel):
    """The controller's end."""

    def __init__(self, num_workers: int, name: str) -> None:
        if num_workers > MAX_WORKERS:
            raise ValueError(
                f"the shm channel takes at most {MAX_WORKERS} workers: use channel='pipe'"
            )
        self.n = num_workers
        self._lay = lay = _Layout(num_workers)
        self._reply_fds: list[int] = []
        made: list[Any] = []  # what holds an fd, in order: closed if the start fails
        try:
            self._fd = sealed_memfd(f"{name}-ctl", lay.size)
            made.append(self._fd)
            self._mm = mmap.mmap(self._fd, lay.size)  # (it holds a copy of the fd)
            made.append(self._mm)
            self.arena: Arena = Arena(f"{name}-arena", num_workers, commands=True)
            made.append(self.arena)
            for r in range(num_workers):
                self._reply_fds.append(create_file(f"{name}-reply{r}", 1))
                made.append(self._reply_fds[-1])
            for _ in range(num_workers + 2):  # a worker's each, then ctl_efd and done_efd
                made.append(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
        except BaseException:
            for held in reversed(made):
                if isinstance(held, int):
                    os.close(held)
                else:
                    held.close()
            raise
        self._efd = made[-num_workers - 2 : -2]
        self._ctl_efd, self._done_efd = made[-2:]
        self._buf = memoryview(self._mm)
        self._q = self._buf.cast("Q")
        self._readers = [ArenaReader(fd, 0, 1, shared=True) for fd in self._reply_fds]
        self._done_lock = threading.Lock()  # one thread sleeps on the done eventfd at a time
        self._reply_pos = [0] * num_workers
        self._partial: list[list[bytes]] = [[] for _ in range(num_workers)]
        self._broken: dict[int, str] = {}  # rank -> what was malformed in its reply ring
        self._backlog: list[tuple[int, bytes | Reply | None]] = []
        self._rx_lock = threading.Lock()
        self._watch: list[int] = []
        self._watch_ep: select.epoll | None = None  # the watch fds, for a look without a wait
        self._watch_dups: list[int] = []  # our copies of them, which the epoll holds
        self._also: list[int] = []
        self._sleep_on()
        self._all_mask = (1 << num_workers) - 1
        self._busy = busy_budget(num_workers + 1)  # waits check without yielding first
        self._idle = False
        """The last wait slept to its end with nothing come: the next one (the router's
        next slice of the same long wait) sleeps at once. Spinning 200 us again every
        slice cost a controller waiting on a long call 0.07-0.1% of a core."""
        crowd.expect(num_workers + 1)  # so many runnable tasks are peers (pacing.crowd.look)
        self._closed = False
        # hot-path index tables
        self._sleep_idx = [o // 8 for o in lay.sleeping]
        self._rw_idx = [o // 8 for o in lay.reply_write]
        self._rr_idx = [o // 8 for o in lay.reply_read]
        self._cr_idx = [o // 8 for o in lay.cmd_read]
        self._done_idx = [o // 8 for o in lay.done]
        self._unrep_idx = [o // 8 for o in lay.unreported]
        self._cmd_base = lay.cmd_ring
        self._masks = {tuple(range(num_workers)): self._all_mask}
        self._masks.update({(r,): 1 << r for r in range(num_workers)})
        self._fast = None if _ring is None else _ring.Sender(
            self._mm, lay.cmd_ring, CMD_RING, self._efd, self._sleep_idx)
        # the ring's head: wpos, where the next entry goes, and limit, how far wpos may grow
        # without a look at the workers' read positions; the C ring's own where it is built
        self._head = _Head() if self._fast is None else cast(_Head, self._fast)  # same fields
        if self._fast is not None:
            self._fast.replies(lay.reply_ring, self._rw_idx, self._rr_idx, REPLY_RING,
                               array_value)
            self._fast.progress(self._done_idx, self._unrep_idx)
            self.send_plain = self._fast.send  # type: ignore[method-assign]
        self._values: Callable[..., list[Any] | bool | None] = (
            self._values_py if self._fast is None else self._fast.values)
        """plain_values' look: C's, else Python's (under the rx lock once ``absorber``)."""

    # -- set-up --------------------------------------------------------------------------------

    def endpoint(self, rank: int) -> tuple[dict[str, Any], list[int]]:
        spec = {"kind": "shm", "rank": rank, "n": self.n, "ctl": self._fd,
                "arena": self.arena.fd, "reply_arena": self._reply_fds[rank],
                "efd": self._efd[rank], "ctl_efd": self._ctl_efd, "done_efd": self._done_efd}
        return spec, [self._fd, self.arena.fd, self._reply_fds[rank], self._efd[rank],
                      self._ctl_efd, self._done_efd]

    def started(self, watch: Sequence[int] = ()) -> None:
        self._watch = list(watch)
        self._sleep_on()
        for fd in self._watch:
            self._look_out_for(fd)

    def watch_more(self, fd: int) -> None:
        """A worker that joined after ``started`` (channel.mixed): watch its pidfd too."""
        self._watch = [*self._watch, fd]
        self._sleep_on()
        self._look_out_for(fd)

    def _sleep_on(self) -> None:
        """The poll sets a waiting recv sleeps on (our eventfd, the watch fds, ``_also``)
        and a waiting sync (the done eventfd, the watch fds): made once, again when the
        fds change."""
        self._sleep_set = FdSet([self._ctl_efd, *self._watch, *self._also])
        self._done_set = FdSet([self._done_efd, *self._watch])

    def _look_out_for(self, fd: int) -> None:
        """Put a duplicate of ``fd`` in the set ``_death_seen`` looks at. Ours, closed with
        the channel: epoll forgets an fd once its last copy is closed, and a launcher closes
        its pidfds when it stops the workers, while a sender may still wait for room (it
        must see them dead, not an empty set, or it waits for good)."""
        if self._watch_ep is None:
            self._watch_ep = select.epoll()  # (closed with the channel)
        dup = os.dup(fd)
        self._watch_dups.append(dup)
        self._watch_ep.register(dup, select.EPOLLIN)

    def also_wake(self, fds: Sequence[int]) -> None:
        """Fds whose readability ends a waiting recv early, as a reply would (another
        channel's, in channel.mixed), without counting as a death."""
        self._also = list(fds)
        self._sleep_on()

    # -- commands ------------------------------------------------------------------------------

    def send(self, data: bytes, ranks: Sequence[int], buffers: Sequence[Any] = (), *,
             deadline: float | None = None) -> None:
        ranks = tuple(ranks)
        if buffers or len(data) > _INLINE_MAX:
            self._send_large(data, ranks, buffers, deadline)
            return
        # a plain entry that fits at the head, in one call: C's Sender.send where built (close()
        # releases it, whoever holds it, so no send keeps the mapping alive past close)
        if self.send_plain(data, ranks):
            return
        self._publish(data, b"", 0, ranks, deadline)

    def send_plain(self, data: bytes, ranks: tuple[int, ...], descs: bytes = b"",
                   meta: int = 0) -> bool:
        """Channel.send_plain: C's ``_ring.Sender.send`` where built (bound over this in
        ``__init__``), else this. False, with nothing written, where the entry would cross
        the ring's end or wait for room; ``send`` then makes room (``_make_room``) and
        writes it here (``_write``, this function whichever ring: then with the descriptors
        of its buffers, ``descs``, and their count and flags, ``meta``). Written in one
        frame: the pure-Python ring's hot path. Publishes the entry and wakes the targets
        that sleep."""
        head, n = self._head, len(data)
        pos = head.wpos
        size = (_ENTRY + 7 + n + len(descs)) & ~7  # _entry_size, inlined
        off = pos & _CMD_MASK
        if off + size > CMD_RING or pos + size > head.limit or n > _INLINE_MAX:
            return False
        q = self._q
        start = self._cmd_base + off
        i = start >> 3
        q[i] = n | (meta << 32)
        mask = self._masks.get(ranks)
        q[i + 1] = _mask(ranks) if mask is None else mask
        start += _ENTRY
        self._mm[start : start + n] = data
        if descs:
            self._mm[start + n : start + n + len(descs)] = descs
        head.wpos = pos = pos + size
        q[0] = pos  # publish: the entry is complete before its position is seen
        _fence()  # between publishing and reading the sleeping flags
        sleep_idx = self._sleep_idx
        for r in ranks:
            if q[sleep_idx[r]]:
                os.eventfd_write(self._efd[r], 1)
        return True

    _write = send_plain
    """The Python writer, where ``send_plain`` is C's: an entry with buffers, after room."""

    def _send_large(self, data: bytes, ranks: tuple[int, ...], buffers: Sequence[Any],
                    deadline: float | None) -> None:
        """Wait for ring room first, then place the buffers: a timeout leaves nothing placed."""
        if len(buffers) > MAX_BUFFERS:  # (the entry's count has 16 bits)
            raise too_many_buffers(len(buffers))
        big = len(data) > _INLINE_MAX
        self._room(_entry_size(_DESC if big else len(data), len(buffers)), deadline)
        descs = self.arena.place([*buffers, data] if big else buffers, ranks)
        flags = 0
        if big:
            data = _pack_descs(descs[-1:])
            descs = descs[:-1]
            flags = _OOB
        self._publish(data, _pack_descs(descs), len(descs) | (flags << 16), ranks, None)

    def _room(self, size: int, deadline: float | None) -> None:
        """Wait until an entry of ``size`` bytes fits at the ring's head (past a wrap)."""
        pos = self._head.wpos
        if (pos & _CMD_MASK) + size > CMD_RING or pos + size > self._head.limit:
            self._make_room(pos, size, deadline)

    def _publish(self, payload: bytes, descs: bytes, meta: int, ranks: tuple[int, ...],
                 deadline: float | None) -> None:
        """Write one entry at the ring's head, after making room, and make it visible."""
        if not self._write(payload, ranks, descs, meta):
            self._make_room(self._head.wpos, _entry_size(len(payload), len(descs) // _DESC),
                            deadline)
            if not self._write(payload, ranks, descs, meta):  # (room made: it fits)
                raise AssertionError("the command ring had no room after _make_room: a "
                                     "bug in unison, please report it")

    def _make_room(self, pos: int, size: int, deadline: float | None) -> None:
        """Skip to the ring's start if an entry of ``size`` bytes at ``pos`` would cross its
        end, and wait for space: then it fits at the head. The skip moves the head past a
        wrap mark nobody sees until the next entry is published after it."""
        wrap = _CMD.skip(pos, size)
        end = pos + wrap + size
        if end > self._head.limit:
            self._head.limit = self._slowest() + CMD_RING
            if end > self._head.limit:
                self._wait_space(end, deadline)
                self._head.limit = self._slowest() + CMD_RING
        if wrap:
            self._q[(self._cmd_base + (pos & _CMD_MASK)) >> 3] = _WRAP  # past the published head
            self._head.wpos = pos + wrap

    def published(self) -> int:
        """The command ring's published position: where it moved during a send, the
        workers may have the message."""
        return int(self._q[0])

    def _slowest(self) -> int:
        q = self._q
        return min(q[i] for i in self._cr_idx)

    def _wait_space(self, end: int, deadline: float | None) -> None:
        """The ring is full: wake every worker, keep draining replies (a worker may be blocked
        on its own full reply ring), and notice deaths and the deadline."""
        pacer = Pacer()
        while not _CMD.fits(end, self._slowest()):
            if deadline is not None and time.monotonic() >= deadline:
                raise SendTimeout(
                    "the command ring stayed full until the deadline (the workers are busy); "
                    "nothing of this message was sent"
                )
            with self._rx_lock:
                self._backlog.extend(self._collect())
            for r in range(self.n):
                if self._q[self._sleep_idx[r]]:
                    os.eventfd_write(self._efd[r], 1)
            if self._death_seen():
                raise BrokenPipeError("a worker died while the command ring was full")
            pacer.pause(deadline)

    # -- progress: sync without a message ------------------------------------------------------

    tracks_progress = True

    def mark(self) -> int:
        return self._head.wpos

    def _look(self, ranks: Sequence[int], mark: int) -> int:
        """Python's ``_ring.Sender.settled``: 0 while a worker in ``ranks`` has not run
        everything before ``mark``; else 1, or 2 where one holds errors nobody fetched.
        One frame, where it called a loop for each: each round of sync looks at least
        twice. A rank's error count is read after its done position, which publishes it."""
        q, done, unrep = self._q, self._done_idx, self._unrep_idx
        held = 1
        for r in ranks:
            if q[done[r]] < mark:
                return 0
            if q[unrep[r]]:
                held = 2
        return held

    def wait_done(self, ranks: Sequence[int], mark: int, timeout: float) -> bool:
        return self._wait_progress(ranks, mark, timeout) != 0

    def settled(self, ranks: Sequence[int], timeout: float) -> bool:
        """Channel.settled, the unreported errors read with the done positions: sync's hot
        path, where each function the round runs after the last worker finishes costs."""
        return self._wait_progress(ranks, self._head.wpos, timeout) == 1

    def _wait_progress(self, ranks: Sequence[int], mark: int, timeout: float) -> int:
        """See Channel.wait_done: spin 200 us, then sleep on the done eventfd and the watch
        fds; a worker that moves its done position wakes us only while our flag is up. Each
        look at the workers' words is one C call where _ring was built (issue 9: a sync in
        place took 0.93x the time at N=2). 0: not done within ``timeout``; else 1, or 2
        where a worker holds errors nobody fetched.

        Workers done before we look: 0 if a watch fd is readable (the caller looks for a
        death, so a sync with nothing left to wait for still notices one). Workers that
        finish while we wait were alive to do it: no look then (a syscall on dispatch's hot
        path, about 2.5 us a round: docs/benchmarks.md).

        Closed by another thread, before or in the middle (the released mapping's
        ValueError, a closed fd's OSError): 0, and the caller's long way says the session
        closed."""
        fast = self._fast
        look: Callable[[Any, int], int]
        key: Any  # a rank mask for C, the ranks for Python
        if fast is not None:
            mask = self._masks.get(tuple(ranks))
            look, key = fast.settled, (_mask(ranks) if mask is None else mask)
        else:
            look, key = self._look, ranks
        try:
            got = look(key, mark)
            if got:
                return 0 if self._death_seen() else got
            got = 0 if self._idle else spin(look, min(SPIN, timeout), self._busy, key, mark)
            if not got:
                self._sleep_done(ranks, mark, timeout)
                got = look(key, mark) or self._caught_up(ranks, mark)
            self._idle = not got
            return got
        except (ValueError, OSError):
            if self._closed:
                return 0
            raise

    def _death_seen(self) -> bool:
        """Whether a watched fd is readable: one epoll_wait on a set made once (a select
        of the list cost 2 us, more than the rest of a sync whose workers are done)."""
        ep = self._watch_ep
        if ep is None:
            return False
        try:
            return bool(ep.poll(0))
        except (ValueError, OSError):  # closed meanwhile: the caller's check says why
            return True

    def _sleep_done(self, ranks: Sequence[int], mark: int, timeout: float) -> None:
        start = time.perf_counter()
        if not self._done_lock.acquire(timeout=max(0.0, timeout)):
            return  # another thread slept meanwhile
        q = self._q
        try:
            q[_CTL_DONE] = 1
            _fence()
            if not self._look(ranks, mark):
                self._wake_behind(ranks, mark)
                wait = max(0.0, timeout - (time.perf_counter() - start))
                ready = self._done_set.readable(wait)
                if self._done_efd in ready:
                    _drain_eventfd(self._done_efd)
        finally:
            q[_CTL_DONE] = 0
            self._done_lock.release()

    def _caught_up(self, ranks: Sequence[int], mark: int) -> int:
        """_look, where a worker short of ``mark`` counts as done if no command between its
        done position and ``mark`` is for it: one asleep through a view's calls at a wait's
        end, or just woken and stepping past them (it publishes its done position once it
        runs out). Before (issue 9, forty-ninth pass; left by the forty-eighth),
        ``sync(timeout=0)`` named such a worker, sent nothing, as not finished. The slow
        path's last word only. The entries it reads are intact: no writer passes the
        ring's limit, which, read after the walk, lies within a ring of the done position
        (else the worker counts as not done, as before)."""
        q, done, unrep, head = self._q, self._done_idx, self._unrep_idx, self._head
        held = 1
        for r in ranks:
            at = q[done[r]]
            if at < mark and (self._sent_to(r, at, mark) or head.limit > at + CMD_RING):
                return 0
            if q[unrep[r]]:
                held = 2
        return held

    def _sent_to(self, rank: int, pos: int, end: int) -> bool:
        """Whether a command in the ring between positions ``pos`` and ``end`` is for
        ``rank`` (a worker's walk, as ``take``'s, reading only the rank masks)."""
        q, base, bit = self._q, self._cmd_base, 1 << rank
        while pos < end:
            i = (base + (pos & _CMD_MASK)) >> 3
            head = q[i]
            if head == _WRAP:
                pos = _CMD.next_lap(pos)
                continue
            if q[i + 1] & bit:
                return True
            pos += _entry_size(head & 0xFFFFFFFF, head >> 32 & 0xFFFF)
        return False

    def _wake_behind(self, ranks: Sequence[int], mark: int) -> None:
        """Wake each worker of ``ranks`` that sleeps with its done position short of
        ``mark``: a send wakes only the workers it is for, so one that slept through
        commands for others (a view's calls) stayed behind them until its sleep's end (up
        to SLEEP): a sync of the whole session then took up to a second, and
        ``sync(timeout=0.2)`` raised TimeoutError for a worker sent nothing (an audit,
        issue 9, forty-eighth pass). Woken, it steps past them, publishes, and sleeps."""
        q, done, sleep_idx = self._q, self._done_idx, self._sleep_idx
        for r in ranks:
            if q[done[r]] < mark and q[sleep_idx[r]]:
                os.eventfd_write(self._efd[r], 1)

    def unreported(self, ranks: Sequence[int]) -> bool:
        q, idx = self._q, self._unrep_idx
        for r in ranks:  # noqa: SIM110 (a plain loop: the hot path)
            if q[idx[r]]:
                return True
        return False

    def holding(self, ranks: Sequence[int]) -> list[int]:
        q, idx = self._q, self._unrep_idx
        return [r for r in ranks if q[idx[r]]]

    # -- an event loop's wait ------------------------------------------------------------------

    def wake_fds(self) -> list[int]:
        return [self._ctl_efd]

    def pending(self) -> bool:
        """Channel.pending; False once closed, by another thread too, in the middle of
        the look (an await's spin looks without the router's lock)."""
        try:
            return not self._closed and self._has_reply()
        except ValueError:  # the mapping released meanwhile
            if self._closed:
                return False
            raise

    def async_waiting(self, on: bool) -> None:
        try:
            if not self._closed:
                self._q[_CTL_ASYNC] = 1 if on else 0
                _fence()  # the caller polls next: a reply published before the flag is seen
        except ValueError:  # closed meanwhile: nobody to signal any more
            if not self._closed:
                raise

    def clear_wake(self) -> None:
        _drain_eventfd(self._ctl_efd)

    def rearm_wake(self) -> None:
        if not self._closed:
            os.eventfd_write(self._ctl_efd, 1)

    # -- replies -------------------------------------------------------------------------------

    def recv(
        self, timeout: float | None, watch: Sequence[int] | None = None
    ) -> list[tuple[int, bytes | Reply | None]]:
        """See Channel.recv: spin 200 us, then sleep on our eventfd and the watch fds."""
        has_reply = self._has_reply
        if not has_reply():
            if timeout == 0:  # a poll: no spin, no sleep
                return []
            now = time.perf_counter()
            if self._idle or not spin(has_reply, SPIN if timeout is None else min(SPIN, timeout),
                                      self._busy):
                self._doze(timeout, now, has_reply)
            got = self._take()
            self._idle = not got
            return got
        return self._take()

    def plain_values(self, ranks: tuple[int, ...], req_id: int,
                     timeout: float) -> list[Any] | None:
        """See Channel.plain_values: each look one C call (which reads each rank's ring, and
        decodes once all are in); a spin as recv's, then, if need be, recv's sleep until
        any reply is in, and a look. Where the session has more processes than cores, the
        core is first handed over once (pacing.hand_over)."""
        if self._backlog or self._broken:
            return None
        look = self._values
        # partial: worker 0 inline may read chunks in another thread meanwhile (absorb);
        # each look sees them within its one C call (in Python: under the rx lock then)
        pos, partial = self._reply_pos, self._partial
        if not self._busy:  # more processes than cores: a worker may wait for ours
            hand_over()
        got = look(pos, ranks, req_id, partial)
        if got is None:
            now = time.perf_counter()
            got = False if self._idle else spin(look, min(SPIN, timeout), self._busy, pos,
                                                ranks, req_id, partial)
            # a long call: sleep as recv would, so that its spin is not paid twice; but not
            # while an event loop waits on our eventfd: the sleep empties it, and only recv
            # then delivers the loop's replies as well (an await that comes after this look
            # finds the router's lock taken: the router re-arms the eventfd as we let go)
            if got is False and not self._q[_CTL_ASYNC]:
                if len(ranks) == self.n:  # every reply that comes first is ours
                    got = self._doze(timeout, now, look, pos, ranks, req_id, partial)
                else:  # another thread's may: wake at any reply, and let wait deliver it
                    self._doze(timeout, now, self._has_reply)
                    got = look(pos, ranks, req_id, partial)
            self._idle = got is False or got is None
        return got if type(got) is list else None

    def _values_locked(self, positions: list[int], ranks: tuple[int, ...], req_id: int,
                       partial: list[list[bytes]]) -> list[Any] | bool | None:
        """``_values_py`` under the rx lock: the look once another thread may read the
        rings (``absorber``)."""
        with self._rx_lock:
            return self._values_py(positions, ranks, req_id, partial)

    def _values_py(self, positions: list[int], ranks: tuple[int, ...], req_id: int,
                   partial: list[list[bytes]]) -> list[Any] | bool | None:
        """Python's ``_ring.Sender.values``, the same answers: None while a rank's reply is
        not in; True (nothing read) where one is anything but a plain reply of (req_id, OK,
        value) (or ARRAY: its value made by array_value) in the ring, or breaks the format;
        else the values, all consumed. Without the rx lock, which cost a quarter of it
        (benchmarks/ring_costs.py): the router lets one thread read at a time, and only
        ``absorber`` adds another."""
        q, mm, rw_idx, rings = self._q, self._mm, self._rw_idx, self._lay.reply_ring
        found = []
        for r in ranks:
            if partial[r]:  # the next entry is a chunk, not a reply
                return True
            pos, end = positions[r], q[rw_idx[r]]
            if pos == end:
                return None
            if not 0 < end - pos <= REPLY_RING:
                return True
            off = pos & _REPLY_MASK
            head = q[(rings[r] + off) >> 3]
            if head == _WRAP and REPLY_RING - off <= end - pos:  # once a lap
                pos += REPLY_RING - off
                if pos == end:
                    return None
                off, head = 0, q[rings[r] >> 3]
            size = (15 + head) & ~7  # _align8(8 + n), inlined; head is n if no flags
            if head >> 32 or not 8 < size <= end - pos or off + size > REPLY_RING:
                return True  # flags, an ack, bytes that break the format
            found.append((r, rings[r] + off + 8, head, pos + size))
        out = []
        for _, start, n, _ in found:
            try:
                # from the mmap's own slice: marshal reads a view's bytes at half the speed
                got, status, value = loads_plain(mm[start : start + n])
            except Exception:  # a pickle, not a marshal of three: the slow path judges
                return True
            if got != req_id or status != OK:
                if got != req_id or status != ARRAY:
                    return True
                try:
                    value = array_value(value)
                except Exception:  # the slow path says what is wrong with it
                    return True
            out.append(value)
        rr_idx = self._rr_idx
        for r, _, _, at in found:  # all read: consume them
            positions[r] = q[rr_idx[r]] = at
        return out

    def _doze(self, timeout: float | None, since: float, ready: Callable[..., Any],
              *args: Any) -> Any:
        """Sleep on our eventfd and the watch fds until ``ready(*args)`` is true, a watched
        fd is readable, or ``timeout`` seconds after ``since``: ready's last answer. A reply
        wakes us, and where ready wants more (plain_values: every worker's) we sleep again:
        workers end a long call apart, and giving up at the first reply cost 58-82% of
        5 ms calls at N=2 their quick path (benchmarks/long_calls.py)."""
        q = self._q
        q[_CTL_SLEEP] = 1  # we are going to sleep
        _fence()
        try:
            while True:
                got = ready(*args)
                if got:
                    return got
                wait = SLEEP if timeout is None else timeout - (time.perf_counter() - since)
                if wait <= 0:
                    return got
                woke = self._sleep_set.readable(wait)
                if self._ctl_efd in woke:
                    _drain_eventfd(self._ctl_efd)  # (then look: a reply after it writes again)
                    if len(woke) == 1:
                        continue
                return ready(*args)  # a watched fd, or the time is up
        finally:
            q[_CTL_SLEEP] = 0

    def absorber(self) -> Callable[[], None]:
        """``absorb``, for worker 0 inline in the controller, which may call it in one
        thread while another reads replies: from now on the pure-Python look takes the rx
        lock as well (C's is one call under the GIL)."""
        if self._fast is None:
            self._values = self._values_locked
        return self.absorb

    def absorb(self) -> None:
        """Read every reply now in the rings into the backlog, for the next recv: the room
        worker 0 inline in the controller needs when its reply ring is full."""
        with self._rx_lock:
            self._backlog.extend(self._collect())

    def _has_reply(self) -> bool:
        fast = self._fast  # once: close() sets it to None
        if fast is not None and not self._broken:  # in C
            return fast.pending(self._reply_pos) or bool(self._backlog)
        q, pos = self._q, self._reply_pos
        for r, i in enumerate(self._rw_idx):
            if q[i] != pos[r] and r not in self._broken:
                return True
        return bool(self._backlog)

    def _take(self) -> list[tuple[int, bytes | Reply | None]]:
        with self._rx_lock:
            out = self._backlog
            if out:
                self._backlog = []
                out.extend(self._collect())
                return out
            return self._collect()

    def _collect(self) -> list[tuple[int, bytes | Reply | None]]:
        """Read every complete reply now in the rings; caller holds the rx lock. Plain ones
        in C, where it was built, unless a rank is in the middle of a chunked reply."""
        if self._fast is not None and not any(self._partial) and not self._broken:
            plain, more = self._fast.collect(self._reply_pos)
            out: list[tuple[int, bytes | Reply | None]] = plain
            if more:  # a rank stopped at a reply with buffers or chunks: read on below
                out.extend(self._collect_py())
            return out
        return self._collect_py()

    def _collect_py(self) -> list[tuple[int, bytes | Reply | None]]:
        """The replies in the rings, read in Python. A worker wrote them: an entry that
        breaks the format (a position or a size past what its ring holds, unknown flags, a
        descriptor outside its arena) ends that worker's stream, as a closed TCP connection
        does: ``(rank, None)`` once, after the replies before it; ``where`` says why."""
        out: list[tuple[int, bytes | Reply | None]] = []
        q, buf, lay, broken = self._q, self._buf, self._lay, self._broken
        for r, wi in enumerate(self._rw_idx):
            pos, end = self._reply_pos[r], q[wi]
            if pos == end or r in broken:
                continue
            base = lay.reply_ring[r]
            problem = ""
            unmapped: str | None = None
            if not 0 < end - pos <= REPLY_RING:
                problem = f"its reply position went from {pos} to {end}"
                end = pos
            while pos != end:
                off = pos & _REPLY_MASK
                head = q[(base + off) // 8]
                if head == _WRAP:
                    if _REPLY.next_lap(pos) > end:
                        problem = f"a wrap marker at {pos}, past its reply position {end}"
                        break
                    pos = _REPLY.next_lap(pos)
                    continue
                n = head & 0xFFFFFFFF
                size = _align8(8 + n)
                if off + size > REPLY_RING or pos + size > end or head & _REPLY_BAD:
                    problem = (f"an entry at {pos} with header {head:#x}, its reply position "
                               f"at {end}")
                    break
                start = base + off + 8
                if head >> _NDESC or head & _INDIRECT:
                    try:
                        reply = self._unpack_reply(r, head, buf[start : start + n])
                    except Malformed as exc:
                        problem = f"the entry at {pos}: {exc}"
                        break
                    except OSError as exc:  # ours: ENOMEM past the mappings a process may hold
                        unmapped = str(exc)  # (not exc: its frames hold views of the ring)
                        break
                    pos += size
                    out.append((r, reply))
                    continue
                pos += size
                chunk = bytes(buf[start : start + n])
                if head & _MORE:
                    self._partial[r].append(chunk)
                    continue
                if self._partial[r]:
                    self._partial[r].append(chunk)
                    chunk = b"".join(self._partial[r])
                    self._partial[r] = []
                out.append((r, chunk))
            self._reply_pos[r] = pos
            q[self._rr_idx[r]] = pos  # hand the space back
            if unmapped is not None or problem:
                broken[r] = (_UNMAPPED.format(unmapped) if unmapped is not None else
                             f"its reply ring held bytes that break the format ({problem})")
                self._partial[r] = []
                out.append((r, None))
        return out

    def _unpack_reply(self, rank: int, head: int, body: memoryview) -> Reply:
        """A reply whose buffers (or whole body) lie in worker ``rank``'s reply arena: map
        them now, so that the blocks are counted as done whenever the reply is dropped.
        Raises Malformed (nothing of it kept) where the entry breaks the format."""
        if head & _MORE or self._partial[rank]:
            raise Malformed("a reply with buffers inside a chunked one")
        reader = self._readers[rank]
        if head & _INDIRECT:
            if len(body) != _DESC:
                raise Malformed(f"an indirect reply of {len(body)} bytes, not one descriptor")
            body = reader.view(_unpack_descs(body, 1)[0])
        ndesc = head >> _NDESC
        if _DESC * ndesc > len(body):
            raise Malformed(f"{ndesc} buffer descriptors in a body of {len(body)} bytes")
        descs = _unpack_descs(body, ndesc) if ndesc else []
        payload = body[_DESC * ndesc :]
        data = payload if head & _INDIRECT else payload.tobytes()
        return Reply(data, [reader.view(d) for d in descs])

    def ended(self) -> int | None:
        """A worker whose reply ring held a malformed entry (its stream ended there)."""
        return next(iter(self._broken), None)

    def where(self, rank: int) -> str:
        return self._broken.get(rank, "")

    def was_idle(self, rank: int) -> bool:
        """Channel.was_idle: a worker publishes where it took up to as it takes an entry,
        and its done position at its next take, so the two differ only while it runs one.
        False once closed, also by another thread in the middle of the look."""
        try:
            q = self._q
            return q[self._cr_idx[rank]] == q[self._done_idx[rank]]
        except ValueError:  # the mapping released by a close (a death is being reported)
            return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        fast, self._fast = self._fast, None
        if fast is not None:  # it holds a view of the mapping, as may a traceback's frames
            fast.release()
        for fd in (*self._efd, self._ctl_efd, self._done_efd):
            os.close(fd)
        if self._watch_ep is not None:
            self._watch_ep.close()
        for fd in self._watch_dups:
            os.close(fd)
        self.arena.close()
        for fd in self._reply_fds:
            os.close(fd)  # the controller's mappings of fetched arrays keep their pages
        self._q.release()
        self._buf.release()
        try:
            self._mm.close()
        except BufferError:
            pass  # only if someone still holds a view; the mapping then goes with it
        os.close(self._fd)


class ShmWorkerChannel(WorkerChannel):
    """A worker's end."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.rank = r = spec["rank"]
        n = spec["n"]
        self._lay = lay = _Layout(n)
        self._mm = mmap.mmap(spec["ctl"], lay.size)
        self._buf = memoryview(self._mm)
        self._q = self._buf.cast("Q")
        self._arena = ArenaReader(spec["arena"], r, n)
        self._replies = Arena("", 1, fd=spec["reply_arena"], keep=REPLY_KEEP)
        self._efd, self._ctl_efd, self._done_efd = spec["efd"], spec["ctl_efd"], spec["done_efd"]
        self._sleep_set = FdSet([self._efd])  # what a waiting worker sleeps on
        self._bit = 1 << r
        self._busy = busy_budget(n + 1)  # waits check without yielding first
        crowd.expect(n + 1)  # so many runnable tasks are peers (pacing.crowd.look)
        self._pos = self._q[lay.cmd_read[r] // 8]
        self._read_idx = lay.cmd_read[r] // 8
        self._sleep_idx = lay.sleeping[r] // 8
        self._rw_idx = lay.reply_write[r] // 8
        self._rr_idx = lay.reply_read[r] // 8
        self._done_idx = lay.done[r] // 8
        self._unrep_idx = lay.unreported[r] // 8
        self._rbase = lay.reply_ring[r]
        self._cmd_base = lay.cmd_ring
        self._taker = None if _ring is None else _ring.Taker(
            self._mm, lay.cmd_ring, CMD_RING, self._bit, self._read_idx, self._done_idx,
            _CTL_DONE, self._done_efd)
        if self._taker is not None:
            self._taker.replies(self._rbase, REPLY_RING, self._rw_idx, self._rr_idx,
                                _CTL_SLEEP, _CTL_ASYNC, self._ctl_efd)
            self.reply_plain = self._taker.put_plain  # type: ignore[method-assign]
        else:  # the pure-Python ring: no frame of recv's before _recv's
            self.recv = self._recv  # type: ignore[method-assign]

    def recv(self, block: bool = True) -> tuple[bytes | memoryview, list[Any]] | None:
        """The next entry for us; ``block=False``: None when there is none now (worker 0
        inline in the controller, which must never wait for the controller)."""
        taker = self._taker
        if taker is None:
            return self._recv(block)
        pos = self._pos
        while True:
            payload, pos = taker.take(pos)  # progress, skips, one plain entry: in C
            self._pos = pos
            if payload is None:
                if not block:
                    return None
                self._wait(pos)
            elif payload is False:
                return self._recv()  # an entry with buffers: parsed below
            else:
                return payload, _NO_VIEWS

    def poll(self) -> tuple[bytes | memoryview, list[Any]] | None:
        """``recv(block=False)``."""
        return self.recv(False)

    def _recv(self, block: bool = True) -> tuple[bytes | memoryview, list[Any]] | None:
        """The next entry, read in Python (also where C found one with buffers, or one
        that breaks the format). Raises Malformed (an OSError: the worker leaves, as on a
        broken TCP stream) where the controller's bytes do."""
        q, base = self._q, self._cmd_base
        pos = self._pos
        q[self._done_idx] = pos  # _progress, inlined: everything before pos has run
        _fence()
        if q[_CTL_DONE]:
            _wake(self._done_efd)
        while True:
            end = q[0]
            if end == pos:
                if q[self._done_idx] != pos:  # skipped commands for others: done too
                    self._progress(pos)
                if not block:
                    return None
                self._wait(pos)
                continue
            if not 0 < end - pos <= CMD_RING:
                raise _bad_command(pos, end, f"the command position went to {end}")
            off = pos & _CMD_MASK
            i = (base + off) >> 3
            head = q[i]
            if head == _WRAP:
                if _CMD.next_lap(pos) > end:
                    raise _bad_command(pos, end, "a wrap marker past the command position")
                pos = _CMD.next_lap(pos)
                continue
            n, meta = head & 0xFFFFFFFF, head >> 32
            size = (_ENTRY + 7 + n + _DESC * (meta & 0xFFFF)) & ~7  # _entry_size, inlined
            if off + size > CMD_RING or pos + size > end:
                raise _bad_command(pos, end, f"an entry with header {head:#x}")
            if not q[i + 1] & self._bit:
                pos += size
                self._pos = q[self._read_idx] = pos
                continue
            body = base + off + _ENTRY
            if not meta:
                payload: bytes | memoryview = self._mm[body : body + n]  # a copy, in one step
                self._pos = q[self._read_idx] = pos + size  # the ring space is free again
                return payload, _NO_VIEWS
            if meta >> 16 & ~_OOB or (meta >> 16 & _OOB and n != _DESC):
                raise _bad_command(pos, end, f"an entry with header {head:#x}")
            payload = self._buf[body : body + n].tobytes()
            nbufs = meta & 0xFFFF
            descs = _unpack_descs(self._buf[body + n : body + n + _DESC * nbufs], nbufs)
            self._pos = q[self._read_idx] = pos + size
            if meta >> 16 & _OOB:
                payload = self._arena.view(_unpack_descs(payload, 1)[0])
            return payload, self._arena.views(descs)  # (Unmapped: the command fails)

    def _progress(self, pos: int) -> None:
        """Publish how far this worker has run; wake the controller if it waits on that."""
        q = self._q
        q[self._done_idx] = pos
        _fence()  # between publishing and reading the flag
        if q[_CTL_DONE]:
            _wake(self._done_efd)

    def unreported(self, count: int) -> None:
        self._q[self._unrep_idx] = count  # published with the next done position

    def settle(self) -> None:
        """Publish that every entry taken has run, as the next recv would: worker 0 inline,
        where an exception left the loop in the middle of one (its caller hears of it), and
        no recv may come before the controller waits on the done position."""
        self._progress(self._pos)

    def _first_wait(self, pos: int) -> None:
        """The wait for the session's first command: it spans the other workers' start,
        which no later wait should take for a crowd (pacing.crowd.forget)."""
        self._wait = self._spin_then_sleep  # type: ignore[method-assign]
        self._spin_then_sleep(pos)
        crowd.forget()

    _wait = _first_wait

    def _spin_then_sleep(self, pos: int) -> None:
        q = self._q
        now = _clock()  # pacing.spin, inlined: the worker's hot path
        if now >= crowd.next_look:
            crowd.look(now)
        if now >= crowd.until:
            end = now + SPIN
            if self._busy:  # every process has a core: check without leaving it first
                until = now + self._busy
                while now < until:
                    if q[0] != pos:
                        crowd.rate *= CALM
                        return
                    now = _clock()
            while True:
                _yield()
                if q[0] != pos:
                    crowd.rate *= CALM
                    return
                then, now = now, _clock()
                if now - then > LONG_YIELD:
                    crowd.met_long_yield(now)
                    break
                if now >= end:
                    crowd.rate *= CALM
                    break
        q[self._sleep_idx] = 1
        _fence()
        try:
            while q[0] == pos:
                if self._sleep_set.readable(self._nap):
                    _drain_eventfd(self._efd)
                elif self._idle is not None:
                    self._idle()
        finally:
            q[self._sleep_idx] = 0

    _nap = SLEEP
    """How long each of a waiting worker's sleeps lasts (``on_idle``: IDLE_S)."""
    _idle: Callable[[], None] | None = None

    def on_idle(self, fn: Callable[[], None]) -> None:
        self._idle, self._nap = fn, IDLE_S

    oob_replies = True

    def reply_plain(self, msg: tuple[Any, ...], version: int) -> bool:
        """WorkerChannel.reply_plain: C's ``Taker.put_plain`` where built (bound over this
        in ``__init__``), else ``_put`` of its marshal, where no arena is needed."""
        data = dumps_plain(msg, version)
        n = len(data)
        if n > _REPLY_INLINE:
            return False
        q = self._q
        pos = q[self._rw_idx]
        off, size = pos & _REPLY_MASK, (15 + n) & ~7  # _align8(8 + n), inlined
        if off + size > REPLY_RING or pos + size - q[self._rr_idx] > REPLY_RING:
            self._put(data, 0)  # across the ring's end, or waiting for room
            return True
        start = self._rbase + off  # _put's steps, inlined: the pure-Python hot path of run
        q[start >> 3] = n
        self._mm[start + 8 : start + 8 + n] = data
        q[self._rw_idx] = pos + size  # publish
        _fence()
        if q[_CTL_SLEEP] or q[_CTL_ASYNC]:
            _wake(self._ctl_efd)
        return True

    def reply(self, data: bytes, buffers: Sequence[Any] = ()) -> None:
        """Small replies go in the ring; buffers, and a body over a quarter of the ring, go
        through this worker's reply arena, copied once. Raises MemoryError, with nothing
        sent, if buffers do not fit there (a large pickle alone falls back to the ring)."""
        if not buffers and len(data) <= _REPLY_INLINE:
            self._put(data, 0)
            return
        arena, ctl = self._replies, (0,)
        descs = arena.place(buffers, ctl) if buffers else []
        body = _pack_descs(descs) + data if descs else data
        head = len(descs) << _NDESC
        if len(body) > _REPLY_INLINE:
            try:
                body = _pack_descs([arena.place_bytes(body, ctl)])
                head |= _INDIRECT
            except MemoryError:
                if descs:
                    arena.unplace(descs, ctl)
                    raise
                self._chunked(data)  # no room: the ring, a chunk at a time
                return
        self._put(body, head)

    def _chunked(self, data: bytes) -> None:
        step = REPLY_RING // 2 - 8
        view = memoryview(data)
        for i in range(0, len(view), step):
            chunk = view[i : i + step]
            self._put(chunk, _MORE if i + step < len(view) else 0)

    def _put(self, chunk: bytes | memoryview, flags: int) -> None:
        taker = self._taker
        if taker is not None and not flags and taker.put(chunk):  # a plain one that fits
            return
        q, buf = self._q, self._buf
        n = len(chunk)
        size = _align8(8 + n)
        pos = q[self._rw_idx]  # written by this worker alone
        off = pos & _REPLY_MASK
        wrap = REPLY_RING - off if off + size > REPLY_RING else 0  # Ring.skip, inlined
        if pos + wrap + size - q[self._rr_idx] > REPLY_RING:  # not Ring.fits: wait for room
            pacer = Pacer()
            while not _REPLY.fits(pos + wrap + size, q[self._rr_idx]):
                if self.make_room is not None:  # in the controller: it reads them now
                    self.make_room()
                    continue
                self._wake_controller()
                pacer.pause()  # the controller drains replies whenever it waits
        if wrap:
            q[(self._rbase + off) // 8] = _WRAP
            pos += wrap
            off = 0
        start = self._rbase + off
        q[start // 8] = n | flags
        buf[start + 8 : start + 8 + n] = chunk
        q[self._rw_idx] = pos + size  # publish
        _fence()  # _wake_controller, inlined: a fence, then the flags
        if q[_CTL_SLEEP] or q[_CTL_ASYNC]:
            _wake(self._ctl_efd)

    def ack(self) -> None:
        if self._taker is not None:
            self._put(b"", 0)
            return
        q = self._q
        pos = q[self._rw_idx]
        off = pos & _REPLY_MASK  # Ring.skip and Ring.fits, inlined: the hot path
        if off + 8 > REPLY_RING or pos + 8 - q[self._rr_idx] > REPLY_RING:
            self._put(b"", 0)
            return
        q[(self._rbase + off) >> 3] = 0  # an empty entry: the ack
        q[self._rw_idx] = pos + 8
        _fence()
        if q[_CTL_SLEEP] or q[_CTL_ASYNC]:
            _wake(self._ctl_efd)

    def _wake_controller(self) -> None:
        _fence()
        if self._q[_CTL_SLEEP] or self._q[_CTL_ASYNC]:
            _wake(self._ctl_efd)

    make_room: Callable[[], None] | None = None
    """Worker 0 inline in the controller: what reads the replies when its ring is full
    (the controller's channel's ``absorb``); a process waits for the controller instead."""

    def close(self) -> None:
        pass  # the mappings go with the process

    def release(self) -> None:
        """Unmap everything now (worker 0 inline in the controller, whose process goes on)."""
        if self._taker is not None:  # it holds a view of the mapping, which a frame that
            self._taker.release()  # outlives the session (a kept traceback's) may hold
        self._taker = None
        self.__dict__.pop("reply_plain", None)
        self._replies.close()  # (the command arena's blocks unmap when garbage: no fd held)
        self._q.release()
        self._buf.release()
        try:
            self._mm.close()
        except BufferError:
            pass  # a view someone still holds keeps it mapped until it goes


def _entry_size(payload: int, ndescs: int) -> int:
    """Bytes a command entry takes in the ring."""
    return (_ENTRY + 7 + payload + _DESC * ndescs) & ~7


class _Head:
    """The ring's head where the C ring is not built (its Sender holds these otherwise)."""

    __slots__ = ("limit", "wpos")

    def __init__(self) -> None:
        self.wpos = 0
        self.limit = CMD_RING


def _mask(ranks: Sequence[int]) -> int:
    m = 0
    for r in ranks:
        m |= 1 << r
    return m


def _pack_descs(descs: Sequence[tuple[int, int, int]]) -> bytes:
    out = bytearray()
    for d in descs:
        for v in d:
            out += v.to_bytes(8, "little")
    return bytes(out)


def _unpack_descs(data: bytes | memoryview, count: int) -> list[tuple[int, int, int]]:
    q = memoryview(data)[: _DESC * count].cast("Q")
    return [(q[3 * i], q[3 * i + 1], q[3 * i + 2]) for i in range(count)]


def _bad_command(pos: int, end: int, what: str) -> Malformed:
    return Malformed(f"the command ring holds bytes that break the format at position {pos} "
                     f"(the controller's position is {end}): {what}")


_UNMAPPED = ("the controller could not map its reply's shared memory ({}): the controller "
             "itself is short of memory or of mappings (Linux allows a process about 65,000, "
             "vm.max_map_count; each fetched array kept alive holds one)")
"""Why a worker's stream ended where the controller failed to map its reply: not the
worker's bytes."""


def _wake(fd: int) -> None:
    """A worker's wake of the controller (as C's wake_checked). Its failure (not for a full
    counter, which eventfd_write never raises for) means code in the worker closed or
    replaced unison's eventfd: the worker ends, saying so."""
    try:
        os.eventfd_write(fd, 1)
    except OSError as exc:
        raise meddled(exc, fd, "an eventfd: the controller cannot be woken") from None


def _drain_eventfd(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass
