"""The channel layer below the Session, in one process: both ends of a channel, the rings'
arithmetic, the arena's blocks and the pacing of waits. No worker process is started, so
these run in milliseconds and fail close to the cause.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import os
import pickle
import random
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from support import held_elsewhere, join_tcp, raising_on_signal
from unison import pacing, protocol
from unison.channel import Channel, Reply
from unison.channel import shm as shm_channel
from unison.channel.arena import MIN_BLOCK, Arena, ArenaReader, create_file
from unison.channel.pipe import PipeChannel, PipeWorkerChannel
from unison.channel.ring import Ring
from unison.channel.shm import ShmChannel, ShmWorkerChannel

_NAME = f"unison-test-unit-{os.getpid()}"


@pytest.fixture(autouse=True)
def no_cpu_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    """The crowd's rules as on a machine without a cgroup CPU quota (tests/test_cgroup.py has
    them with one), whatever the machine running the tests has."""
    monkeypatch.setattr(pacing, "_throttles", lambda: None)


@pytest.fixture
def shm_pair() -> Iterator[tuple[ShmChannel, list[ShmWorkerChannel]]]:
    """A controller end and both workers' ends of a two-worker shm channel, all here."""
    chan = ShmChannel(2, _NAME)
    workers = [ShmWorkerChannel(chan.endpoint(r)[0]) for r in range(2)]
    yield chan, workers
    workers.clear()
    chan.close()
    gc.collect()


def _payload(i: int, n: int) -> bytes:
    return (i.to_bytes(4, "little") * (n // 4 + 1))[:n]


def test_a_chunked_reply_arriving_in_parts_is_joined_before_later_replies(
    shm_pair: tuple[ShmChannel, list[ShmWorkerChannel]],
) -> None:
    """The controller reads plain replies in C but stops at flagged entries; while a rank is
    in the middle of a chunked reply, its later plain-looking last chunk must be joined to
    the parts already read, never taken as a reply of its own."""
    chan, workers = shm_pair
    w = workers[0]
    big = _payload(5, shm_channel.REPLY_RING // 2 + 1000)  # two chunks
    step = shm_channel.REPLY_RING // 2 - 8
    w._put(b"first", 0)
    w._put(big[:step], shm_channel._MORE)  # the first part only, as if the worker paused
    assert chan.recv(1.0) == [(0, b"first")]
    assert chan.recv(0.0) == []  # a part alone is no reply
    w._put(big[step:], 0)  # the last part: no flag, like any plain reply
    w._put(b"after", 0)
    workers[1].ack()
    got = chan.recv(1.0)
    assert sorted(got, key=lambda x: (x[0], len(x[1] or b""))) == [
        (0, b"after"), (0, big), (1, b"")]
    assert [d for r, d in got if r == 0] == [big, b"after"]  # in the worker's order


# -- the ring's arithmetic ---------------------------------------------------------------------


def test_a_ring_places_entries_so_that_none_straddles_its_end() -> None:
    ring = Ring(64)
    assert ring.offset(64 * 5 + 8) == 8
    assert ring.skip(8, 56) == 0  # ends exactly at the ring's end
    assert ring.skip(16, 56) == 48  # would cross it: skip to the next lap
    assert ring.next_lap(64 * 5 + 8) == 64 * 6
    assert ring.next_lap(64 * 6) == 64 * 7
    assert ring.fits(100, 36) and not ring.fits(101, 36)
    with pytest.raises(ValueError, match="power of two"):
        Ring(48)


# -- the shm channel's rings, both ends in this process ----------------------------------------


def test_commands_straddling_the_ring_end_arrive_whole_lap_after_lap(
    shm_pair: tuple[ShmChannel, list[ShmWorkerChannel]],
) -> None:
    chan, workers = shm_pair
    rng = random.Random(8)
    targets = [(0, 1), (1,), (0,), (0, 1)]  # each worker skips at most one entry in a row
    sent = 0
    for i in range(500):
        n = rng.choice([1, 7, 8, 9, 4096, 100_000, 250_000, rng.randrange(1, 300_000)])
        ranks = targets[i % len(targets)]
        data = _payload(i, n)
        chan.send(data, ranks)
        sent += n
        for r in ranks:
            got = workers[r].recv()
            assert got is not None
            assert bytes(got[0]) == data and got[1] == []
    assert sent > 10 * shm_channel.CMD_RING  # many laps, so many wraps


def test_commands_with_buffers_or_a_large_body_straddling_the_ring_end_arrive_whole(
    shm_pair: tuple[ShmChannel, list[ShmWorkerChannel]],
) -> None:
    """send's slow way (buffers in the arena, or a body over a quarter of the ring: the
    entry holds their descriptors, written once ``_make_room`` moved the head past a wrap
    mark) among plain entries, lap after lap: each arrives whole, its buffers too."""
    chan, workers = shm_pair
    rng = random.Random(10)
    for i in range(300):
        body = _payload(i, rng.choice([1, 9, 4096, 200_000, rng.randrange(1, 300_000)]))
        buffers: list[bytes] = []
        if i % 3 == 1:
            buffers = [_payload(i + 1, rng.choice([1, 70_000])), _payload(i + 2, 5)]
        elif i % 3 == 2:
            body = _payload(i, shm_channel._INLINE_MAX + 1 + rng.randrange(100_000))
        chan.send(body, (0, 1), buffers)
        for w in workers:
            got = w.recv()
            assert got is not None
            data, views = got
            assert bytes(data) == body
            assert [bytes(v) for v in views] == buffers
            del data, views, got  # the arena's blocks are done once their views are gone


def test_replies_straddling_the_ring_end_arrive_whole_and_in_order(
    shm_pair: tuple[ShmChannel, list[ShmWorkerChannel]],
) -> None:
    chan, workers = shm_pair
    rng = random.Random(9)
    sent = 0
    for i in range(600):
        r = i % 2
        if i % 5 == 0:
            workers[r].ack()  # the inlined fast path of the same ring
            expect = b""
        else:
            expect = _payload(i, rng.choice([1, 9, 70_000, 150_000, rng.randrange(1, 200_000)]))
            workers[r].reply(expect)
        sent += len(expect)
        assert chan.recv(0.0) == [(r, expect)]
    assert sent > 20 * shm_channel.REPLY_RING


def test_a_send_on_a_full_ring_times_out_at_its_deadline_having_sent_nothing(
    shm_pair: tuple[ShmChannel, list[ShmWorkerChannel]],
) -> None:
    chan, workers = shm_pair
    sent: list[bytes] = []
    for size in (100_000, 1000, 1):  # nobody reads: fill the ring to the last entry
        while True:
            data = _payload(len(sent), size)
            start = time.monotonic()
            try:
                chan.send(data, (0, 1), deadline=start + 0.02)
            except TimeoutError as exc:
                assert "nothing of this message was sent" in str(exc)
                assert 0.015 <= time.monotonic() - start < 1.0
                break
            sent.append(data)
            assert len(sent) < 10_000, "the ring never filled up"
    top = chan.arena._top
    big = pickle.PickleBuffer(bytearray(1 << 17))  # would go through the arena
    with pytest.raises(TimeoutError, match="nothing of this message was sent"):
        chan.send(b"x", (0, 1), [big], deadline=time.monotonic() + 0.01)
    assert chan.arena._top == top  # no buffer was placed either
    for r in (0, 1):
        for data in sent:
            got = workers[r].recv()
            assert got is not None and bytes(got[0]) == data
    chan.send(b"next", (0, 1), deadline=time.monotonic() + 1.0)  # room again
    for r in (0, 1):
        got = workers[r].recv()
        assert got is not None and bytes(got[0]) == b"next"  # the timed-out ones never came


# -- watching for deaths -------------------------------------------------------------------------


def _channel(kind: str) -> tuple[Channel, list[int]]:
    """A one-worker channel of ``kind`` and fds to close afterwards: for the pipe, a copy of
    the worker's reply end, so that the controller's recv sees no end of stream."""
    if kind == "shm":
        return ShmChannel(1, _NAME), []
    chan = PipeChannel(1, _NAME)
    return chan, [os.dup(chan.endpoint(0)[0]["reply"])]


@pytest.mark.parametrize("kind", ["shm", "pipe"])
def test_a_waiting_recv_returns_at_once_when_a_watched_fd_becomes_readable(kind: str) -> None:
    chan, keep = _channel(kind)
    r, w = os.pipe()  # stands in for a worker's pidfd
    try:
        chan.started([r])
        timer = threading.Timer(0.1, os.write, (w, b"x"))
        timer.start()
        start = time.monotonic()
        assert chan.recv(10.0) == []
        assert time.monotonic() - start < 2.0
        timer.join()
        assert chan.recv(10.0, [r]) == []  # the deprecated second argument is still taken
    finally:
        chan.close()
        for fd in (r, w, *keep):
            os.close(fd)


@pytest.mark.parametrize("kind", ["shm", "pipe"])
def test_a_poll_does_not_look_at_the_watched_fds_so_it_drains_after_they_closed(
    kind: str,
) -> None:
    chan, keep = _channel(kind)
    r, w = os.pipe()
    try:
        chan.started([r])
        os.close(r)
        os.close(w)
        assert chan.recv(0.0) == []
    finally:
        chan.close()
        for fd in keep:
            os.close(fd)


@pytest.mark.parametrize("kind", ["shm", "pipe", "tcp", "mixed"])
def test_rearm_wake_makes_a_wake_fd_readable_until_the_next_poll(kind: str) -> None:
    """What the router does for an event loop whose poll found another thread reading (it
    may have emptied the wake fds, reading only its own replies): the loop wakes, and its
    poll (clear_wake, then recv(0.0)) leaves the fds quiet again. Nothing once closed."""
    from unison.channel.mixed import MixedChannel
    from unison.channel.tcp import TcpChannel

    chan: Channel
    keep: list[int] = []
    if kind == "tcp":
        chan = TcpChannel(1, "127.0.0.1", "127.0.0.1", b"s" * 32)
    elif kind == "mixed":
        chan = MixedChannel(2, _NAME, [0], "127.0.0.1", "127.0.0.1", b"s" * 32)
    else:
        chan, keep = _channel(kind)
    try:
        fds = chan.wake_fds()
        assert not select.select(fds, [], [], 0)[0]
        chan.rearm_wake()
        assert select.select(fds, [], [], 0)[0]
        chan.clear_wake()
        assert chan.recv(0.0) == []
        assert not select.select(fds, [], [], 0)[0]
    finally:
        chan.close()
        for fd in keep:
            os.close(fd)
    chan.rearm_wake()


def _pipe_worker(reply_fd: int) -> PipeWorkerChannel:
    """A worker's end of a pipe channel that replies into ``reply_fd`` (its command end, a
    pipe of its own, is never used: close ``_cmd`` afterwards)."""
    cmd_r, cmd_w = os.pipe()
    os.close(cmd_w)
    return PipeWorkerChannel({"cmd": cmd_r, "reply": reply_fd, "rank": 0, "n": 1})


def test_a_pipe_recv_takes_a_reply_while_it_spins_and_once_it_sleeps() -> None:
    chan, keep = _channel("pipe")
    reply = _pipe_worker(keep[0])
    try:
        chan.started([])
        for delay in (0.0, 0.002, 0.05):  # in its first look, its spin, its sleep
            timer = threading.Timer(delay, reply.reply, (b"hi %g" % delay,))
            timer.start()
            start = time.monotonic()
            got = chan.recv(10.0)
            if not got:  # a spin that met a long yield may return before the reply: again
                got = chan.recv(10.0)
            assert got == [(0, b"hi %g" % delay)]
            assert time.monotonic() - start < 2.0
            timer.join()
    finally:
        chan.close()
        reply.close()
        os.close(reply._cmd)


def test_a_pipe_recv_takes_replies_however_the_reads_cut_them_and_never_waits_for_a_rest(
) -> None:
    chan, keep = _channel("pipe")
    r, w = os.pipe()
    writer = _pipe_worker(w)  # writes each reply's bytes here first, to be cut in pieces
    replies = [b"", b"a", b"bc" * 1000, bytes(range(256)) * 200]
    try:
        chan.started([])
        for data in replies:
            writer.reply(data)
        stream = os.read(r, 1 << 20)
        got: list[tuple[int, bytes | Reply | None]] = []
        at = 0
        for cut in (3, 5, 9, 4000, 30_000, len(stream)):  # within a head, a body, across
            os.write(keep[0], stream[at:cut])
            at = cut
            start = time.monotonic()
            got += chan.recv(5.0)  # whole replies or none, at once: never a wait for a rest
            assert time.monotonic() - start < 2.0
        assert got == [(0, data) for data in replies]
        writer._reply = keep[0]
        large = bytes(range(251)) * 12_000  # 3 MB: more than a read takes at once
        thread = threading.Thread(target=lambda: [writer.reply(d) for d in (large, b"after")])
        thread.start()
        got = []
        while len(got) < 2:
            got += chan.recv(5.0)
        thread.join()
        assert got == [(0, large), (0, b"after")]
        writer.reply(b"x" * 10)
        os.write(keep[0], b"\x10")  # a reply begun, and then the worker's end closed
        os.close(keep.pop())
        assert chan.recv(1.0) == [(0, b"x" * 10)]
        assert chan.recv(1.0) == [(0, None)]
    finally:
        chan.close()
        for fd in (*keep, r, w, writer._cmd):
            os.close(fd)


@pytest.mark.parametrize("junk", [
    b"hello, world\n",  # a print to the wrong fd: its first 8 bytes read as a length
    struct.pack("<QQ", 1 << 62, 0),  # untagged: would allocate 4 EiB, or wait for it forever
    struct.pack("<QQ", (0x554E << 48) | (1 << 47), 0),  # tagged, but past any reply's size
])
def test_a_pipe_reply_stream_that_breaks_the_format_ends_that_worker_never_read_as_a_length(
        junk: bytes) -> None:
    """Bytes in a reply pipe that are no tagged length end the stream there, after the
    whole replies before them, as a closed pipe would; ``where`` says why."""
    chan, keep = _channel("pipe")
    writer = _pipe_worker(keep[0])
    try:
        chan.started([])
        writer.reply(b"before")
        os.write(keep[0], junk + b"after")
        start = time.monotonic()
        got: list[tuple[int, bytes | Reply | None]] = []
        while len(got) < 2:
            got += chan.recv(2.0)
        assert time.monotonic() - start < 2.0
        assert got == [(0, b"before"), (0, None)]
        assert chan.ended() == 0 and "break the format" in chan.where(0), chan.where(0)
        writer.reply(b"later")
        assert chan.recv(0.1) == []  # nothing more is read from it
    finally:
        chan.close()
        for fd in (*keep, writer._cmd):
            os.close(fd)


PipeEnds = tuple[PipeChannel, PipeWorkerChannel, dict[str, Any]]


@pytest.fixture
def pipe_ends() -> Iterator[PipeEnds]:
    """A one-worker pipe channel and its worker's end, in this process (the worker's spec
    holds copies of its fds); all closed when the test ends, passed or failed."""
    ends = Reporting("pipe")
    yield ends.chan, ends.worker, ends.spec
    ends.close()


class Reporting:
    """A one-worker channel whose workers report their progress in the reply stream (pipe,
    TCP), and its worker's end, both in this process."""

    def __init__(self, kind: str) -> None:
        from unison.channel import pipe, tcp

        self.kind = kind
        if kind == "pipe":
            self.chan: Any = PipeChannel(1, _NAME)
            spec = dict(self.chan.endpoint(0)[0])
            spec.update(cmd=os.dup(spec["cmd"]), reply=os.dup(spec["reply"]), arena=None)
            self.spec = spec
            self.worker: Any = PipeWorkerChannel(spec)
            self.drain_every = pipe._DRAIN_EVERY
            self._report = lambda word: pipe._REPLY.pack(pipe._REPORT, word)
        else:
            self.chan = tcp.TcpChannel(1, "127.0.0.1", "127.0.0.1", b"s" * 32)
            self.chan.linger = 0.0  # close() need not wait for a worker end that reads nothing
            sock, inc = join_tcp(self.chan, b"s" * 32)
            self.worker = tcp.TcpWorkerChannel(sock, inc)
            self.drain_every = tcp._DRAIN_EVERY
            self._report = lambda word: tcp._REPLY.pack(tcp._REPORT_MAGIC, inc, 0, word)
        self.chan.started([])

    def write_reports(self, word: int, count: int) -> None:
        """``count`` reports of ``word``, written as the worker's end would."""
        data = self._report(word) * count
        if self.kind == "pipe":
            os.write(self.spec["reply"], data)
        else:
            self.worker._sock.sendall(data)

    def unread(self) -> bool:
        """Whether the controller's end has bytes of the worker's it has not read."""
        fd = (self.chan._replies[0] if self.kind == "pipe" else self.chan._peers[0].sock)
        return bool(select.select([fd], [], [], 0)[0])

    def close(self) -> None:
        self.chan.close()
        self.worker.close()
        if self.kind == "pipe":
            os.close(self.spec["cmd"])


@pytest.fixture(params=["pipe", "tcp"])
def reporting(request: pytest.FixtureRequest) -> Iterator[Reporting]:
    """Closed when the test ends, passed or failed."""
    ends = Reporting(request.param)
    yield ends
    ends.close()


def test_a_worker_reports_what_it_ran_before_it_waits_and_settled_reads_it(
        reporting: Reporting) -> None:
    """The pipe and TCP channels' sync without a message: a worker about to wait writes
    "ran k frames, holds errors or not" once (a reply says the same for its frame), and the
    controller's ``settled`` is true only once every frame sent is reported run with no
    error held; false at once while errors are held or another thread reads the replies."""
    chan, worker = reporting.chan, reporting.worker
    waiter: threading.Thread | None = None

    def next_frame() -> threading.Thread:  # the worker's recv, which reports, then waits
        thread = threading.Thread(target=worker.recv)
        thread.start()
        return thread

    def settles_within(seconds: float) -> bool:  # a look that finds the last word "holds
        end = time.monotonic() + seconds  # errors" says no at once: again, as a sync would
        while not chan.settled([0], seconds):
            if time.monotonic() > end:
                return False
            time.sleep(0.001)
        return True

    try:
        chan.send(b"call", [0])
        chan.send(b"call", [0])
        assert not chan.settled([0], 0.0)  # sent, not run
        worker.recv()
        worker.recv()
        waiter = next_frame()  # both ran: it says so before it waits
        assert settles_within(10.0)
        assert chan.settled([0], 0.0)  # and stays so, with nothing more to read
        chan.send(b"more", [0])
        waiter.join(5.0)
        start = time.monotonic()
        assert not chan.settled([0], 0.2)  # taken, not yet reported run
        assert time.monotonic() - start >= 0.15
        worker.unreported(1)
        worker.reply(b"the answer")  # a reply reports its frame run, and the error held
        start = time.monotonic()
        assert not chan.settled([0], 5.0)  # an error held: ask, at once
        assert time.monotonic() - start < 1.0
        assert chan.recv(1.0) == [(0, b"the answer")]  # settled kept it for recv
        worker.unreported(0)
        waiter = next_frame()  # the change is reported before the next wait
        assert settles_within(10.0)
        with chan._rx:  # another thread reads the replies: no look at all
            assert not chan.settled([0], 5.0)
        assert chan._sent == [3] and chan._progress == [3 << 1]
    finally:
        chan.close()  # ends the waiting recv
        if waiter is not None:
            waiter.join(5.0)


def _settling(chan: Any) -> tuple[threading.Thread, list[bool]]:
    """A thread in ``chan.settled([0], 30.0)``, once it waits; and where its result goes."""
    result: list[bool] = []
    settler = threading.Thread(target=lambda: result.append(chan.settled([0], 30.0)))
    settler.start()
    deadline = time.monotonic() + 10.0
    while not chan._rx.locked() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert chan._rx.locked()
    return settler, result


def test_a_recv_in_another_thread_makes_a_waiting_settled_let_go_at_once(
        reporting: Reporting) -> None:
    """settled reads the replies while it waits for reports, and only one thread reads
    them at a time: a recv of another thread (its own replies) asks it to let go, so that
    no thread waits for another's sync; that sync then asks (SYNC)."""
    chan, worker = reporting.chan, reporting.worker
    chan.send(b"call", [0])  # taken, never reported: settled would wait it out
    worker.recv()
    settler, result = _settling(chan)
    threading.Timer(0.05, worker.reply, (b"for the other thread",)).start()
    start = time.monotonic()
    got = chan.recv(10.0)
    settler.join(10.0)
    assert result == [False] and time.monotonic() - start < 5.0
    got += chan.recv(10.0) if not got else []
    assert got == [(0, b"for the other thread")]
    for _ in range(3):  # a recv that finds the lock free leaves no stale request behind
        assert chan.recv(0.0) == []
    assert chan.settled([0], 0.0) and not chan._rx.locked()  # the reply reported it run
    chan._rx.acquire()  # a recv that finds another reader (not a settled) there
    reader = threading.Thread(target=chan.recv, args=(0.0,))
    reader.start()
    time.sleep(0.05)
    chan._rx.release()
    reader.join(10.0)
    assert not chan.settled([0], 0.0)  # the request it left: this one asks, once
    assert chan.settled([0], 0.0)


def test_a_waiting_settled_returns_when_another_thread_closes_the_channel(
        reporting: Reporting) -> None:
    chan = reporting.chan
    chan.send(b"call", [0])  # never reported run
    settler, result = _settling(chan)
    start = time.monotonic()
    chan.close()
    settler.join(10.0)
    assert result == [False] and time.monotonic() - start < 5.0


def test_a_controller_that_only_sends_still_reads_the_reports(reporting: Reporting) -> None:
    """A worker reports at most once per frame; sends read the replies every
    _DRAIN_EVERY, so a controller that calls and calls without a wait still takes them
    (a worker blocked writing a report to a full pipe or connection reads no command)."""
    chan = reporting.chan
    reporting.write_reports(7 << 1, reporting.drain_every)  # as many as frames can cause
    for _ in range(reporting.drain_every - 1):
        chan.send(b"call", [0])
    assert chan._progress == [0]
    chan.send(b"call", [0])
    assert chan._progress == [7 << 1]  # read, and nothing is left unread
    assert not reporting.unread()


def test_a_pipe_worker_reads_frames_sent_back_to_back_in_one_read_and_in_order(
        pipe_ends: PipeEnds) -> None:
    chan, worker, _ = pipe_ends
    big = bytes(range(256)) * 400
    chan.send(b"call", [0])
    chan.send(b"with a buffer", [0], [pickle.PickleBuffer(big)])
    chan.send(b"sync", [0])
    data, bufs = worker.recv() or (b"", [])
    assert (bytes(data), bufs) == (b"call", [])
    assert worker._have  # the frames behind it came with that one read
    data, bufs = worker.recv() or (b"", [])
    assert bytes(data) == b"with a buffer" and [bytes(b) for b in bufs] == [big]
    data, bufs = worker.recv() or (b"", [])
    assert (bytes(data), bufs) == (b"sync", [])
    assert not worker._have
    chan.close()
    assert worker.recv() is None  # the controller is gone


def test_a_pipe_recv_stops_watching_a_watched_fd_closed_under_it() -> None:
    chan, keep = _channel("pipe")
    r, w = os.pipe()
    try:
        chan.started([r])
        assert chan.recv(0.01) == []  # its set of fds is made now, r in it
        os.close(r)
        os.close(w)
        assert chan.recv(0.05) == []  # r reads as closed (POLLNVAL): no error, dropped
        start = time.monotonic()
        assert chan.recv(0.2) == []  # and then it waits out its timeout, not a busy loop
        assert time.monotonic() - start >= 0.15
    finally:
        chan.close()
        for fd in keep:
            os.close(fd)


def test_a_channels_abilities_are_attributes_of_the_interface() -> None:
    assert Channel.arena is None
    chan = ShmChannel(1, _NAME)
    try:
        assert isinstance(chan.arena, Arena)
    finally:
        chan.close()


# -- a send that ends half-way -------------------------------------------------------------------


class _Alarm(Exception):
    """A signal handler's exception: a time limit on a block of user code."""


def _takes(*counts: int) -> Callable[[list[memoryview]], int]:
    """A non-blocking stream's send that takes ``counts`` bytes, one call each, then is
    full (BlockingIOError) for good."""
    left = list(counts)

    def send(parts: list[memoryview]) -> int:
        if not left:
            raise BlockingIOError
        return left.pop(0)

    return send


def _raises(exc: BaseException) -> Callable[..., None]:
    def fail(*_: object) -> None:
        raise exc

    return fail


def test_write_frame_makes_an_exception_that_ends_it_half_way_a_partial_send() -> None:
    """Any exception that ends a frame's write once part of the message went (a signal
    handler's in the wait for room, a TimeoutError too) becomes a PartialSendError with it
    as its cause, so the session closes rather than go on out of step; with nothing
    written it goes on as it is; only the deadline with nothing written is SendTimeout. The
    pipe and TCP channels both write through write_frame."""
    from unison.channel import PartialSendError, SendTimeout, stall, write_frame

    frame = [b"head", b"x" * 100]
    later = time.monotonic() + 60

    def write(send: Callable[[list[memoryview]], int], wait: Callable[..., object],
              written: bool = False, deadline: float | None = later,
              check: Callable[[], object] = lambda: None) -> bool:
        return write_frame(send, frame, "worker 0's pipe", stall(deadline), written, check,
                           wait)

    for exc in (_Alarm("time limit"), TimeoutError("time limit"), KeyboardInterrupt()):
        with pytest.raises(PartialSendError, match="half sent to worker 0's pipe") as info:
            write(_takes(5), _raises(exc))
        assert info.value.__cause__ is exc
        with pytest.raises(PartialSendError) as info:  # another worker got it already
            write(_takes(), _raises(exc), written=True)
        assert info.value.__cause__ is exc
        with pytest.raises(type(exc)) as other:  # nothing of it went: as it is
            write(_takes(), _raises(exc))
        assert other.value is exc
        with pytest.raises(PartialSendError) as info:  # a send that may have written
            write(_raises(exc), _raises(AssertionError("no wait")))
        assert info.value.__cause__ is exc
    with pytest.raises(SendTimeout, match="nothing of this message was sent"):
        write(_takes(), lambda _: None, deadline=time.monotonic())
    with pytest.raises(PartialSendError, match="deadline passed") as info:
        write(_takes(5), lambda _: None, deadline=time.monotonic())
    assert info.value.__cause__ is None
    death = BrokenPipeError("a worker died")
    with pytest.raises(BrokenPipeError):  # the stream's own error: the session closes for it
        write(_takes(5), lambda _: None, check=_raises(death))
    assert write(_takes(50, 54), _raises(AssertionError("no wait")))  # whole


def test_write_frame_times_out_only_a_stream_that_stops_moving() -> None:
    """Each part written moves the deadline to then plus the time the send was given: a
    frame taken a little at a time, with pauses shorter than that, goes whole however long
    it takes in all (issue 9, forty-ninth pass); one whose stream stops for that long
    fails half sent."""
    from unison.channel import PartialSendError, stall, write_frame

    frame = [b"x" * 100]
    counts = [10] * 10
    room = [True]

    def send(parts: list[memoryview]) -> int:  # 10 bytes, then full until the next wait
        if not (room[0] and counts and counts[0]):
            raise BlockingIOError
        room[0] = False
        return counts.pop(0)

    def wait(seconds: float) -> None:
        time.sleep(min(seconds, 0.03))  # room comes after 30 ms each time: 0.3 s in all
        room[0] = True

    start = time.monotonic()
    assert write_frame(send, frame, "worker 0's pipe", stall(start + 0.1), False,
                       lambda: None, wait)
    assert time.monotonic() - start > 0.2
    counts[:] = [10, 0]  # 10 bytes, then nothing more
    with pytest.raises(PartialSendError, match="deadline passed"):
        write_frame(send, frame, "worker 0's pipe", stall(time.monotonic() + 0.1), False,
                    lambda: None, wait)


def test_an_exception_between_two_workers_pipe_writes_is_a_partial_send(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker 0 got the whole frame, worker 1 nothing, when an exception came (a signal
    handler's): out of step, so a PartialSendError, not the exception as it is."""
    from unison.channel import PartialSendError

    chan = PipeChannel(2, _NAME)
    real = chan._write

    def write(rank: int, *args: Any) -> bool:
        if rank == 1:
            raise _Alarm("time limit")
        return real(rank, *args)

    monkeypatch.setattr(chan, "_write", write)
    try:
        with pytest.raises(PartialSendError, match="half sent") as info:
            chan.send(b"call", (0, 1))
        assert isinstance(info.value.__cause__, _Alarm)
        with pytest.raises(_Alarm):  # worker 1 alone: nothing went anywhere
            chan.send(b"call", (1,))
    finally:
        chan.close()


def test_a_signal_handlers_exception_mid_frame_is_a_partial_send(reporting: Reporting) -> None:
    """A frame larger than the stream holds, to a worker that reads nothing: the send waits
    for room with part of the frame written, and a signal handler's exception there is a
    PartialSendError (before: the exception went on as it is, and the worker would read
    the next frames as the rest of this one)."""
    from unison.channel import PartialSendError

    with raising_on_signal(_Alarm, 0.2), pytest.raises(PartialSendError) as info:
        reporting.chan.send(b"x" * (64 << 20), [0])
    assert isinstance(info.value.__cause__, _Alarm)
    assert "half sent to worker 0's" in str(info.value)


def test_slots_used_never_understates_the_pages_a_pipe_uses() -> None:
    """The kernel's own pipes, written and read at random (small writes that share a page,
    writes of 3/4 page that take one each, large ones, partial reads): a write of as many
    pages as ``_slots_used`` leaves free always goes in whole. Bytes alone (FIONREAD) did
    not: the room they promised took only the few pages left, and the frame went in half."""
    from collections import deque

    from unison.channel import pipe

    page = pipe._PAGE
    r, w = os.pipe()
    try:
        pipe._grow(w)
        os.set_blocking(w, False)
        slots = pipe._capacity(w) // page
        rng = random.Random(1)
        queued: deque[int] = deque()  # per write still (partly) in the pipe, its bytes there
        overstated = 0
        for _ in range(300):
            size = rng.choice([rng.randint(1, 200), page * 3 // 4, rng.randint(1, 5 * page)])
            for _ in range(rng.randint(1, 2 * slots)):
                try:
                    n = os.write(w, b"w" * size)
                except BlockingIOError:
                    break
                queued.append(n)
            total = pipe._queued(w)
            assert total == sum(queued)
            free = slots - pipe._slots_used(total, len(queued)) if total else slots
            overstated += (slots * page - total) // page > free
            if free > 0:
                try:
                    n = os.write(w, b"p" * (free * page))
                except BlockingIOError:
                    n = 0
                assert n == free * page, (free, total, len(queued))
                queued.append(n)
            want = rng.randint(1, pipe._queued(w))
            while want:  # the worker reads some (the last read may stop inside a write)
                got = len(os.read(r, min(want, 1 << 20)))
                want -= got
                while got:
                    take = min(got, queued[0])
                    got -= take
                    queued[0] -= take
                    if not queued[0]:
                        queued.popleft()
        assert overstated  # where bytes alone promised more than there was
    finally:
        os.close(r)
        os.close(w)


def test_a_deadline_send_behind_one_large_frame_goes_without_waiting(
        pipe_ends: PipeEnds) -> None:
    """The bound on the pages a pipe uses counts the frames the worker has not reported as
    run: behind one frame of over half the pipe, another of a quarter still goes at once
    (bytes alone at twice their pages would say full)."""
    import fcntl

    chan, worker, _ = pipe_ends
    size = fcntl.fcntl(chan._cmd[0], fcntl.F_GETPIPE_SZ)
    if size < 1 << 18:
        pytest.skip("the command pipe could not be grown (pipe-max-size)")
    first, second = b"a" * (size * 55 // 100), b"b" * (size // 4)
    chan.send(first, [0])
    chan.send(second, [0], deadline=time.monotonic())  # the deadline passed: room or nothing
    for data in (first, second):
        got = worker.recv()
        assert got is not None and bytes(got[0]) == data


# -- the arena -----------------------------------------------------------------------------------


def test_an_arena_block_is_reused_only_once_every_reader_is_done_with_it() -> None:
    arena = Arena(_NAME, 2)
    readers = [ArenaReader(arena.fd, r, 2) for r in range(2)]
    try:
        data = bytes(range(256)) * 400  # 100 KiB: one block of 128 KiB
        first = arena.place([data], (0, 1))[0]
        views = [reader.view(first) for reader in readers]
        assert bytes(views[0]) == data and bytes(views[1]) == data
        views[0][0] = 255  # commands are copy-on-write: the other reader does not see it
        assert views[1][0] == 0
        second = arena.place([data], (0, 1))[0]
        assert second[0] != first[0]  # both readers still map the first block
        del views[0]
        gc.collect()
        third = arena.place([data], (0, 1))[0]
        assert third[0] not in (first[0], second[0])  # reader 1 still maps it
        del views
        gc.collect()
        fourth = arena.place([data], (0, 1))[0]
        assert fourth[0] == first[0]  # done everywhere: reused
        sent_not_read = arena.place([b"y" * 10], (0,))[0]  # never viewed: never done
        assert arena.place([b"z" * 10], (0,))[0][0] != sent_not_read[0]
    finally:
        readers.clear()
        gc.collect()
        arena.close()


def test_a_reader_counts_a_block_done_only_once_its_mapping_is_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Counted earlier, a CPU without x86's store order (the pipe channel runs there) could
    # let a store into a shared block land after the count, over the block's next contents.
    # There each view maps its own block (on x86 a view is a window into one mapping of the
    # whole file, counted after a fence: the next test).
    from unison.channel import arena as arena_module

    monkeypatch.setattr(arena_module._native, "ordered_memory", lambda: False)
    mapped_at_count: list[bool] = []

    class Reader(ArenaReader):
        def _done(self, i: int) -> None:
            with open("/proc/self/maps") as maps:
                spans = [line.split()[0].split("-") for line in maps]
            mapped_at_count.append(any(int(lo, 16) <= addr < int(hi, 16) for lo, hi in spans))
            super()._done(i)

    arena = Arena(_NAME, 1)
    reader = Reader(arena.fd, 0, 1)
    try:
        view = reader.view(arena.place([b"x" * 1000], (0,))[0])
        addr = ctypes.addressof(view.obj)
        del view
        gc.collect()
        assert mapped_at_count == [False]
    finally:
        gc.collect()
        arena.close()


@pytest.mark.parametrize("shared", [True, False])
def test_on_x86_views_are_windows_into_one_mapping_counted_as_they_go(shared: bool) -> None:
    """Each view of a reader lies in one mapping of the whole arena file (shared, or
    copy-on-write), made once; a view's block is counted done when the view is garbage, and
    a copy-on-write view's written pages are dropped first, so its next message shows."""
    from unison import _native

    if not _native.ordered_memory():
        pytest.skip("whole mappings are for x86's store order")
    arena = Arena(_NAME, 1)
    reader = ArenaReader(os.dup(arena.fd), 0, 1, shared=shared)
    again = second = None
    try:
        first = reader.view(arena.place([b"a" * 70_000], (0,))[0])
        second = reader.view(arena.place([b"b" * 70_000], (0,))[0])
        base = reader._wholes[shared].addr  # type: ignore[union-attr]
        assert base < ctypes.addressof(first.obj) < ctypes.addressof(second.obj)
        first[:1] = b"w"  # written: shared, the arena's; copy-on-write, the reader's own
        offset = ctypes.addressof(first.obj) - base
        del first
        gc.collect()
        again = reader.view(arena.place([b"c" * 70_000], (0,))[0])  # the first's block
        assert ctypes.addressof(again.obj) - base == offset
        assert bytes(again[:2]) == b"cc" and bytes(second[:1]) == b"b"
    finally:  # (the views first: the arena's close would find them mapped)
        del again, second
        gc.collect()
        arena.close()
        os.close(reader.fd)


@pytest.mark.parametrize("why", ["no pagemap", "strict overcommit", "large view"])
def test_where_a_whole_mapping_should_not_be_each_view_maps_its_block(
        monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    """The copy-on-write whole mapping is left out where the kernel does not tell written
    pages (the probe), where overcommit is strict (it would be charged in full), and for a
    view larger than the blocks a writer keeps backed: then each view maps its own block,
    and still reads its message, never a former one's writes."""
    from unison.channel import arena as arena_module

    if why == "no pagemap":
        monkeypatch.setattr(arena_module, "written_pages_seen", lambda: False)
    elif why == "strict overcommit":
        monkeypatch.setattr(arena_module, "_overcommit_strict", lambda: True)
    else:
        monkeypatch.setattr(arena_module, "WHOLE_VIEW_MAX", 65536)
    arena = Arena(_NAME, 1)
    reader = ArenaReader(os.dup(arena.fd), 0, 1)
    try:
        for fill in (b"a", b"b", b"c"):
            view = reader.view(arena.place([fill * 70_000], (0,))[0])
            assert bytes(view[:2]) == fill * 2
            view[:1] = b"w"  # the reader's own copy
            del view
            gc.collect()
        assert reader._wholes.get(False) is None
        assert arena_module.whole_mapping_fits(1 << 30, shared=True)  # shared: no charge
        assert arena_module.whole_mapping_fits(1 << 30, shared=False) is (
            why != "strict overcommit")
    finally:
        gc.collect()
        arena.close()
        os.close(reader.fd)


def test_under_mlockall_future_views_map_their_blocks() -> None:
    """``mlockall(MCL_FUTURE)`` (real-time worker code) locks every new mapping, and so
    fills it in as it is made: a whole mapping as large as the machine's memory would be
    read (or copied) in full. Such a process maps each view's block, as before."""
    import resource

    if (os.geteuid() != 0  # (root may lock past the limit: CAP_IPC_LOCK)
            and resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] != resource.RLIM_INFINITY):
        pytest.skip("locking all future memory needs an unlimited RLIMIT_MEMLOCK")
    code = (  # (a small arena: the writer's own whole mapping is locked too)
        "import ctypes, gc, os\n"
        "from unison.channel import arena as A\n"
        "fd = A.create_file('unison-test-mlockall', 1, size=1 << 22)\n"
        "if ctypes.CDLL(None).mlockall(2) != 0: print('refused'); raise SystemExit\n"
        "w = A.Arena('unison-test-mlockall', 1, fd=fd)\n"
        "r = A.ArenaReader(os.dup(w.fd), 0, 1)\n"
        "v = r.view(w.place([b'x' * 70000], (0,))[0])\n"
        "print(A._new_mappings_locked(), r._wholes.get(False), bytes(v[:1]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    if proc.stdout.strip() == "refused":
        pytest.skip("mlockall is not allowed here")
    assert proc.stdout.split() == ["True", "None", "b'x'"], proc.stdout


def test_a_full_arena_raises_memoryerror_and_recovers_once_a_block_is_done() -> None:
    fd = create_file(_NAME, 1, size=2 * MIN_BLOCK)
    arena = Arena(_NAME, 1, fd=fd)
    reader = ArenaReader(fd, 0, 1)
    try:
        a = arena.place([b"a" * MIN_BLOCK], (0,))[0]
        b = reader.view(arena.place([b"b" * MIN_BLOCK], (0,))[0])
        with pytest.raises(MemoryError, match="shared memory is full"):
            arena.place([b"c" * 10, b"d" * 10], (0,))
        view = reader.view(a)  # done with a once this view is garbage
        del view
        gc.collect()
        c = arena.place([b"c" * 10], (0,))[0]
        assert c[0] == a[0]
        assert bytes(b[:1]) == b"b"
        del b
    finally:
        gc.collect()
        arena.close()


# -- pacing --------------------------------------------------------------------------------------


def test_a_pacer_naps_double_up_to_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    naps: list[float] = []
    monkeypatch.setattr(pacing.time, "sleep", naps.append)
    pacer = pacing.Pacer(cap=160e-6)
    for _ in range(6):
        pacer.pause()
    assert naps == pytest.approx([20e-6, 40e-6, 80e-6, 160e-6, 160e-6, 160e-6])


def test_a_pacer_yields_within_its_spin_budget_and_never_sleeps_past_a_deadline(
    monkeypatch: pytest.MonkeyPatch, calm: None,
) -> None:
    naps: list[float] = []
    monkeypatch.setattr(pacing.time, "sleep", naps.append)
    spinning = pacing.Pacer(spin=60.0)
    for _ in range(3):
        spinning.pause()
    assert naps == []
    pacing.Pacer().pause(deadline=time.monotonic() - 1.0)
    pacing.Pacer(nap=1.0).pause(deadline=time.monotonic() + 0.01)
    assert naps[0] == 0.0 and 0.0 < naps[1] <= 0.01


@pytest.fixture
def calm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine that never looks crowded, whatever else runs beside the test."""
    monkeypatch.setattr(pacing, "LONG_YIELD", 60.0)
    monkeypatch.setattr(pacing.crowd, "until", 0.0)
    monkeypatch.setattr(pacing.crowd, "next_look", float("inf"))


def test_spin_stops_when_ready_or_when_its_budget_is_spent(calm: None) -> None:
    calls = iter(range(10))
    assert pacing.spin(lambda: next(calls) == 3, 60.0)
    assert next(calls) == 4  # checked after each yield, no more
    start = time.perf_counter()
    assert not pacing.spin(lambda: False, 0.005)
    assert time.perf_counter() - start >= 0.005
    assert not pacing.spin(lambda: True, 0.0)  # no budget: not even one look
    # a C check takes its arguments from spin (no lambda's frame), and its value comes back
    codes = iter([0, 0, 2])
    assert pacing.spin(lambda a, b: (a, b) == (7, 9) and next(codes), 60.0, 0.0, 7, 9) == 2


def test_a_busy_spin_checks_without_yielding_first_within_its_budget(
    calm: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where every process has a core, a wait first checks without yielding (pacing.BUSY):
    found within that time, no yield at all; not found, it yields as before; never past
    the wait's own budget."""
    yields: list[int] = []
    monkeypatch.setattr(pacing, "_yield", lambda: yields.append(1))
    calls = iter(range(100))
    assert pacing.spin(lambda: next(calls) == 3, 60.0, busy=60.0)
    assert next(calls) == 4 and not yields
    assert pacing.spin(lambda: bool(yields), 60.0, busy=1e-4)  # busy spent: it yields
    assert yields
    start = time.perf_counter()
    assert not pacing.spin(lambda: False, 0.0, busy=60.0)  # a poll: no budget, no spin
    assert time.perf_counter() - start < 1.0


def test_only_a_session_whose_processes_each_have_a_core_spins_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pacing, "cores", lambda: 4)
    assert pacing.busy_budget(4) == pacing.BUSY > 0
    assert pacing.busy_budget(5) == 0.0  # a peer would wait for the core we keep


def test_runs_wait_hands_the_core_over_once_where_the_session_has_more_processes_than_cores(
    calm: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pacing.hand_over as plain_values starts: one yield where a worker may wait for our
    core, none where each process has its own (busy) or on a crowded machine, whose
    strangers would keep it for a time slice; a long one is no crowd (the worker may run a
    long call)."""
    yields: list[int] = []
    monkeypatch.setattr(pacing, "_yield", lambda: yields.append(1))
    pacing.hand_over()
    assert yields == [1]
    monkeypatch.setattr(pacing.crowd, "until", pacing._clock() + 60.0)
    pacing.hand_over()
    assert yields == [1]  # crowded: keep the core
    monkeypatch.setattr(pacing.crowd, "until", 0.0)
    monkeypatch.setattr(pacing, "LONG_YIELD", 1e-3)
    monkeypatch.setattr(pacing.crowd, "rate", 0.0)
    monkeypatch.setattr(pacing, "_yield", lambda: time.sleep(2e-3))
    for _ in range(5):
        pacing.hand_over()
    assert pacing.crowd.rate == 0.0 and pacing.crowd.until == 0.0
    for (busy, handed), ring in itertools.product(((0.0, 1), (pacing.BUSY, 0)), ("C", "pure")):
        if ring == "C" and not shm_channel.NATIVE:
            continue
        chan = ShmChannel(1, _NAME)
        try:
            if ring == "pure":
                _pure(chan)
            chan._busy = busy
            monkeypatch.setattr(shm_channel, "hand_over", lambda: yields.append(2))
            yields.clear()
            chan.send(b"hello", [0])
            assert not yields  # a send alone keeps the core
            assert chan.plain_values((0,), 1, 0.0) is None  # no reply: nothing read
            assert yields.count(2) == handed, busy
        finally:
            chan.close()


def test_runs_hand_over_looks_at_the_machine_as_a_spin_would(
    calm: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run whose replies are in when the core comes back never spins: the hand-over's
    own look (every LOOK) is what notices a hog that took the core for its whole slice."""
    looks: list[float] = []
    monkeypatch.setattr(pacing, "_yield", lambda: None)
    monkeypatch.setattr(type(pacing.crowd), "look", lambda self, now: looks.append(now))
    monkeypatch.setattr(pacing.crowd, "next_look", 0.0)
    pacing.hand_over()
    assert len(looks) == 1
    monkeypatch.setattr(pacing.crowd, "next_look", pacing._clock() + 60.0)
    pacing.hand_over()
    assert len(looks) == 1  # not due yet


def test_frequent_long_yields_make_waits_sleep_at_once_for_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A yield that lost the core for a stranger's time slice (a CPU hog) ends the spin; once
    such waits are frequent, for CROWDED seconds every wait skips its spin: a sleeper woken
    by an eventfd preempts the hog, a yielder waits for its slice (issue 9: 4-8 ms per round
    trip beside two hogs). A lone long yield does not: sleeping costs a wake-up each time."""
    monkeypatch.setattr(pacing.crowd, "until", 0.0)
    monkeypatch.setattr(pacing.crowd, "rate", 0.0)
    monkeypatch.setattr(pacing.crowd, "next_look", float("inf"))  # yields alone, here
    monkeypatch.setattr(pacing, "_yield", lambda: time.sleep(2 * pacing.LONG_YIELD))
    looks: list[int] = []
    assert not pacing.spin(lambda: looks.append(1) is not None, 60.0)
    assert looks == [1]  # one look after the long yield, then it gave up
    assert pacing.crowd.until == 0.0  # once is not a crowd
    for _ in range(2):
        assert not pacing.spin(lambda: looks.append(1) is not None, 60.0)
    assert pacing.crowd.rate > pacing.CROWDED_RATE
    assert pacing.crowd.until > pacing._clock()
    looks.clear()
    assert not pacing.spin(lambda: looks.append(1) is not None, 60.0)
    assert looks == []  # crowded: no yield, no look
    naps: list[float] = []
    monkeypatch.setattr(pacing.time, "sleep", naps.append)
    pacing.Pacer(spin=60.0).pause()
    assert naps == [pacing.FIRST_NAP]  # crowded: a Pacer naps instead of yielding
    monkeypatch.setattr(pacing.crowd, "until", pacing._clock() - 1.0)  # CROWDED passed
    monkeypatch.setattr(pacing, "_yield", lambda: None)
    rate = pacing.crowd.rate
    calls = iter(range(10))
    assert pacing.spin(lambda: next(calls) == 2, 60.0)  # it probes with a spin again
    assert pacing.crowd.rate < rate  # and a clean spin brings the rate down


@pytest.mark.skipif(not os.path.exists(pacing._SCHEDSTAT), reason="no per-thread schedstat")
def test_a_stranger_holding_our_core_is_seen_without_any_yield(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where yields come back at once, the scheduler's own record still shows a stranger:
    this thread and a CPU hog pinned to one core take turns of a time slice each, and the
    next look reads spells off the core far over LONG_YIELD."""
    monkeypatch.setattr(pacing.crowd, "until", 0.0)
    monkeypatch.setattr(pacing.crowd, "rate", 0.0)
    cpu = min(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        os.sched_setaffinity(0, {cpu})
        pacing.crowd.look(pacing._clock())  # the baseline
        before = pacing.run_delay()
        end = time.perf_counter() + 0.75 * pacing.STALE_LOOK  # a look that still judges
        while time.perf_counter() < end:  # busy beside the hog
            pass
        after = pacing.run_delay()
        rate = pacing.crowd.rate
        pacing.crowd.look(pacing._clock())
        assert before is not None and after is not None
        spell = (after[0] - before[0]) / max(1, after[1] - before[1]) / 1e9
        if spell < pacing.STRANGER_SPELL:
            pytest.skip(f"this kernel gives a hog slices of {spell * 1e3:.2f} ms, under "
                        "STRANGER_SPELL: the long yields see such a hog, not the looks")
        assert pacing.crowd.rate > rate
    finally:
        os.sched_setaffinity(0, mine)
        hog.kill()
        hog.wait()
    pacing.crowd.look(pacing._clock())  # alone again: a quiet stretch does not count
    rate = pacing.crowd.rate
    time.sleep(0.05)
    pacing.crowd.look(pacing._clock())
    assert pacing.crowd.rate == rate


def test_a_look_sees_a_stranger_in_long_spells_that_fill_a_share_of_the_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Spells off the core as long as a hog's time slice (3.75 ms), filling 90% of the time
    since the last look, are a stranger. Not: two spells of a millisecond in 50 ms (2% of
    the time), nor 47% of the time in spells of 1.25 ms (four workers and the controller
    on two cores, taking turns of the scheduler's slice)."""
    monkeypatch.setattr(pacing.crowd, "until", 0.0)
    monkeypatch.setattr(pacing.crowd, "rate", 0.0)
    monkeypatch.setattr(pacing.crowd, "_seen", None)
    monkeypatch.setattr(pacing.crowd, "ours", 0)  # no count of runnable tasks (next test)
    ms = 1_000_000
    stats = iter([(0, 0), (2 * ms, 2), (2 * ms + 50 * ms, 2 + 40),
                  (52 * ms + 45 * ms, 42 + 12)])
    monkeypatch.setattr(pacing, "run_delay", lambda: next(stats))
    pacing.crowd.look(100.0)  # the baseline
    pacing.crowd.look(100.05)
    pacing.crowd.look(100.156)
    assert pacing.crowd.until == 0.0
    pacing.crowd.look(100.206)
    assert pacing.crowd.until == pytest.approx(100.206 + pacing.CROWDED)
    pacing.crowd.forget()
    assert (pacing.crowd.until, pacing.crowd.rate) == (0.0, 0.0)


def fresh_crowd(monkeypatch: pytest.MonkeyPatch, ours: int) -> None:
    """pacing.crowd as a process starts it, on a machine of 2 CPUs, ``ours`` expected."""
    for name, value in (("until", 0.0), ("rate", 0.0), ("_seen", None),
                        ("_stranger_looks", 0), ("ours", ours)):
        monkeypatch.setattr(pacing.crowd, name, value)
    monkeypatch.setattr(pacing, "_CPUS", 2)


def test_a_look_sees_strangers_runnable_beside_short_spells(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Beside two CPU hogs, Linux 6.18 kept our waits off the core 30-56% of the time in
    spells of tens of µs, which no spell length tells from peers. Then more runnable tasks
    than the CPUs and than our session's processes, at two looks in a row, are a crowd. Not:
    one such look, as many runnable tasks as our processes (peers), a quiet share, or a
    process that said nothing of its sessions (``expect``)."""
    fresh_crowd(monkeypatch, ours=0)
    ms = 1_000_000
    off = [20 * ms]  # off the core between two looks, 50 ms apart
    total = [0, 0]

    def stats() -> tuple[int, int]:  # in 1000 spells: of 20 µs, or of 1 µs
        total[0] += off[0]
        total[1] += 1000
        return total[0], total[1]

    monkeypatch.setattr(pacing, "run_delay", stats)
    tasks = iter([5, 3, 5, 3, 5, 4])
    monkeypatch.setattr(pacing, "runnable", lambda: next(tasks))
    pacing.crowd.look(100.0)  # the baseline
    pacing.crowd.look(100.05)  # ours unknown: runnable tasks are not counted
    pacing.crowd.look(100.10)
    assert pacing.crowd.until == 0.0
    pacing.crowd.expect(3)  # a session of a controller and two workers
    pacing.crowd.expect(2)  # a smaller one changes nothing
    assert pacing.crowd.ours == 3
    for now in (100.15, 100.20, 100.25, 100.30):  # 5, 3, 5, 3 runnable: never two in a row
        pacing.crowd.look(now)
    assert pacing.crowd.until == 0.0
    pacing.crowd.look(100.35)  # 5
    assert pacing.crowd.until == 0.0
    pacing.crowd.look(100.40)  # 4: two looks in a row
    assert pacing.crowd.until == pytest.approx(100.40 + pacing.CROWDED)
    assert pacing.crowd._stranger_looks == 2
    off[0] = ms  # 2% of the time off the core: the streak ends there
    pacing.crowd.look(100.45)
    pacing.crowd.look(100.50)
    assert pacing.crowd._stranger_looks == 0


def test_a_look_after_a_long_gap_judges_nothing_and_keeps_the_streak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between two waits we may sleep for long: the time off the core since a look half a
    second ago is diluted by that sleep, so such a look only starts afresh, and the streak
    of looks that found strangers goes on from where it was."""
    fresh_crowd(monkeypatch, ours=2)
    total = [0, 0]

    def stats() -> tuple[int, int]:  # 20 ms more off the core at every look
        total[0] += 20_000_000
        total[1] += 1000
        return total[0], total[1]

    monkeypatch.setattr(pacing, "run_delay", stats)
    monkeypatch.setattr(pacing, "runnable", lambda: 4)
    pacing.crowd.look(100.0)
    pacing.crowd.look(100.05)
    assert pacing.crowd._stranger_looks == 1
    pacing.crowd.look(100.05 + pacing.STALE_LOOK + 0.3)
    assert (pacing.crowd._stranger_looks, pacing.crowd.until) == (1, 0.0)
    pacing.crowd.look(100.05 + pacing.STALE_LOOK + 0.35)
    assert pacing.crowd.until > 100.0


def test_the_wait_for_the_first_command_forgets_the_workers_start(
    shm_pair: tuple[ShmChannel, list[ShmWorkerChannel]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Workers that start side by side keep each other off the core for a second or more;
    that is no crowd once the first command is here, and a later wait keeps what it saw."""
    chan, workers = shm_pair
    _first_wait_forgets(monkeypatch, lambda: chan.send(b"command", [0, 1]), workers[0].recv)


def test_a_tcp_workers_first_command_forgets_the_workers_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As the shm channel's worker: a worker that joined over TCP (a Ray actor, or one
    started by hand) forgets what its wait for the first command saw, and only that wait."""
    from unison.channel import tcp

    ours, theirs = socket.socketpair()
    worker = tcp.TcpWorkerChannel(theirs, 7)
    frame = tcp._HEAD.pack(tcp._MAGIC, 7, 7, 0) + b"command"
    try:
        _first_wait_forgets(monkeypatch, lambda: ours.sendall(frame), worker.recv)
    finally:
        ours.close()
        worker.close()


def _first_wait_forgets(monkeypatch: pytest.MonkeyPatch, send: Callable[[], object],
                        recv: Callable[[], tuple[Any, list[Any]] | None]) -> None:
    """A worker's recv of its first command forgets what pacing.crowd judged meanwhile;
    its second does not. ``send`` puts b"command" in its way, 50 ms after recv begins."""
    monkeypatch.setattr(pacing.crowd, "next_look", float("inf"))
    for first in (True, False):
        until = time.perf_counter() + 60.0
        monkeypatch.setattr(pacing.crowd, "until", until)
        sender = threading.Timer(0.05, send)
        sender.start()
        try:
            got = recv()
        finally:
            sender.join()
        assert got is not None and bytes(got[0]) == b"command"
        assert pacing.crowd.until == (0.0 if first else until)


def test_a_pipe_workers_first_command_forgets_the_workers_start(
        pipe_ends: PipeEnds, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the shm and TCP channels' workers: the pipe worker forgets what its wait for the
    first command saw, and only that wait."""
    chan, worker, _ = pipe_ends
    _first_wait_forgets(monkeypatch, lambda: chan.send(b"command", [0]), worker.recv)


@pytest.mark.parametrize("kind", ["shm", "pipe"])
def test_both_ends_of_a_channel_count_their_peers_as_no_strangers(
        monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """Each end tells pacing.crowd how many processes its session runs here, so a look
    counts only runnable tasks beyond them as strangers. The pipe channel told it nothing:
    beside two CPU hogs its waits spun on, unjudged, at 55-61 µs a round where the Pipe
    took 16-17 (docs/benchmarks.md, "Issue 9, thirty-second pass")."""
    fresh_crowd(monkeypatch, ours=0)
    if kind == "shm":
        chan: Channel = ShmChannel(3, _NAME)
        spec = chan.endpoint(2)[0]
    else:
        chan = PipeChannel(3, _NAME)
        spec = dict(chan.endpoint(2)[0], arena=None)
        spec.update(cmd=os.dup(spec["cmd"]), reply=os.dup(spec["reply"]))
    try:
        assert pacing.crowd.ours == 4
        monkeypatch.setattr(pacing.crowd, "ours", 0)
        worker = (ShmWorkerChannel if kind == "shm" else PipeWorkerChannel)(spec)
        assert pacing.crowd.ours == 4
        worker.close()
        del worker
    finally:
        if kind == "pipe":
            os.close(spec["cmd"])
        chan.close()
        gc.collect()


def test_a_tcp_worker_counts_the_peers_it_is_told_of(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that joined over TCP may share its host with any of the session's
    processes: it is told how many there are (worker.join passes world_size + 1)."""
    from unison.channel import tcp

    fresh_crowd(monkeypatch, ours=0)
    ours, theirs = socket.socketpair()
    try:
        worker = tcp.TcpWorkerChannel(theirs, 7, peers=5)
        assert pacing.crowd.ours == 5
        worker.close()
    finally:
        ours.close()
        theirs.close()


def test_no_schedstat_means_no_more_looks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pacing, "_SCHEDSTAT", "/nonexistent/schedstat")
    monkeypatch.setattr(pacing.crowd, "next_look", 0.0)
    pacing.crowd.look(pacing._clock())
    assert pacing.crowd.next_look == float("inf")


def test_long_yields_make_a_crowd_only_when_three_come_close_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker whose next command is mostly there already waits rarely: long yields a tenth
    of a second apart (a kernel thread's few milliseconds, now and then) are not frequent,
    however few waits lie between them, and neither are two in a row; three within a few
    milliseconds are (a stranger that stays)."""
    monkeypatch.setattr(pacing.crowd, "until", 0.0)
    monkeypatch.setattr(pacing.crowd, "rate", 0.0)
    monkeypatch.setattr(pacing.crowd, "_last_long", 0.0)
    for now in (100.0, 100.1, 100.2, 100.201):
        pacing.crowd.met_long_yield(now)
        assert pacing.crowd.until == 0.0, now
    pacing.crowd.met_long_yield(100.202)
    assert pacing.crowd.until == pytest.approx(100.202 + pacing.CROWDED)


def test_a_long_yield_inside_a_pacer_counts_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pacing.crowd, "until", 0.0)
    monkeypatch.setattr(pacing.crowd, "rate", 0.9)
    monkeypatch.setattr(pacing.crowd, "_last_long", pacing._clock())  # a moment ago
    monkeypatch.setattr(pacing, "_yield", lambda: time.sleep(2 * pacing.LONG_YIELD))
    pacing.Pacer(spin=60.0).pause()
    assert pacing.crowd.until > pacing._clock()


def _pure(chan: ShmChannel) -> None:
    """Make ``chan`` run its pure-Python ring from here on, as where _ring did not build: the
    head moves to Python, and nothing keeps the C Sender (and its view of the mapping)."""
    head = shm_channel._Head()
    head.wpos, head.limit = chan._head.wpos, chan._head.limit
    chan._fast, chan._head = None, head
    chan.__dict__.pop("send_plain", None)
    chan._values = chan._values_py


def _ring(chan: ShmChannel, ring: str) -> None:
    """Run ``chan``'s C ring (skipped where it is not built) or its pure-Python one."""
    if ring == "pure":
        _pure(chan)
    elif chan._fast is None:
        pytest.skip("UNISON_PURE is set" if shm_channel._native.pure_asked()
                    else "the C ring is not built here")


@pytest.mark.parametrize("ring", ["C", "pure"])
def test_settled_is_true_only_once_every_worker_ran_all_and_holds_no_unreported_error(
    shm_pair: tuple[ShmChannel, list[ShmWorkerChannel]], ring: str,
) -> None:
    """sync's usual case in one call (Channel.settled): each look C's Sender.settled, or
    Python's _look where the ring is pure Python."""
    chan, workers = shm_pair
    _ring(chan, ring)
    both = (0, 1)
    assert chan.settled(both, 0.0)  # nothing sent yet
    chan.send(b"first", both)
    start = time.monotonic()
    assert not chan.settled(both, 0.05)  # nobody has run it
    assert time.monotonic() - start < 2.0
    assert workers[0].recv() is not None and workers[0].poll() is None  # done: published
    assert not chan.settled(both, 0.0) and chan.settled((0,), 0.0)
    assert workers[1].recv() is not None and workers[1].poll() is None
    assert chan.settled(both, 0.0)
    workers[1].unreported(1)  # an error nobody fetched, published with the next progress
    chan.send(b"second", both)
    for w in workers:
        assert w.recv() is not None and w.poll() is None
    assert not chan.settled(both, 0.0) and not chan.settled((1,), 0.0)
    assert chan.settled((0,), 0.0)


def _run_reply(req_id: int, value: object, status: int = protocol.OK) -> bytes:
    return protocol.dumps_plain((req_id, status, value), protocol.PLAIN)


@pytest.mark.parametrize("ring", ["C", "pure"])
def test_plain_values_reads_a_runs_replies_only_once_all_are_in_each_plain_and_its_own(
    shm_pair: tuple[ShmChannel, list[ShmWorkerChannel]], ring: str,
) -> None:
    """run's quick path (Channel.plain_values): one C look reads and decodes every rank's
    reply, or none of them. Anything but a plain OK reply to this request (another id, an
    error, a pickle, an ack, the last chunk of a chunked reply) is left in the ring for
    recv, which the router then judges: never a value taken for the wrong call."""
    chan, workers = shm_pair
    _ring(chan, ring)
    both = (0, 1)
    assert chan.plain_values(both, 7, 0.0) is None  # nothing in
    workers[0].reply(_run_reply(7, 5))
    assert chan.plain_values(both, 7, 0.0) is None  # worker 1's is not in yet
    workers[1].reply(_run_reply(7, "six"))
    assert chan.plain_values(both, 7, 0.0) == [5, "six"]
    assert chan.recv(0.0) == []  # read, once
    for r in both:  # and the space handed back
        assert chan._q[chan._rr_idx[r]] == chan._reply_pos[r] > 0

    workers[0].reply(_run_reply(8, 0))
    workers[1].reply(_run_reply(8, 1))
    assert chan.plain_values((1, 0), 8, 0.0) == [1, 0]  # in the order of the ranks asked
    workers[1].reply(_run_reply(9, None))
    assert chan.plain_values((1,), 9, 0.0) == [None]  # a view's rank alone

    chan._partial[1].append(b"the first part of a chunked reply")
    workers[0].reply(_run_reply(10, 1))
    workers[1].reply(_run_reply(10, 1))  # as if it were that reply's last chunk
    assert chan.plain_values(both, 10, 0.0) is None  # a chunk is never a reply of its own
    chan._partial[1].clear()
    assert chan.plain_values(both, 10, 0.0) == [1, 1]

    wrong = [
        [_run_reply(11, 1), _run_reply(10, 1)],  # worker 1 answers another request
        [_run_reply(10, 1), _run_reply(10, "boom", protocol.ERR)],  # an error
        [protocol.dumps((10, protocol.OK, 1)), _run_reply(10, 1)],  # a pickle
        [_run_reply(10, 1), b""],  # an acknowledgement
        [_run_reply(10, 1), b"\xff\x00garbage"],  # bytes marshal refuses
    ]
    for pair in wrong:
        for w, data in zip(workers, pair):
            w.reply(data)
        assert chan.plain_values(both, 10, 0.0) is None, pair
        got = chan.recv(0.0)  # nothing was read: recv hands both over, as they were
        assert sorted((r, bytes(d)) for r, d in got) == list(enumerate(pair)), pair


@pytest.mark.parametrize("ring", ["C", "pure"])
def test_plain_values_makes_a_small_numpy_values_array_or_leaves_a_bad_one_to_recv(
    shm_pair: tuple[ShmChannel, list[ShmWorkerChannel]], ring: str,
) -> None:
    """An ARRAY reply (a small numpy array or scalar, protocol.array_payload) is read on
    run's quick path too, its value made by protocol.array_value; one it cannot make is
    left in the ring, with the other rank's, for recv and the router's decode to judge."""
    chan, workers = shm_pair
    _ring(chan, ring)
    arr, scalar = np.arange(6, dtype=np.int32).reshape(2, 3), np.float16(1.5)
    for w, v in zip(workers, (arr, scalar)):
        w.reply(_run_reply(3, protocol.array_payload(v), protocol.ARRAY))
    got = chan.plain_values((0, 1), 3, 0.0)
    assert got is not None and chan.recv(0.0) == []
    assert got[0].dtype == arr.dtype and got[0].shape == (2, 3) and (got[0] == arr).all()
    assert type(got[1]) is np.float16 and got[1] == scalar
    bad = [_run_reply(4, 1), _run_reply(4, ("<f8", (2,), b"short"), protocol.ARRAY)]
    for w, data in zip(workers, bad):
        w.reply(data)
    assert chan.plain_values((0, 1), 4, 0.0) is None
    assert sorted((r, bytes(d)) for r, d in chan.recv(0.0)) == list(enumerate(bad))


@pytest.mark.parametrize("ring", ["C", "pure"])
def test_plain_values_reads_on_across_the_reply_rings_wraps(
    shm_pair: tuple[ShmChannel, list[ShmWorkerChannel]], ring: str,
) -> None:
    """Laps of both reply rings, the entries' sizes chosen so that wrap markers fall at
    many offsets: each round's values come back whole, and recv finds nothing left."""
    chan, workers = shm_pair
    _ring(chan, ring)
    rng = random.Random(5)
    req = 0
    while chan._reply_pos[1] < 3 * shm_channel.REPLY_RING:
        req += 1
        values = [rng.randbytes(rng.randrange(1, 5000)) for _ in workers]
        for w, v in zip(workers, values):
            w.reply(_run_reply(req, v))
        assert chan.plain_values((0, 1), req, 0.0) == values
    assert chan.recv(0.0) == []


def test_plain_values_in_python_reads_the_same_entries_as_c_and_the_base_has_no_quick_path(
    shm_pair: tuple[ShmChannel, list[ShmWorkerChannel]],
) -> None:
    """The pure-Python look (``_values_py``) answers as C's Sender.values does, entry by
    entry: a reply past a wrap marker, a position a ring ahead, a header with flags."""
    chan, workers = shm_pair
    _pure(chan)
    workers[0].reply(_run_reply(3, 1))
    assert chan.plain_values((0,), 3, 0.0) == [1]
    assert chan.recv(0.0) == []
    q, w = chan._q, workers[0]
    w.reply(_run_reply(4, 2))
    end = q[w._rw_idx]
    q[w._rw_idx] = chan._reply_pos[0] + shm_channel.REPLY_RING + 8  # more than a ring ahead
    assert chan._values_py(chan._reply_pos, (0,), 4, chan._partial) is True
    q[w._rw_idx] = end
    assert chan.plain_values((0,), 4, 0.0) == [2]
    w.reply(_run_reply(4, 2), [memoryview(b"a buffer")])  # flags: buffers in the arena
    assert chan.plain_values((0,), 4, 0.0) is None
    assert [type(d) for _, d in chan.recv(0.0)] == [Reply]
    assert Channel.plain_values(chan, (0,), 3, 0.0) is None  # the base: no quick path


def test_the_pure_look_takes_the_rx_lock_only_once_another_thread_may_read_the_rings(
    shm_pair: tuple[ShmChannel, list[ShmWorkerChannel]],
) -> None:
    """Without worker 0 inline only the router's one reader reads the reply rings, and the
    pure look goes without the rx lock (a quarter of its cost); ``absorber`` (worker 0
    inline's make_room, called from any thread that sends) makes every later look take
    it, so that the two never read a ring at once."""
    chan, workers = shm_pair
    _pure(chan)

    def look_while_held(req: int) -> float:
        workers[0].reply(_run_reply(req, req))
        with held_elsewhere(chan._rx_lock) as release:
            threading.Timer(0.2, release.set).start()
            start = time.monotonic()
            assert chan.plain_values((0,), req, 1.0) == [req]
            return time.monotonic() - start

    assert look_while_held(1) < 0.15
    assert chan.absorber() == chan.absorb
    assert look_while_held(2) >= 0.15


@pytest.mark.parametrize("ring", ["C", "pure"])
def test_plain_values_waits_for_a_reply_that_comes_after_its_spin(
    shm_pair: tuple[ShmChannel, list[ShmWorkerChannel]], ring: str,
) -> None:
    """A call longer than the spin: the quick path sleeps as recv does, and a reply wakes
    it (the worker sees the controller's sleeping flag)."""
    chan, workers = shm_pair
    _ring(chan, ring)
    timer = threading.Timer(0.05, workers[0].reply, (_run_reply(4, 42),))
    start = time.monotonic()
    timer.start()
    try:
        assert chan.plain_values((0,), 4, 2.0) == [42]
    finally:
        timer.join()
    assert 0.04 < time.monotonic() - start < 1.5


@pytest.mark.parametrize("ring", ["C", "pure"])
def test_plain_values_never_sleeps_while_an_event_loop_waits_on_the_eventfd(
    shm_pair: tuple[ShmChannel, list[ShmWorkerChannel]], ring: str,
) -> None:
    """Its sleep would empty the eventfd an event loop waits on, and it reads only its own
    replies: with an await asleep it spins, then hands over to recv (which delivers all)."""
    chan, _ = shm_pair
    _ring(chan, ring)
    chan.async_waiting(True)
    try:
        start = time.monotonic()
        assert chan.plain_values((0,), 4, 0.5) is None
        assert time.monotonic() - start < 0.25  # the spin only (200 us), not the 0.5 s sleep
    finally:
        chan.async_waiting(False)
    start = time.monotonic()
    assert chan.plain_values((0,), 4, 0.3) is None
    assert time.monotonic() - start >= 0.25  # without one: recv's sleep, to its timeout


def _got(worker: ShmWorkerChannel) -> bytes:
    msg = worker.recv()
    assert msg is not None
    return bytes(msg[0])


def test_send_plain_in_c_publishes_a_plain_entry_or_writes_nothing_and_says_so(
    shm_pair: tuple[ShmChannel, list[ShmWorkerChannel]],
) -> None:
    """The session's quick send (Channel.send_plain) is the C ring's own send: True once
    the entry is out; False, with the head and the ring untouched, wherever send's slow
    path must decide (the arena's sizes, a rank it does not know, no room before the limit),
    and then send delivers it."""
    chan, workers = shm_pair
    if chan._fast is None:
        pytest.skip("UNISON_PURE is set" if shm_channel._native.pure_asked()
                    else "the C ring is not built here")
    assert chan.send_plain(b"both", (0, 1)) is True
    assert chan.send_plain(b"one", (1,)) is True
    assert _got(workers[0]) == b"both"
    assert [_got(workers[1]) for _ in range(2)] == [b"both", b"one"]
    big = b"x" * (shm_channel._INLINE_MAX + 1)
    head = chan._head.wpos
    for data, ranks in ((big, (0, 1)), (b"z", (0, 2)), (b"z", (-1,)), (b"z", [0, 1])):
        assert chan.send_plain(data, ranks) is False  # type: ignore[arg-type]
        assert chan._head.wpos == head
    assert workers[0].poll() is None and workers[1].poll() is None
    chan.send(big, (0, 1))  # send's slow path takes what send_plain left
    assert _got(workers[0]) == big
    assert _got(workers[1]) == big
    limit = chan._head.limit
    chan._head.limit = chan._head.wpos + 8  # as if the workers had read nothing since
    assert chan.send_plain(b"late", (0,)) is False
    chan._head.limit = limit
    assert chan.send_plain(b"late", (0,)) is True
    assert _got(workers[0]) == b"late"
    fast = chan._fast
    chan.close()
    with pytest.raises(ValueError, match="closed"):
        fast.send(b"after", (0,))


def test_send_plain_of_a_channel_without_its_own_is_send(
    shm_pair: tuple[ShmChannel, list[ShmWorkerChannel]],
) -> None:
    chan, workers = shm_pair
    _pure(chan)
    assert chan.send_plain(b"plain", (0,)) is True
    assert _got(workers[0]) == b"plain"
