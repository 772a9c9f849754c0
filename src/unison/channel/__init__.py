"""How bytes travel between the controller and its workers.

    controller                 channel                      worker i
    Session --send(msg, ranks)--> one message, read by -->  WorkerChannel.recv()
    Session <----recv()---------- replies, in order   <--  WorkerChannel.reply(data)

A channel moves opaque messages; it knows nothing of calls or Refs. The controller writes
each message once for any number of workers (a channel may fan it out or share it). Replies
from one worker arrive in the order it sent them. A channel never waits without also
watching the fds it was given once, at ``started`` (the workers' pidfds), so a dead peer
can never hang a wait.

A message may carry out-of-band buffers (pickle protocol 5): the channel moves them as it
sees fit, and the worker gets them back as memoryviews, in order, beside the payload. A
buffer that lies in a shared array (``sess.empty``) always travels by reference, so the
workers write the controller's memory. Replies may carry buffers too (where the channel
says ``oob_replies``): the controller then gets a ``Reply`` of the pickle and its buffers.

Sending may be bounded by a deadline (``time.monotonic()``): ``SendTimeout`` (a TimeoutError)
then means that no part of the message reached any worker; ``PartialSendError`` that the
deadline passed with the message half written, after which the channel is unusable and the
session must close. Any other exception that ends a send half-way (a signal handler's) is a
``PartialSendError`` too, with it as its cause.

Backends: ``shm`` (shared-memory rings and an arena for buffers, the fast one, Linux, up to
64 workers) and ``pipe`` (portable, one pipe pair per worker). ``auto`` picks shm where it
can. The worker process finds its end through ``connect(spec)`` with the spec the
controller's channel gave the launcher.
"""

from __future__ import annotations

import mmap
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from unison import _native

if TYPE_CHECKING:
    from unison.channel.arena import Arena

__all__ = ["Channel", "PartialSendError", "Reply", "SendTimeout", "WorkerChannel", "connect",
           "create"]


MAX_BUFFERS = 8192
"""Out-of-band buffers one message may carry. The receiving process maps each one apart,
and Linux allows a process about 65,000 mappings (``vm.max_map_count``): past them a worker
died, or the controller took its own ENOMEM for a worker's broken reply. ``protocol.dumps``
keeps the rest in band (a copy), and refuses a view of a ``sess.empty`` array past them (it
must go by reference); a message of more is refused (``too_many_buffers``)."""


def too_many_buffers(count: int) -> ValueError:
    return ValueError(
        f"a message may carry at most {MAX_BUFFERS:,} views of sess.empty arrays and large "
        f"arrays out of band, and this one holds {count:,} or more: nothing was sent. Pass "
        "fewer, larger views (a whole sess.empty array rather than a list of its rows)"
    )


class Reply(NamedTuple):
    """A reply with out-of-band buffers: ``protocol.loads`` takes it as it is. Its buffers
    map shared memory that the worker will not reuse until they are garbage."""

    data: bytes | memoryview
    buffers: list[memoryview]


class PartialSendError(RuntimeError):
    """A send ended with part of the message written (its deadline passed, or an exception
    came from elsewhere, a signal handler's, with its cause set to it): the stream to a
    worker is broken for good, so the session must close."""


class SendTimeout(TimeoutError):
    """A send's deadline passed with nothing of the message written: the channel's own, told
    apart from any other TimeoutError (a signal handler's may end a send half-way)."""


class Channel(ABC):
    """The controller's end. Used from several threads: send() and recv() are each called
    under the session's own lock for that direction.

    What a channel can do beyond moving messages is said by its attributes, never found by
    probing: ``arena`` (shared arrays, ``sess.empty``)."""

    arena: Arena | None = None
    """The shared arena that ``sess.empty`` allocates in (buffers in it travel by
    reference, so workers write the controller's memory), or None where the channel has
    none; then ``sess.empty`` is not available."""

    tracks_progress = False
    """Whether workers publish how far through the messages they have run, and whether they
    hold errors nobody fetched: then ``sync`` is a wait on ``progress``, with no message and
    no reply (else it sends SYNC and waits for the answers)."""

    wakes_at_deaths = False
    """Whether its waits wake at a joined worker's death whatever the launcher watches (TCP:
    the connection closes, or the heartbeat goes unanswered; mixed: besides, the local
    workers' pidfds): the session's waits then sleep a long slice, as they do where the
    launcher gives pidfds, not a 50 ms one (a controller waiting on TCP workers used 0.73%
    of a core: python benchmarks/waiting_cpu.py; an audit of idle CPU, issue 9,
    forty-eighth pass)."""

    settles = False
    """Whether ``settled`` can tell, without a message, that workers ran everything sent
    and hold no error, where the channel does not track progress otherwise: the pipe and
    TCP channels' workers report in their reply streams, which only the reader of the
    moment sees, so it waits for them only while no other thread reads, and ``wait_done``
    is not there (sync sends SYNC where ``settled`` says no)."""

    def mark(self) -> int:
        """A position covering every message sent so far (where ``tracks_progress``)."""
        raise NotImplementedError

    def wait_done(self, ranks: Sequence[int], mark: int, timeout: float) -> bool:
        """Wait up to ``timeout`` until every worker in ``ranks`` has run every message up to
        ``mark``; whether they have. Returns early, False, when a watched fd is readable
        (a death): the caller looks, then waits again. Workers that were done before the
        wait began: False as well if a watched fd is readable, so that a wait with nothing
        to wait for still notices a death."""
        raise NotImplementedError

    def unreported(self, ranks: Sequence[int]) -> bool:
        """Whether a worker in ``ranks`` holds errors nobody fetched (read after
        ``wait_done``: it covers everything up to the mark)."""
        raise NotImplementedError

    def holding(self, ranks: Sequence[int]) -> list[int]:
        """The workers in ``ranks`` known to hold errors nobody fetched, as far as the
        controller has heard now, without a message (shm's words; the pipe and TCP
        channels' last progress reports): for close, to ask them for those errors or say
        they were lost. [] where the channel cannot tell."""
        return []

    def settled(self, ranks: Sequence[int], timeout: float) -> bool:
        """``wait_done`` for everything sent so far, then ``not unreported``, in one call
        (sync's usual case): True when the workers in ``ranks`` ran it all within
        ``timeout`` and hold no error nobody fetched. False tells nothing more: the caller
        goes the long way (where ``tracks_progress`` or ``settles``), as it does where
        another thread closed the channel, before or during the call."""
        raise NotImplementedError

    @abstractmethod
    def endpoint(self, rank: int) -> tuple[dict[str, Any], list[int]]:
        """What worker ``rank`` needs to connect: a picklable spec and fds it must inherit."""

    @abstractmethod
    def started(self, watch: Sequence[int] = ()) -> None:
        """The workers are up: drop the controller's copies of their fds, and from now on
        treat a readable fd in ``watch`` (a worker's pidfd) as a death while waiting: a
        waiting ``recv`` returns at once, a send raises OSError. The only place the fds to
        watch are given. They must stay open while a send or a ``recv`` with a non-zero
        timeout may run (until ``close()``, or ``started(())``); a poll, ``recv(0.0)``,
        does not look at them, so it may drain replies after they are closed."""

    @abstractmethod
    def send(self, data: bytes, ranks: Sequence[int], buffers: Sequence[Any] = (), *,
             deadline: float | None = None) -> None:
        """Deliver one message, with its out-of-band buffers (PickleBuffers), to each worker
        in ``ranks`` (ascending). Raises OSError if a worker is gone; MemoryError, with
        nothing sent, if shared memory is full; past ``deadline`` (time.monotonic()),
        SendTimeout with nothing sent, or PartialSendError if that could not be helped (as
        for any other exception that ends it half-way)."""

    def send_plain(self, data: bytes, ranks: tuple[int, ...]) -> bool:
        """``send(data, ranks)`` of a message with no buffers and no deadline, in one call
        where the channel can: True once sent; False where nothing was sent, and the caller
        then calls ``send``. The session's quick send uses it (the shm channel's is its C
        ring's: a round trip at N=2 saved the frame of ``send``)."""
        self.send(data, ranks)
        return True

    @abstractmethod
    def recv(
        self, timeout: float | None, watch: Sequence[int] | None = None
    ) -> list[tuple[int, bytes | Reply | None]]:
        """Replies available now, waiting up to ``timeout`` for the first one.

        Returns ``(rank, data)`` pairs, with ``data=None`` once a worker's stream has ended;
        ``data`` is a ``Reply`` when the reply has out-of-band buffers.
        Returns early, possibly empty, when one of the fds given to ``started`` is readable.

        ``watch`` is deprecated and ignored (the fds come from ``started``): it is accepted
        for one transition only, so that callers written against the old signature work.
        """

    def plain_values(self, ranks: tuple[int, ...], req_id: int,
                     timeout: float) -> list[Any] | None:
        """run's usual replies in one step, where the channel can (the router's quick path;
        its caller holds the recv lock, and knows the next reply of each rank is
        ``req_id``'s). Once every rank's next reply is in, within a short wait of at most
        ``timeout``, and each is a plain OK one for ``req_id``: their values in ``ranks``
        order, read. Else None, with nothing read: ``recv`` then delivers them. Here:
        always None."""
        return None

    linger = 0.0
    """At close, how long to wait for the workers to hang up first (set by the session from
    close()'s grace; only a channel whose workers hold a connection of their own uses it)."""

    def ended(self) -> int | None:
        """A worker whose stream the channel knows has ended, where it can tell better than
        the launcher (a TCP connection); else None."""
        return None

    def where(self, rank: int) -> str:
        """Where worker ``rank`` is, and how its stream ended, for a WorkerDied ("" where
        the launcher says it all)."""
        return ""

    def was_idle(self, rank: int) -> bool:
        """Whether worker ``rank``, now ended, had run everything it had taken, so that it
        died between calls, not in one (a WorkerDied says so). False where the channel
        cannot tell: the message then names only what the controller was doing."""
        return False

    def death_fds(self) -> list[int]:
        """Fds, beyond the launcher's, that become readable when a worker ends (a mixed
        session's local workers' pidfds, watched once they joined): an event loop watches
        them too, or such a death would wake nothing."""
        return []

    def wake_fds(self) -> list[int]:
        """Fds an event loop watches for replies (``loop.add_reader``): each becomes
        readable when a reply may be waiting, while ``async_waiting(True)``; then
        ``clear_wake()`` and ``recv(0.0)``."""
        raise NotImplementedError

    def pending(self) -> bool:
        """Whether a reply is waiting to be read: a cheap look, for polling. False once
        closed, even where another thread closes it in the middle of the look."""
        raise NotImplementedError

    def async_waiting(self, on: bool) -> None:
        """Whether an event loop waits on ``wake_fds``: then every reply must make one
        readable, not only those a sleeping ``recv`` waits for. (A pipe always is.)"""
        return None

    def clear_wake(self) -> None:
        """Reset the wake fds after they were readable (before reading the replies)."""
        return None

    def rearm_wake(self) -> None:
        """Make a wake fd readable, so that the event loop polls once more: a thread that
        read while the loop's poll was turned away may have emptied them without reading
        the loop's replies. Nothing once closed."""
        raise NotImplementedError

    @abstractmethod
    def close(self) -> None:
        """Release every resource; idempotent."""


class WorkerChannel(ABC):
    """A worker's end: one reader of commands, one writer of replies."""

    @abstractmethod
    def recv(self) -> tuple[bytes | memoryview, list[Any]] | None:
        """The next message for this worker and its buffers, or None once the controller is
        gone."""

    oob_replies = False
    """Whether ``reply`` takes out-of-band buffers (else pickle replies in band)."""

    @abstractmethod
    def reply(self, data: bytes, buffers: Sequence[Any] = ()) -> None:
        """Send one reply to the controller, with its out-of-band buffers (PickleBuffers)
        where ``oob_replies``. Raises MemoryError, with nothing sent, if they do not fit."""

    def ack(self) -> None:
        """Reply "done, nothing to report": the controller reads it as an empty reply."""
        self.reply(b"")

    def reply_plain(self, msg: tuple[Any, ...], version: int) -> bool:
        """Send ``reply(marshal.dumps(msg, version))`` in one step where this channel can
        (the shm channel's C ring: a worker's hot path); False, with nothing sent, where
        it cannot: then the caller sends it with ``reply``."""
        return False

    def unreported(self, count: int) -> None:
        """This worker now holds ``count`` errors nobody fetched (where the controller's end
        ``tracks_progress``, it reads this instead of asking). Others need not hear it."""
        return None

    def on_idle(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` now and then while this worker waits for its next command, between
        commands: at each of the controller's heartbeats on TCP (tcp.HEARTBEAT_S), each
        ``IDLE_S`` of sleep on shared memory. A cluster's collectives then tell the peers
        which call this worker ended (unison.collective.cluster). The pipe channel need
        not: its sessions have no such backend."""
        return None

    @abstractmethod
    def close(self) -> None: ...


IDLE_S = 0.25
"""How often a worker waiting for its next command runs its ``on_idle`` hook at least (a
TCP worker: at each of the controller's heartbeats, tcp.HEARTBEAT_S, this long)."""

_IOV = 512
"""Buffers per writev/sendmsg call (IOV_MAX is 1024 on Linux)."""


class Stall:
    """A send's deadline that moves with its progress, one per message: each part a worker
    takes moves it to that moment plus the time the send was given. So a large message
    that keeps moving never times out (a 1 GiB put with ``send_timeout=0.2`` closed the
    session after 0.2 s while the worker read at full speed, as did a pause of the
    controller mid-frame; an audit of pauses, issue 9, forty-ninth pass), and one that
    stops moving for that long does."""

    __slots__ = ("at", "span")

    def __init__(self, deadline: float) -> None:
        self.at = deadline
        self.span = max(0.0, deadline - time.monotonic())

    def moved(self) -> None:
        self.at = max(self.at, time.monotonic() + self.span)


def stall(deadline: float | None) -> Stall | None:
    return None if deadline is None else Stall(deadline)


_MAPPED_FROM = 16 << 20
"""Buffers from this size are received into mapped pages (``receive_buffer``); below it,
malloc's reused memory is quicker (a put of 1 MiB through a pipe read 0.26 GB/s a worker
into mapped pages, 0.33-0.36 into a bytearray: `python benchmarks/run.py --workers 2
--only put --systems unison-pipe,unison-tcp`)."""


def receive_buffer(n: int) -> bytearray | memoryview:
    """A buffer to read ``n`` bytes of a stream into: a bytearray, or for a large one
    anonymous mapped pages, which the kernel zeroes as the read reaches them. bytearray(n)
    first writes n zeros: for 256 MiB, 0.3 s in which the stream was not read (a sender's
    ``send_timeout`` then ran out), then the read's copy; mapped, the read alone, 0.4 s (a
    put of 64 MiB: 0.22-0.30 GB/s a worker through a pipe before, 0.37-0.38 now; over TCP
    0.33, now 0.41-0.46)."""
    if n < _MAPPED_FROM:
        return bytearray(n)
    # private: a child the worker's code forks gets a copy, as of a bytearray's pages
    return memoryview(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


def write_frame(send: Callable[[list[memoryview]], int], frame: Sequence[Any], what: str,
                deadline: Stall | None, written: bool, check_watch: Callable[[], object],
                wait: Callable[[float], object]) -> bool:
    """Write a whole frame to one worker through a stream: ``send`` (a non-blocking
    writev or sendmsg) writes what it can of the parts, or raises BlockingIOError. While
    the stream is full: ``check_watch()`` (raises on a death), then ``wait(seconds)`` for
    room. ``written``: whether another worker got this message already; past ``deadline``
    (which each part written moves: Stall) that makes it a PartialSendError (the stream is
    out of step for good), else a SendTimeout with nothing of it sent. Any other exception
    that ends it once something of the message may have gone (KeyboardInterrupt, a signal
    handler's in the wait) becomes a PartialSendError too, with it as its cause: passed on
    as it is, the caller would take the stream for whole. Returns whether anything was
    written. ``what`` names the stream in those errors ("worker 3's command pipe")."""
    parts = [v for v in (memoryview(p).cast("B") for p in frame) if v.nbytes]
    sending = False  # a send whose count is not taken yet: it may have written
    try:
        while parts:
            sending = True
            try:
                n = send(parts[:_IOV])
            except BlockingIOError:
                n = 0
            written = written or n > 0
            sending = False
            if n:
                while n and n >= parts[0].nbytes:
                    n -= parts.pop(0).nbytes
                if n:
                    parts[0] = parts[0][n:]
                if deadline is not None:
                    deadline.moved()
                continue
            check_watch()
            left = None if deadline is None else deadline.at - time.monotonic()
            if left is not None and left <= 0:
                if written:
                    raise PartialSendError(
                        f"the deadline passed while a message was half sent to {what}; the "
                        "channel cannot be used any more: close the session")
                raise SendTimeout(f"{what} stayed full until the deadline; nothing of this "
                                  "message was sent: wait for the workers (sync), or close "
                                  "the session")
            wait(1.0 if left is None else min(1.0, left))
    except BaseException as exc:
        if (written or sending) and not own_error(exc):
            raise half_sent(exc, what) from exc
        raise
    return written


def meddled(exc: OSError, fd: int, what: str) -> OSError:
    """A worker's error for one of unison's descriptors that worker code closed or replaced
    (``exc`` from using it): the worker ends, saying so, where it would pass for a lost
    controller or a bare EBADF."""
    return OSError(exc.errno, f"{exc.strerror}: worker code closed or replaced unison's "
                   f"descriptor {fd} ({what}); leave alone the descriptors it did not open "
                   "(no os.closerange or os.dup2 over them)")


def own_error(exc: BaseException) -> bool:
    """Whether ``exc``, ending a send, is the channel's own say: its deadline's (SendTimeout,
    PartialSendError), or its stream's OSError (a death, for which the session closes).
    Any other comes from elsewhere (a signal handler's, a TimeoutError too)."""
    return isinstance(exc, (SendTimeout, PartialSendError)) or (
        isinstance(exc, OSError) and not isinstance(exc, TimeoutError))


def half_sent(exc: BaseException, what: str) -> PartialSendError:
    """The PartialSendError of a send that ``exc`` (not the channel's own) ended with part
    of the message written to ``what``; its cause is set by the caller."""
    return PartialSendError(
        f"{type(exc).__name__} ended a send with the message half sent to {what}; the "
        "channel cannot be used any more: close the session")


def reported(sent: list[int], progress: list[int], ranks: Sequence[int]) -> int:
    """What the progress words in the reply streams (the pipe and TCP channels') say of
    ``ranks``: 0 while a worker has not reported every command sent to it as run; else 1,
    or 2 where one holds errors nobody fetched. A word is commands run << 1 | holding."""
    for r in ranks:
        if progress[r] != sent[r] << 1:
            return 0 if progress[r] >> 1 != sent[r] else 2
    return 1


def held(progress: list[int], ranks: Sequence[int]) -> list[int]:
    """The workers of ``ranks`` whose last progress word (as ``reported`` reads it) says
    they hold errors nobody fetched: Channel.holding of the pipe and TCP channels."""
    return [r for r in ranks if progress[r] & 1]


def drain_fd(fd: int) -> None:
    """Empty a non-blocking wake pipe: read until nothing is left (or it is closed)."""
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass


def create(kind: str, num_workers: int, session_name: str) -> Channel:
    if kind == "auto":
        kind = "shm" if shm_ok(num_workers) else "pipe"
    if kind == "shm":
        why = shm_refused(num_workers)
        if why:
            raise ValueError(f"channel='shm' cannot run here: {why}. Use channel='auto' "
                             "(which picks 'pipe' here) or channel='pipe'")
        from unison.channel.shm import ShmChannel

        return ShmChannel(num_workers, session_name)
    if kind == "pipe":
        from unison.channel.pipe import PipeChannel

        return PipeChannel(num_workers, session_name)
    raise ValueError(f"unknown channel {kind!r}: use 'auto', 'shm' or 'pipe'")


def shm_refused(num_workers: int) -> str:
    """Why the shared-memory channel does not work here for ``num_workers`` ("" where it
    does)."""
    import os

    if num_workers > 64:
        return f"it carries at most 64 workers on a host, not {num_workers}"
    if not (hasattr(os, "memfd_create") and hasattr(os, "eventfd")):
        return "this platform lacks memfd_create or eventfd (see README, Platforms)"
    if not _native.ordered_memory():
        return _native.unordered_why("the shared-memory channel")
    return ""


def shm_ok(num_workers: int) -> bool:
    """Whether the shared-memory channel works here for ``num_workers``."""
    return not shm_refused(num_workers)


def connect(spec: dict[str, Any]) -> WorkerChannel:
    if spec["kind"] == "shm":
        from unison.channel.shm import ShmWorkerChannel

        return ShmWorkerChannel(spec)
    if spec["kind"] == "pipe":
        from unison.channel.pipe import PipeWorkerChannel

        return PipeWorkerChannel(spec)
    raise ValueError(f"unknown channel spec {spec['kind']!r}")
