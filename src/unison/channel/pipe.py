"""The pipe channel: one pipe pair per worker, portable and simple.

    controller                                    worker i
    send(msg) -> frames ---- cmd pipe ---->  recv(): reads the pipe itself
      (full: read the replies meanwhile)
    recv() <- backlog, then the pipes <----  reply(data)

The worker's main thread reads its command pipe itself, the next frame once the last call is
done. So a command pipe fills while its worker runs a long call, and the controller's send
waits for room, as on the shared-memory ring. While it waits it reads every reply there is
into a backlog, which recv hands out first: a worker blocked on a full reply pipe never
waits for a controller blocked on its full command pipe (an event loop's wake fd says when
the backlog grew). A thread that drained the pipe into a queue cost a hand-off between two
threads per message: without it dispatch took 30 against 49-50 µs a round at N=2, and 100-101
against 162-166 at N=8 (docs/benchmarks.md, "Issue 9, thirtieth pass").

A command is one frame: ``[payload length, buffer count]``, the payload, then per buffer
``[kind, length]`` and its bytes, or (kind ``_BY_REF``) the descriptor of a block of the
shared arena. Where memfd exists the channel owns such an arena for ``sess.empty``: those
arrays travel by reference, so workers write the controller's memory here too. Every other
buffer is copied through the pipe (into a writable bytearray on the worker).

A reply is ``[tagged length, progress]``, then its pickle. The length word carries a tag in
its top 16 bits: a worker whose pipe holds anything else (its code wrote to the wrong fd) has
its stream ended there, as a closed pipe would, and ``where`` says why; it is never read as a
length to allocate or wait for. The progress word is ``frames run << 1 | holds errors nobody
fetched``; a worker that is about to wait for a command, with progress it has not told, writes
it alone (a report: tag ``_REPORT``, no body). So sync after a quick call reads a report
instead of sending SYNC and waiting for its answers (``settled``): dispatch is one message
each way, as on a Pipe (it took 18 against 26 µs a round at N=2, docs/benchmarks.md, "Issue
9, thirty-second pass"). Only one thread reads the pipes at a time, so ``settled`` looks only
where none does, and lets go as soon as a recv of another thread wants them: then that sync
asks. Sends read the replies every _DRAIN_EVERY frames. The controller reads replies
without blocking, keeping the start of a reply still being written for the next read: a
worker stopped half-way through a reply (SIGSTOP, a thread holding its GIL) is a hung worker
like any other, which the wait's deadline reports, rather than a read that never returns.

The controller's recv looks at its reply pipes (one poll set, made once), yields the core
while it looks for up to SPIN, then sleeps in poll, as the other channels' waits do: a
reply is often a few µs away, and a sleep's wake-up costs tens of µs (dispatch at N=1 took
26 against 62 µs a round, docs/benchmarks.md, "Issue 9, thirtieth pass").

The controller's ends are non-blocking, so a send can watch the workers' pidfds and honour
a deadline: it first waits until every target pipe surely has room for the whole frame
(counted in pages, as Linux counts a pipe's capacity: ``_slots_used``), so a timeout leaves
nothing written; only a frame larger than a pipe can hold may time out half written
(PartialSendError).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import select
import struct
import termios
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from unison._fdwait import FdSet, poll_fds, poll_ms, readable, reuse
from unison.channel import (
    _IOV,
    Channel,
    Reply,
    SendTimeout,
    Stall,
    WorkerChannel,
    drain_fd,
    half_sent,
    held,
    meddled,
    own_error,
    receive_buffer,
    reported,
    stall,
    write_frame,
)
from unison.pacing import SPIN, Pacer, busy_budget, crowd, spin

if TYPE_CHECKING:
    from unison.channel.arena import Arena

_HEAD = struct.Struct("<QI")  # payload length, buffer count
_REPLY = struct.Struct("<QQ")  # a reply's tagged length, and the worker's progress word
_TAG = 0x554E << 48  # b"NU" in the length word's top bytes
_REPORT = 0x5052 << 48  # b"RP": no reply, only the progress word (the length is 0)
_SIZE = (1 << 48) - 1
_MAX_REPLY = 1 << 40
"""A length word over this is no reply's, whatever its tag (1 TiB)."""
_BUF = struct.Struct("<BQ")  # kind, length
_DESC = struct.Struct("<QQQ")
_BYTES, _BY_REF = 0, 1
_ATOMIC = select.PIPE_BUF - _REPLY.size
"""A reply body this small goes with its length in one write, which a pipe takes whole."""
_PIPE_SIZE = 1 << 20  # asked of the kernel, up to /proc/sys/fs/pipe-max-size
_PAGE = mmap.PAGESIZE
"""What Linux counts a pipe's capacity in: slots of a page each (see ``_slots_used``)."""
_DRAIN_EVERY = 1024
"""Sends between two reads of the reply pipes at least: a worker reports at most once per
frame (16 bytes), so a controller that only calls, never waiting, still empties them before
they fill (a worker blocked writing a report would read no command)."""


class PipeChannel(Channel):
    def __init__(self, num_workers: int, name: str = "unison") -> None:
        self._closed = False
        self._cmd: list[int] = []
        self._replies: list[Connection] = []
        self._child_fds: list[tuple[int, int]] = []
        self._slots: list[int] = []
        """Per worker, the pages its command pipe holds (its capacity, which only we set)."""
        self._watch: list[int] = []
        self.arena: Arena | None = None  # where memfd exists (sess.empty is shared there)
        try:  # each fd is owned (closed by close()) as soon as it is made
            for _ in range(num_workers):
                cmd_r, cmd_w = os.pipe()
                self._cmd.append(cmd_w)
                try:
                    rep_r, rep_w = os.pipe()
                except BaseException:
                    _close_fd(cmd_r)
                    raise
                self._child_fds.append((cmd_r, rep_w))
                self._replies.append(Connection(rep_r, writable=False))  # owns rep_r
                _grow(cmd_w)
                os.set_blocking(cmd_w, False)
                self._slots.append(_capacity(cmd_w) // _PAGE)
                os.set_blocking(rep_r, False)
            self._yield_r, self._yield_w = os.pipe()
            """Written by a recv that finds the rx lock held: a settled holding it lets go."""
            self._wake_r, self._wake_w = os.pipe()
            for fd in (self._yield_r, self._yield_w, self._wake_r, self._wake_w):
                os.set_blocking(fd, False)
            if hasattr(os, "memfd_create"):
                from unison.channel.arena import Arena

                self.arena = Arena(f"{name}-arena", num_workers, commands=True)
        except BaseException:
            self.close()
            raise
        self._rank_of = {c.fileno(): i for i, c in enumerate(self._replies)}
        self._busy = busy_budget(num_workers + 1)
        crowd.expect(num_workers + 1)  # so many runnable tasks are peers (pacing.crowd.look)
        self._open = list(self._replies)
        self._rx = threading.Lock()
        """Held by whoever reads the reply pipes: recv, settled, or a send that waits for
        room. A recv that waits for it makes a settled let go (``_wait_rx``)."""
        self._backlog: list[tuple[int, bytes | Reply | None]] = []
        """Replies a waiting send read, for the next recv."""
        self._begun = [bytearray() for _ in range(num_workers)]
        """Per worker, the bytes read of replies not yet whole: never waited for, as a worker
        stopped half-way through a reply is a hung worker, to be seen at the deadline."""
        self._large: list[tuple[bytearray | memoryview, memoryview, int] | None] = (
            [None] * num_workers)
        """Per worker, a reply larger than the scratch buffer being read: (its body, the part
        still to read, its progress word)."""
        self._broken: dict[int, str] = {}
        """Workers whose reply pipe held bytes that break the format, and what they were."""
        self._sent = [0] * num_workers
        """Per worker, the frames written to its command pipe."""
        self._extra = [0] * num_workers
        """Per worker, the writes beyond one a frame (frames of over _IOV parts) since it
        last reported having run every frame sent: a bound on the writes it has queued."""
        self._unread = 0
        """Sends since the last drain (_DRAIN_EVERY)."""
        self._progress = [0] * num_workers
        """Per worker, its last progress word: frames run << 1 | whether it holds errors
        nobody fetched (``settled``)."""
        self._scratch = bytearray(_PIPE_SIZE)
        self._scratch_view = memoryview(self._scratch)
        self._poller: select.poll | None = None
        """recv's set of reply and watch fds, made once (multiprocessing's ``wait`` made a
        selector at every call: tens of µs a round at N=8); made again when the fds change."""
        self._settle_poller: select.poll | None = None
        """settled's: the same and the yield pipe."""
        self._reply_set: FdSet | None = None
        """The open reply pipes alone, for the looks that do not wait (``_read_now``,
        ``pending``)."""

    def endpoint(self, rank: int) -> tuple[dict[str, Any], list[int]]:
        cmd_r, rep_w = self._child_fds[rank]
        arena = None if self.arena is None else self.arena.fd
        spec = {"kind": "pipe", "cmd": cmd_r, "reply": rep_w, "arena": arena, "rank": rank,
                "n": len(self._cmd)}
        return spec, [cmd_r, rep_w, *([] if arena is None else [arena])]

    def started(self, watch: Sequence[int] = ()) -> None:
        for pair in self._child_fds:
            for fd in pair:
                _close_fd(fd)
        self._child_fds = []
        self._watch = list(watch)
        self._poller = self._settle_poller = self._reply_set = None

    def send(self, data: bytes, ranks: Sequence[int], buffers: Sequence[Any] = (), *,
             deadline: float | None = None) -> None:
        ranks = tuple(ranks)
        frame, refs = self._frame(data, buffers)
        calls = 1 if len(frame) < _IOV else -(-len(frame) // (_IOV - 1))  # writes it takes
        if deadline is not None:  # (the frame's size only matters to a deadline)
            self._wait_room(ranks, sum(memoryview(p).nbytes for p in frame), calls, deadline)
        if calls > 1:
            for r in ranks:
                self._extra[r] += calls - 1
        if refs:
            assert self.arena is not None  # only the arena's shared arrays give refs
            self.arena.count_sent(refs, ranks)
        written, sent, moving = False, self._sent, stall(deadline)
        try:
            for r in ranks:
                written = self._write(r, frame, moving, written)
                sent[r] += 1
        except BaseException as exc:  # (a signal handler's between two workers: the first
            if written and not own_error(exc):  # got it all, the next nothing)
                raise half_sent(exc, f"the command pipes of workers {list(ranks)}") from exc
            if not written:  # nobody got it: its shared arrays and extra writes never went
                if refs:
                    assert self.arena is not None
                    self.arena.unplace(refs, ranks)
                for r in ranks:
                    self._extra[r] -= calls - 1
            raise
        self._unread += 1
        if self._unread >= _DRAIN_EVERY:
            self._unread = 0
            self._drain()

    def _frame(self, data: bytes, buffers: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """The frame's parts (to write as they are) and the descriptors of the shared
        arrays it names (counted as sent only once the frame is sure to go)."""
        parts: list[Any] = [_HEAD.pack(len(data), len(buffers)), data]
        refs = []
        for pb in buffers:
            raw = pb.raw()
            desc = None if self.arena is None else self.arena.place_shared(raw, ())
            if desc is None:
                parts += [_BUF.pack(_BYTES, raw.nbytes), raw]
            else:
                parts += [_BUF.pack(_BY_REF, _DESC.size), _DESC.pack(*desc)]
                refs.append(desc)
        return parts, refs

    def _wait_room(self, ranks: tuple[int, ...], size: int, calls: int,
                   deadline: float) -> None:
        """Wait until every target pipe surely takes a frame of ``size`` bytes, written in
        ``calls`` writes, at once (when any pipe could): past the deadline, SendTimeout with
        nothing written."""
        pacer = Pacer()
        need = -(-size // _PAGE) + calls - 1  # each write may start a page
        while True:
            full = [r for r in ranks if self._free(r) < need]
            if not full or any(self._slots[r] < need for r in full):
                return  # room everywhere, or a frame no pipe holds: write and see
            self._check_watch()
            left = deadline - time.monotonic()
            if left <= 0:
                raise SendTimeout(
                    f"the command pipes of workers {full} stayed full until the deadline "
                    "(the workers are busy); nothing of this message was sent"
                )
            self._drain()  # a worker blocked on its reply pipe reads no command
            pacer.pause(deadline)

    def _free(self, rank: int) -> int:
        """The pages ``rank``'s command pipe surely has free now (never more than it has):
        one FIONREAD. Its writes still queued are bounded by the frames it has not reported
        as run."""
        queued = _queued(self._cmd[rank])
        if not queued:
            self._extra[rank] = 0  # an empty pipe: every earlier write is gone
            return self._slots[rank]
        left = self._sent[rank] - (self._progress[rank] >> 1)
        if not left:
            self._extra[rank] = 0  # it took every frame: those writes are gone
        return self._slots[rank] - _slots_used(queued, left + self._extra[rank])

    def _write(self, rank: int, frame: list[Any], deadline: Stall | None,
               written: bool) -> bool:
        """Write the whole frame to ``rank``'s pipe, waiting (and watching deaths) while it
        is full. Returns True once anything was written."""
        fd = self._cmd[rank]
        return write_frame(lambda parts: os.writev(fd, parts), frame,
                           f"worker {rank}'s command pipe", deadline, written,
                           self._check_watch, lambda seconds: self._wait_writable(fd, seconds))

    def _wait_writable(self, fd: int, seconds: float) -> None:
        """Wait up to ``seconds`` for room in command pipe ``fd``, a death, or (where no
        recv is reading them) a reply, which is read into the backlog: its worker may be
        blocked writing it, reading no command until it has."""
        replies = [c.fileno() for c in self._open] if self._drain() else []
        poll_fds([*self._watch, *replies], [fd], seconds)

    def _drain(self) -> bool:
        """Read every reply there is now into the backlog, unless a recv is reading (it
        takes them itself); whether this did. Wakes an event loop when the backlog grew."""
        if not self._rx.acquire(blocking=False):
            return False
        try:
            self._keep(self._read_now())
            return True
        finally:
            self._rx.release()

    def _keep(self, got: list[tuple[int, bytes | Reply | None]]) -> None:
        """Replies read by a wait other than recv: into the backlog, for the next recv. Wakes
        an event loop when the backlog grew."""
        if got:
            self._backlog += got
            self.rearm_wake()

    def _check_watch(self) -> None:
        if self._watch and readable(self._watch):
            raise BrokenPipeError("a worker died while its command pipe was full")

    def recv(
        self, timeout: float | None, watch: Sequence[int] | None = None
    ) -> list[tuple[int, bytes | Reply | None]]:
        """See Channel.recv: the backlog first, then wait on the reply pipes and the watch
        fds (``watch``: deprecated, ignored)."""
        if not self._rx.acquire(blocking=False):
            self._wait_rx()
        try:
            if self._backlog or timeout == 0:  # a poll needs no watch: it may come after
                out, self._backlog = self._backlog, []  # the watch fds closed
                return out + self._read_now()
            poller = self._poll_set()
            got = poller.poll(0) or self._await(poller, timeout)
            ready = []
            for fd, events in got:
                if events & select.POLLNVAL:  # a watch fd closed under us: watch it no more
                    self._watch = [w for w in self._watch if w != fd]
                    self._poller = self._settle_poller = self._reply_set = None
                else:
                    ready.append(fd)
            return self._read_ready(ready)
        finally:
            self._rx.release()

    def _wait_rx(self) -> None:
        """Take the rx lock for recv, which another thread holds. Where that is settled,
        waiting for progress reports, it sees the yield pipe readable and lets go (it returns
        False, and its sync asks instead): so a thread waiting for its replies never waits for
        another's sync. A byte left behind where the holder was not settled makes the next
        settled ask once."""
        try:
            os.write(self._yield_w, b"x")
        except (BlockingIOError, OSError):
            pass  # it is readable already (or closed: close() is under way)
        self._rx.acquire()

    def _await(self, poller: select.poll, timeout: float | None) -> list[tuple[int, int]]:
        """What ``poller`` finds readable within ``timeout`` (None: no limit): a reply is
        often a few µs away, so yield the core, looking, for up to SPIN, then sleep in poll."""
        found = spin(poller.poll, SPIN if timeout is None else min(SPIN, timeout), self._busy, 0)
        if isinstance(found, list):
            return found
        return poller.poll(poll_ms(timeout))

    def _poll_set(self) -> select.poll:
        """The reply pipes and the watch fds, in one poll set made once (caller holds the rx
        lock)."""
        if self._poller is None:
            self._poller = _poll_of([*(c.fileno() for c in self._open), *self._watch])
        return self._poller

    def _replies_set(self) -> FdSet:
        """The open reply pipes, in one poll set made once (again when they change)."""
        # (checked against the open pipes: pending() builds it without the lock, and may race
        # _end's reset)
        got = self._reply_set = reuse(self._reply_set, [c.fileno() for c in self._open])
        return got

    def _settle_set(self) -> select.poll:
        """settled's poll set: recv's, and the yield pipe."""
        if self._settle_poller is None:
            self._settle_poller = _poll_of(
                [*(c.fileno() for c in self._open), *self._watch, self._yield_r])
        return self._settle_poller

    # -- progress: sync without a message, where the reports are in -------------------------

    settles = True

    def settled(self, ranks: Sequence[int], timeout: float) -> bool:
        """Channel.settled, from the progress reports in the reply streams: each worker in
        ``ranks`` has run every frame sent to it and holds no error nobody fetched. Waits
        for the reports up to ``timeout``, reading the reply pipes (replies found go to the
        backlog), only where no other thread reads them, and only until one wants to
        (``_wait_rx``): False tells nothing more, and the caller asks (SYNC). A watch fd
        readable, or a worker's end closed: False, so that the caller's long way notices
        the death. A wait that gave up after 2 ms (and sent SYNC) made dispatch beside two
        CPU hogs take 2.2 ms a round in whole blocks at N=8, against ~0.1 ms without the
        limit (docs/benchmarks.md, "Issue 9, thirty-second pass")."""
        if not self._rx.acquire(blocking=False):
            return False
        try:
            poller = self._settle_set()
            end = time.perf_counter() + timeout
            got = poller.poll(0)
            while True:
                if got:
                    ready = [fd for fd, _ in got]
                    if any(fd not in self._rank_of for fd in ready):
                        if self._yield_r in ready:
                            drain_fd(self._yield_r)
                        return False  # a recv wants the pipes, or a death: the long way
                    replies = self._read_ready(ready)
                    self._keep(replies)
                    if any(data is None for _, data in replies):
                        return False
                looked = reported(self._sent, self._progress, ranks)
                if looked:
                    return looked == 1
                left = end - time.perf_counter()
                if left <= 0:
                    return False
                got = self._await(poller, left)
        except (OSError, ValueError):  # close() from another thread (it does not wait for
            return False  # this lock): the long way says the session is closed
        finally:
            self._rx.release()

    def holding(self, ranks: Sequence[int]) -> list[int]:
        """Channel.holding: as of each worker's last reply or report read."""
        return held(self._progress, ranks)

    def _read_now(self) -> list[tuple[int, bytes | Reply | None]]:
        """The whole replies the reply pipes hold now, without waiting; caller holds the rx
        lock."""
        if not self._open:
            return []
        got = self._replies_set().readable()
        return self._read_ready(got) if got else []

    def _read_ready(self, ready: list[int]) -> list[tuple[int, bytes | Reply | None]]:
        """The whole replies in the reply pipes of ``ready`` (watch fds skipped), in order;
        caller holds the rx lock."""
        out: list[tuple[int, bytes | Reply | None]] = []
        for fd in ready:
            rank = self._rank_of.get(fd)
            if rank is None:
                continue  # a watch fd: the caller looks at the deaths
            conn = self._replies[rank]
            if conn not in self._open:
                continue  # closed under us (close() from another thread)
            self._read_from(rank, conn, out)
        return out

    def _read_from(self, rank: int, conn: Connection,
                   out: list[tuple[int, bytes | Reply | None]]) -> None:
        """Read all that ``rank``'s reply pipe holds now (without blocking): its whole replies
        to ``out``, the start of one still being written kept for the next read, and
        ``(rank, None)`` once the worker's end is closed."""
        begun, scratch, view = self._begun[rank], self._scratch, self._scratch_view
        while True:
            large = self._large[rank]
            try:  # a large reply's body is read straight into place; the rest into scratch
                n = os.readv(conn.fileno(), [scratch if large is None else large[1]])
            except BlockingIOError:
                return
            except OSError:
                n = 0
            if not n:  # the worker is gone, and any reply it had begun with it
                self._end(rank, conn, out)
                return
            if large is not None:
                if n == large[1].nbytes:
                    out.append((rank, bytes(large[0])))
                    self._progress[rank] = large[2]
                    self._large[rank] = None
                else:
                    self._large[rank] = (large[0], large[1][n:], large[2])
                continue
            word, progress = _REPLY.unpack_from(scratch) if n >= _REPLY.size else (0, 0)
            if not begun and word == (n - _REPLY.size) | _TAG:  # one whole reply: the usual
                out.append((rank, bytes(view[_REPLY.size:n])))
                self._progress[rank] = progress
            elif not begun and word == _REPORT and n == _REPLY.size:  # one report: dispatch's
                self._progress[rank] = progress
            else:
                begun += view[:n]
                problem = self._frames(rank, begun, out)
                if problem:
                    self._broken[rank] = (
                        f"its reply pipe held bytes that break the format ({problem}): code "
                        "on that worker wrote to the file descriptor unison replies through; "
                        "have it write to files it opened itself, or to sys.stdout")
                    self._end(rank, conn, out)
                    return
            if n < len(scratch):
                return  # the pipe is empty: a read takes all it holds, up to its size

    def _end(self, rank: int, conn: Connection,
             out: list[tuple[int, bytes | Reply | None]]) -> None:
        """``rank``'s stream ended (closed, or broken): ``(rank, None)``, once, after the
        whole replies before; the rest is dropped unread."""
        self._begun[rank].clear()
        self._large[rank] = None
        if conn in self._open:  # (close() may have emptied it meanwhile)
            self._open.remove(conn)
        self._poller = self._settle_poller = self._reply_set = None
        out.append((rank, None))

    def _frames(self, rank: int, begun: bytearray,
                out: list[tuple[int, bytes | Reply | None]]) -> str:
        """The whole replies in ``begun`` to ``out``; a large one begun there goes on being
        read into a buffer of its size. What breaks the format at the next frame, if any
        (nothing of it or after it taken)."""
        at = 0
        with memoryview(begun) as mv:
            while len(begun) - at >= _REPLY.size:
                word, progress = _REPLY.unpack_from(begun, at)
                size = word & _SIZE
                if word == _REPORT:
                    self._progress[rank] = progress
                    at += _REPLY.size
                    continue
                if word & ~_SIZE != _TAG or size > _MAX_REPLY:
                    return f"{word:#018x} where a reply's tagged length should be"
                end = at + _REPLY.size + size
                if len(begun) < end:
                    if size > len(self._scratch):
                        body = receive_buffer(size)
                        have = len(begun) - at - _REPLY.size
                        body[:have] = mv[at + _REPLY.size :]
                        self._large[rank] = (body, memoryview(body)[have:], progress)
                        at = len(begun)
                    break
                out.append((rank, bytes(mv[at + _REPLY.size : end])))
                self._progress[rank] = progress
                at = end
        del begun[:at]
        return ""

    def ended(self) -> int | None:
        """A worker whose reply pipe held bytes that break the format (its stream ended)."""
        return next(iter(self._broken), None)

    def where(self, rank: int) -> str:
        return self._broken.get(rank, "")

    def wake_fds(self) -> list[int]:
        """The reply pipes (readable with a reply) and the backlog's wake pipe."""
        return [*(c.fileno() for c in self._open), self._wake_r]

    def pending(self) -> bool:
        """Channel.pending; False once closed, by another thread too, in the middle of
        the look (an await's spin looks without the router's lock)."""
        try:
            return bool(self._backlog) or (
                bool(self._open) and bool(self._replies_set().readable()))
        except (OSError, ValueError):  # a connection closed meanwhile
            if self._closed:
                return False
            raise

    def clear_wake(self) -> None:
        drain_fd(self._wake_r)

    def rearm_wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # full (readable already), or closed (-1)
            pass

    def close(self) -> None:
        self._closed = True
        for fd in self._cmd:
            _close_fd(fd)
        self._cmd = []
        for conn in self._replies:
            try:
                conn.close()
            except OSError:
                pass  # already closed by its own finalizer (garbage collection of a cycle)
        self._open = []
        for name in ("_wake_r", "_wake_w", "_yield_r", "_yield_w"):
            fd = getattr(self, name, -1)  # (not made yet where __init__ failed)
            if fd >= 0:
                _close_fd(fd)
        self._wake_r = self._wake_w = self._yield_r = self._yield_w = -1
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.started()


class PipeWorkerChannel(WorkerChannel):
    def __init__(self, spec: dict[str, Any]) -> None:
        self._cmd = spec["cmd"]
        self._reply: int = spec["reply"]
        self._arena = None
        if spec.get("arena") is not None:
            from unison.channel.arena import ArenaReader

            self._arena = ArenaReader(spec["arena"], spec["rank"], spec["n"])
        self._busy = busy_budget(spec["n"] + 1)  # as the shm worker's wait
        crowd.expect(spec["n"] + 1)  # so many runnable tasks are peers (pacing.crowd.look)
        self._fresh = True
        self._have = bytearray()
        """Bytes read ahead of the frame being read."""
        self._scratch = bytearray(_PIPE_SIZE)
        self._scratch_view = memoryview(self._scratch)
        self._poll = select.poll()
        self._poll.register(self._cmd, select.POLLIN)
        self._taken = 0
        """Frames recv returned: each is run by the time the next is asked for."""
        self._holding = 0
        """1 while this worker holds errors nobody fetched (``unreported``), else 0."""
        self._told = 0
        """The progress word the controller last got: frames run << 1 | holding."""

    def recv(self) -> tuple[memoryview, list[Any]] | None:
        """The next frame, read from the pipe by this thread; None once the controller is
        gone. Before it waits for one, it reports its progress if that changed since the
        last reply or report: the controller's sync reads it instead of asking."""
        try:
            if self._fresh:  # the wait for the session's first command spans the other
                self._fresh = False  # workers' start, which no later wait should take for a
                self._poll.poll()  # crowd (pacing.crowd.forget)
                crowd.forget()
            if not self._have:
                if not self._poll.poll(0):  # the next command is often a few µs away:
                    progress = self._taken << 1 | self._holding
                    if progress != self._told:  # everything taken has run: say so
                        os.write(self._reply, _REPLY.pack(_REPORT, progress))
                        self._told = progress
                    spin(self._poll.poll, SPIN, self._busy, 0)  # yield, then sleep in the read
                k = os.readv(self._cmd, [self._scratch])  # all there is, up to its size: a
                if not k:  # frame's head and body, and the frames behind it, in one call
                    return None
                self._have += self._scratch_view[:k]
            n, count = _HEAD.unpack(self._read(_HEAD.size))
            data = memoryview(self._read(n))
            bufs: list[Any] = []
            by_ref: list[int] = []
            for _ in range(count):
                kind, size = _BUF.unpack(self._read(_BUF.size))
                got = self._read(size)
                if kind == _BY_REF and self._arena is not None:
                    by_ref.append(len(bufs))
                    bufs.append(_DESC.unpack(got))
                else:
                    bufs.append(memoryview(got))
            if by_ref:  # mapped once the frame is read whole: a failure leaves us in step
                from unison.channel.arena import Unmapped  # (imported with ArenaReader)

                assert self._arena is not None
                views = self._arena.views([bufs[i] for i in by_ref])
                if isinstance(views, Unmapped):
                    bufs = views  # the command fails, not the worker
                else:
                    for i, view in zip(by_ref, views):
                        bufs[i] = view
        except EOFError:
            return None
        except OSError as exc:  # a closed fd of ours: worker code's doing, not the controller's
            if exc.errno == errno.EBADF:
                fd, what = ((self._cmd, "the command pipe") if _closed(self._cmd)
                            else (self._reply, "the reply pipe"))
                raise meddled(exc, fd, what) from None
            return None
        self._taken += 1
        return data, bufs

    def _read(self, n: int) -> bytearray | memoryview:
        """Exactly ``n`` bytes: first those read ahead, then the pipe's."""
        have = self._have
        if len(have) >= n:
            ahead = have[:n]
            del have[:n]
            return ahead
        buf = receive_buffer(n)
        view = memoryview(buf)
        got = len(have)
        view[:got] = have
        have.clear()
        while got < n:
            k = os.readv(self._cmd, [view[got:]])
            if not k:
                raise EOFError
            got += k
        return buf

    def reply(self, data: bytes, buffers: Sequence[Any] = ()) -> None:
        """A reply is the last thing its frame does (worker.serve), so it reports that frame
        as run, with whether this worker holds errors nobody fetched."""
        if buffers:
            raise ValueError("the pipe channel pickles replies in band")
        self._told = progress = self._taken << 1 | self._holding
        head, fd = _REPLY.pack(len(data) | _TAG, progress), self._reply
        try:
            if len(data) <= _ATOMIC:  # the usual: one write, whole (a blocking pipe takes it)
                os.write(fd, head + data)
                return
            write_frame(lambda parts: os.writev(fd, parts), [head, data],  # blocking: waits
                        "the controller's reply pipe", None, False, _idle, _idle)  # for room
        except OSError as exc:
            if exc.errno == errno.EBADF:
                raise meddled(exc, fd, "the reply pipe") from None
            raise

    def unreported(self, count: int) -> None:
        self._holding = 1 if count else 0  # told with the next reply or report

    def close(self) -> None:
        if self._reply >= 0:
            _close_fd(self._reply)
            self._reply = -1


def _closed(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return True
    return False


def _poll_of(fds: list[int]) -> select.poll:
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return poller


def _idle(*_: object) -> None:
    """write_frame's death check and wait, on a blocking pipe, where it needs neither."""


def _grow(fd: int) -> None:
    """Ask for a larger pipe buffer, so that fewer sends wait; the default is fine too."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
    except (OSError, AttributeError):
        pass


def _capacity(fd: int) -> int:
    try:
        return int(fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ))
    except (OSError, AttributeError):
        return 1 << 16


def _queued(fd: int) -> int:
    """Bytes a pipe holds."""
    return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])


def _slots_used(queued: int, writes: int) -> int:
    """At most how many page slots a pipe holding ``queued`` bytes (> 0) uses, where they
    came in at most ``writes`` writes. Bytes alone understate it: a write takes a new page
    unless its start (its size modulo a page) fits the last page's rest, so 240 frames of
    3 KB filled 240 of a 1 MiB pipe's 256 pages with 720 KiB, and an 80 KB frame went in
    half. Two bounds: past the page being read, two neighbours hold over a page together
    (a page begun by a write that did not fit the one before); and every page but the one
    being read is full except the last of a write."""
    return min(2 * (queued // (_PAGE + 1)) + 2, queued // _PAGE + 1 + writes)


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
