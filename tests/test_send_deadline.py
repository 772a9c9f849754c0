"""Channel.send(..., deadline=): past the deadline a send gives up with TimeoutError and no
part of the message reaches any worker, so the session goes on as if it was never sent.
Workers are stopped with SIGSTOP (real processes that cannot drain their input)."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import pickle
import signal
import struct
import termios
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import unison
from support import raising_on_signal
from unison.channel import PartialSendError
from unison.protocol import NOP


@contextlib.contextmanager
def stopped(sess: unison.Session) -> Iterator[None]:
    pids = sess.run(os.getpid)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    for pid in pids:  # a stop takes effect a moment later: till then it may read on
        end = time.monotonic() + 5
        while _state(pid) != "T" and time.monotonic() < end:
            time.sleep(0.001)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _state(pid: int) -> str:
    """A process's state letter (/proc/PID/stat): T once stopped."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _fill_until_timeout(sess: unison.Session, msg: bytes) -> tuple[int, float]:
    """Send ``msg`` to every worker until a send times out: (sends that went, seconds the
    timed-out one took)."""
    chan = sess._chan
    for sent in range(100_000):
        start = time.monotonic()
        try:
            chan.send(msg, sess.workers, deadline=start + 0.2)
        except TimeoutError:
            return sent, time.monotonic() - start
    raise AssertionError("the channel never filled up")


@pytest.mark.parametrize("channel", ["shm", "pipe"])
def test_a_send_past_its_deadline_sends_nothing(
    make_session: Callable[..., unison.Session], channel: str
) -> None:
    sess = make_session(2, channel=channel)
    msg = pickle.dumps((NOP, None, b"x" * (64 << 10)))
    with stopped(sess), sess._send_lock:
        sent, took = _fill_until_timeout(sess, msg)
        assert sent > 0
        assert took < 2.0  # bounded by the deadline (generous for a loaded machine)
    # every message that went is whole, and the one that timed out left no trace
    assert sess.run(unison.rank) == [0, 1]
    assert sess.run(lambda: 3) == [3, 3]


def test_a_timed_out_send_places_no_buffer_in_the_arena(
    make_session: Callable[..., unison.Session],
) -> None:
    sess = make_session(2, channel="shm")
    arena = sess._chan.arena  # type: ignore[attr-defined]
    big = bytearray(8 << 20)
    msg = pickle.dumps((NOP, None, b"x" * (64 << 10)))
    with stopped(sess), sess._send_lock:
        _fill_until_timeout(sess, msg)
        _fill_until_timeout(sess, pickle.dumps((NOP, None)))  # smaller than what follows
        top = arena._top
        with pytest.raises(TimeoutError):
            sess._chan.send(pickle.dumps((NOP, None)), sess.workers,
                            [pickle.PickleBuffer(big)],
                            deadline=time.monotonic() + 0.1)
        assert arena._top == top
    assert sess.run(unison.rank) == [0, 1]


def test_a_pipe_frame_larger_than_the_pipe_may_fail_half_written_and_says_so(
    make_session: Callable[..., unison.Session],
) -> None:
    sess = make_session(1, channel="pipe")
    msg = pickle.dumps((NOP, None, b"x" * (8 << 20)))  # more than any pipe holds
    with stopped(sess), sess._send_lock, pytest.raises(PartialSendError):
        sess._chan.send(msg, sess.workers, deadline=time.monotonic() + 0.2)


def test_a_pipe_frame_that_keeps_moving_never_times_out(
    make_session: Callable[..., unison.Session],
) -> None:
    """The deadline of a send moves with each part the worker takes: a 256 MiB put that
    streams for longer than ``send_timeout`` goes through. Before (issue 9, forty-ninth
    pass; an audit of pauses), the session closed at the deadline, with the worker reading
    at full speed (it first zeroed a buffer as large, 0.3 s, before reading any: now it
    reads into mapped pages)."""
    sess = make_session(1, channel="pipe", send_timeout=0.25)
    big = np.ones(32 << 20)  # 256 MiB: longer than 0.25 s through a pipe here
    for _ in range(2):
        ref = sess.put(big)
        assert sess.run(lambda x: float(x.sum()), ref) == [float(big.size)]
        ref.free()


def _a_forked_childs_write_seen(a: np.ndarray) -> float:
    """Worker code: a child it forks writes into ``a``; what the worker then reads."""
    pid = os.fork()
    if pid == 0:
        a[:] = 7.0
        os._exit(0)
    os.waitpid(pid, 0)
    return float(a[0])


def test_a_buffer_a_pipe_worker_received_stays_its_own_across_a_fork(
    make_session: Callable[..., unison.Session],
) -> None:
    """A large argument a pipe worker reads into mapped pages: a child its code forks gets
    a copy, as of any other memory. Before (the review of issue 9's forty-ninth pass), the
    pages were mapped shared, and the child's write changed the worker's array."""
    sess = make_session(1, channel="pipe")
    for n in (1000, 4 << 20):  # 8 KB and 32 MiB (read into mapped pages from 16 MiB)
        assert sess.run(_a_forked_childs_write_seen, np.zeros(n)) == [0.0]


class _Alarm(Exception):
    """A signal handler's exception: a time limit on a block of user code."""


class _AlarmTimeout(TimeoutError):
    """The same as a TimeoutError, which must not pass for the channel's own deadline."""


@pytest.mark.parametrize("kind", [_Alarm, _AlarmTimeout, KeyboardInterrupt])
def test_an_exception_that_ends_a_pipe_send_half_way_closes_the_session(
    make_session: Callable[..., unison.Session], kind: type[BaseException]
) -> None:
    """A signal handler's exception while a send waits for room in a busy worker's command
    pipe, part of the frame in it: the session closes, and the exception goes on as it was
    raised, as a Ctrl-C does (its context the PartialSendError that says the message went
    in half). Before 2026-12-06, the exception went on with the session open, a
    TimeoutError was rewritten as "Nothing of it was sent", and the worker read the next
    frames as the rest of the half one: every later reply was lost (a hang); then, until
    signal handlers' exceptions were handled as Ctrl-C, it became a SessionClosed."""
    sess = make_session(1, channel="pipe")
    pid = sess.run(os.getpid)[0]
    os.kill(pid, signal.SIGSTOP)  # it reads nothing: the pipe fills, the send waits in it
    try:
        with raising_on_signal(kind, 0.3), pytest.raises(kind) as info:
            sess.call(len, b"x" * (8 << 20))  # more than the pipe holds
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert sess.closed
    assert type(info.value) is kind and info.value.args == ("time limit",)
    if kind is not KeyboardInterrupt:
        partial = info.value.__context__
        assert isinstance(partial, PartialSendError), repr(partial)
        assert "half sent to worker 0's command pipe" in str(partial)


@pytest.mark.parametrize("kind", [_Alarm, _AlarmTimeout])
def test_an_exception_that_ends_a_send_with_nothing_written_goes_on_as_it_is(
    make_session: Callable[..., unison.Session], kind: type[BaseException]
) -> None:
    """A handler's exception while a send with a deadline waits for room, nothing of it
    written: it goes on as it is (a TimeoutError too is the user's, not "Nothing of it was
    sent" of the deadline). The session closes, as for Ctrl-C: a signal handler's exception
    cannot tell where in the send it landed (just after the message went, as likely), so a
    time limit belongs in ``timeout=``."""
    sess = make_session(1, channel="pipe", send_timeout=30)
    msg = pickle.dumps((NOP, None, b"x" * (64 << 10)))
    with stopped(sess):
        with sess._send_lock:
            _fill_until_timeout(sess, msg)
        with raising_on_signal(kind, 0.3), pytest.raises(kind) as info:
            sess.call(len, b"y" * (64 << 10))
    assert str(info.value) == "time limit"
    assert sess.closed


def test_a_deadline_send_to_a_pipe_counts_its_pages_and_never_goes_in_half(
    make_session: Callable[..., unison.Session],
) -> None:
    """Linux counts a pipe's capacity in pages, and a frame that does not fit the last
    page's rest takes a new one: with frames of 3/4 page queued, the pipe had room by its
    bytes (FIONREAD) for a frame that it had not by its pages, so the frame went in half
    and its deadline closed the session (PartialSendError). Now it times out with nothing
    of it sent, and the session goes on."""
    sess = make_session(1, channel="pipe", send_timeout=0.2)
    chan = sess._chan
    fd = chan._cmd[0]  # type: ignore[attr-defined]
    page = mmap.PAGESIZE
    slots = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) // page
    if slots < 64:
        pytest.skip("the command pipe could not be grown (pipe-max-size)")
    small = pickle.dumps((NOP, None, b"x" * (page * 3 // 4)))
    big = pickle.dumps((NOP, None, b"y" * (20 * page)))
    with stopped(sess), sess._send_lock:
        for _ in range(slots - 16):  # a page each: 16 pages left
            chan.send(small, sess.workers)
        queued = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        assert slots * page - queued > len(big)  # room by the bytes alone
        with pytest.raises(TimeoutError, match="nothing of this message was sent"):
            chan.send(big, sess.workers, deadline=time.monotonic() + 0.2)
    assert not sess.closed
    assert sess.run(unison.rank, timeout=10) == [0]
