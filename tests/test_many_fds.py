"""Processes with fd numbers past 1023: select(2) refuses any fd at or above FD_SETSIZE
(1024), and a controller serving HTTP under load, or any program with a thousand files or
sockets open, has such fds; so may a worker whose user code opened many. Every wait of
unison's is in poll (unison._fdwait), which has no such limit. (test_mixed.py: the TCP
channel and a cluster's group collectives.)"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator

import pytest

import unison
from support import (
    HIGH_FD,
    barrier_after,
    fds_past_1023_possible,
    hold_fds_below,
    hold_fds_on_worker,
    nap_then_rank,
    release_fds_on_worker,
)
from unison import _fdwait

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not fds_past_1023_possible(), reason="RLIMIT_NOFILE's hard limit is "
                       f"under {HIGH_FD + 1024}"),
]


@pytest.fixture
def high_fds() -> Iterator[None]:
    """Every fd this process opens during the test is numbered HIGH_FD or more. Ask for it
    before the sessions' fixture: its teardown (which closes the fds it holds) comes after
    theirs."""
    undo = hold_fds_below(HIGH_FD)
    yield
    undo()


def ok(x: int) -> int:
    return x


@pytest.mark.parametrize("channel", ["shm", "pipe"])
def test_a_controller_with_fds_past_1023_runs_awaits_syncs_and_closes(
        high_fds: None, make_session: Callable[..., unison.Session], channel: str) -> None:
    """Before, the shm channel's start failed (its first recv slept in select), and on the
    pipe channel run, run_async and close raised ``ValueError: filedescriptor out of range
    in select()``."""
    sess = make_session(2, channel=channel)
    assert sess.run(ok, 1) == [1, 1]
    assert asyncio.run(sess.run_async(ok, 2)) == [2, 2]
    assert sess.run(nap_then_rank, 0.2) == [0, 1]  # the controller sleeps for the replies
    assert asyncio.run(sess.run_async(nap_then_rank, 0.2)) == [0, 1]
    sess.call(nap_then_rank, 0.2)
    sess.sync()  # the controller sleeps for the workers' progress
    assert sess.run(barrier_after, 0.1) == [0, 1]
    sess.close()
    assert sess.closed


def test_worker_0_inline_in_a_controller_with_fds_past_1023_watches_its_peers(
        high_fds: None) -> None:
    """Worker 0 inline waits in a collective looking at its peers' pidfds (opened then, so
    numbered past 1023 here)."""
    sess = unison.Session(2, inline_worker0=True)
    try:
        assert sess.run(barrier_after, 0.2) == [0, 1]
        assert sess.run(ok, 3) == [3, 3]
    finally:
        sess.close()


@pytest.mark.parametrize("channel", ["shm", "pipe"])
def test_workers_that_opened_fds_past_1023_go_on_and_close(
        make_session: Callable[..., unison.Session], channel: str) -> None:
    """User code on the workers opens more than 1024 files; the next calls (a wait for the
    next command, a collective whose peers wait) and the close still work."""
    sess = make_session(2, channel=channel)
    assert min(sess.run(hold_fds_on_worker, HIGH_FD)) >= HIGH_FD
    assert sess.run(ok, 1) == [1, 1]
    assert sess.run(barrier_after, 0.2) == [0, 1]
    assert asyncio.run(sess.run_async(nap_then_rank, 0.1)) == [0, 1]
    sess.call(nap_then_rank, 0.1)
    sess.sync()
    assert sess.run(release_fds_on_worker) == [1, 1]
    assert sess.run(ok, 2) == [2, 2]
    sess.close()


def test_poll_timeouts_keep_their_units() -> None:
    """Seconds to poll's milliseconds: rounded up (a small wait never becomes a busy loop of
    0), a negative one is 0 (never poll's -1, for ever), None blocks; a closed fd raises
    EBADF as select did."""
    assert _fdwait.poll_ms(None) is None
    assert _fdwait.poll_ms(0) == 0
    assert _fdwait.poll_ms(-1.0) == 0
    assert _fdwait.poll_ms(1e-6) == 1
    assert _fdwait.poll_ms(0.0101) == 11
    assert _fdwait.poll_ms(2.5) == 2500
    assert _fdwait.poll_ms(float("inf")) == 2**31 - 1
    r, w = os.pipe()
    try:
        start = time.monotonic()
        assert _fdwait.readable([r], 0.02) == []
        assert time.monotonic() - start >= 0.019
        assert _fdwait.poll_fds([r], [w], 0) == ([], [w])
        os.write(w, b"x")
        assert _fdwait.readable([r], None) == [r]
        assert _fdwait.FdSet([r]).readable() == [r]
        os.read(r, 1)
        os.close(w)
        w = -1
        assert _fdwait.FdSet([r]).readable() == [r]  # at end of file: readable, as select
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    with pytest.raises(OSError):
        _fdwait.readable([r])
    with pytest.raises(OSError):
        _fdwait.FdSet([r]).readable()


def test_a_signal_handlers_runtime_error_in_a_poll_set_wait_goes_on() -> None:
    """A poll object refuses a second thread's poll() with a RuntimeError, which FdSet
    answers with a poll of its own; a RuntimeError a signal handler raised in the wait was
    taken for that, eaten, and the wait began again (the handler's error lost)."""
    import signal
    import threading

    r, w = os.pipe()
    fds = _fdwait.FdSet([r])

    def raising(*_: object) -> None:
        raise RuntimeError("the handler's own")

    previous = signal.signal(signal.SIGUSR1, raising)
    timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="the handler's own"):
            fds.readable(2.0)
        assert time.monotonic() - start < 1.5
        got: list[list[int]] = []  # the other thread's case still works
        other = threading.Thread(target=lambda: got.append(fds.readable(0.5)))
        other.start()
        time.sleep(0.1)
        os.write(w, b"x")
        assert fds.readable(0.5) == [r]
        other.join()
        assert got == [[r]]
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, previous)
        os.close(r)
        os.close(w)
