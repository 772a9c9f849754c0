"""Channel.send(..., deadline=): past the deadline a send gives up with TimeoutError and no
part of the message reaches any worker, so the session goes on as if it was never sent.
Workers are stopped with SIGSTOP (real processes that cannot drain their input)."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time
from collections.abc import Callable, Iterator

import pytest

import unison
from unison.channel import PartialSendError
from unison.protocol import NOP


@contextlib.contextmanager
def stopped(sess: unison.Session) -> Iterator[None]:
    pids = sess.run(os.getpid)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


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
