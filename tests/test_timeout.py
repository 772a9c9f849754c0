"""timeout= abandons only the wait: TimeoutError comes quickly, the call keeps running,
later calls queue behind it, the Ref stays valid and the session stays usable."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

import unison
from support import big_then_stopped
from unison import WorkerError

SLOW = 0.6  # seconds a slow call sleeps
SHORT = 0.1  # a timeout well below SLOW
QUICK = SHORT + 0.5  # how long a timed-out wait may take at most


def slow(seconds=SLOW):
    time.sleep(seconds)
    return (unison.rank(), time.monotonic())


def stamp():
    return time.monotonic()


def fail_after(seconds, message):
    time.sleep(seconds)
    raise ValueError(message)


def takes_its_own_timeout(x, timeout):
    return (x, timeout)


def _timed(fn, *args, **kwargs):
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        fn(*args, **kwargs)
    return time.monotonic() - start


def test_gather_with_a_timeout_raises_quickly_and_the_ref_stays_valid(sess):
    ref = sess.call(slow)
    assert _timed(ref.gather, timeout=SHORT) < QUICK
    values = ref.gather()
    assert [rank for rank, _ in values] == [0, 1]


def test_get_with_a_timeout_raises_quickly_and_the_ref_stays_valid(sess):
    ref = sess.call(slow)
    assert _timed(ref.get, worker=1, timeout=SHORT) < QUICK
    assert ref.get(worker=1)[0] == 1
    assert ref.get()[0] == 0


def test_sync_with_a_timeout_raises_quickly_then_a_later_sync_waits(sess):
    sess.call(slow)
    assert _timed(sess.sync, timeout=SHORT) < QUICK
    assert sess.sync() is None


def test_run_with_a_timeout_raises_quickly_and_the_session_goes_on(sess):
    assert _timed(sess.run, slow, timeout=SHORT) < QUICK
    assert sess.run(unison.rank, timeout=10) == [0, 1]


def test_a_timeout_of_zero_on_a_busy_worker_raises_at_once(sess):
    ref = sess.call(slow)
    assert _timed(ref.gather, timeout=0) < QUICK
    assert len(ref.gather()) == 2


def test_a_sync_with_timeout_zero_returns_where_everything_is_done(sess):
    """It raised "syncing timed out: worker(s) [] had not finished" (pipe: "had not
    answered", its report calling them idle): the deadline was checked before one look at
    the workers (an audit, 2026-12-07). Where one is busy it still raises at once."""
    sess.sync(timeout=0)  # nothing sent yet
    sess.run(unison.rank)
    sess.sync()
    for timeout in (0, 1e-9):
        assert sess.sync(timeout=timeout) is None
        assert sess[1].sync(timeout=timeout) is None
    sess.call(slow)
    with pytest.raises(TimeoutError, match=r"worker\(s\) \[0, 1\]"):
        sess.sync(timeout=0)
    sess.sync()


def blocks_the_stacks_signal():
    from unison.debug import stacks

    signal.pthread_sigmask(signal.SIG_BLOCK, [stacks.SIGNAL])


def test_the_report_of_where_they_are_keeps_a_timeout_short(sess):
    """A worker that blocks the stack dump's signal never answers it: the report of where
    the workers are waited 1 s for it, past the deadline, so ``timeout=0.1`` took 1.1 s
    (an audit, 2026-12-07). It waits 0.1 s now, and says the worker did not answer."""
    sess.run(blocks_the_stacks_signal)
    for wait in (lambda: sess.run(slow, timeout=SHORT), lambda: sess.sync(timeout=SHORT),
                 lambda: sess.call(slow).get(timeout=SHORT)):
        sess.call(slow)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="did not answer within"):
            wait()
        assert time.monotonic() - start < QUICK
        sess.sync()


def test_a_generous_timeout_returns_the_value(sess):
    ref = sess.call(slow, 0.1)
    assert [r for r, _ in ref.gather(timeout=30)] == [0, 1]
    assert sess.sync(timeout=30) is None


def test_later_calls_queue_behind_the_call_that_timed_out(sess):
    first = sess.call(slow)
    with pytest.raises(TimeoutError):
        first.gather(timeout=SHORT)
    second = sess.call(stamp)
    started = second.gather()
    finished = [t for _, t in first.gather()]
    for rank in (0, 1):
        assert started[rank] >= finished[rank]


def test_repeated_timeouts_then_the_value(sess):
    ref = sess.call(slow)
    for _ in range(3):
        with pytest.raises(TimeoutError):
            ref.gather(timeout=0.05)
    assert len(ref.gather()) == 2
    assert sess.run(unison.rank) == [0, 1]


def test_timed_out_requests_do_not_confuse_later_replies(sess):
    slow_ref = sess.call(slow, 0.5)
    for _ in range(3):
        with pytest.raises(TimeoutError):
            slow_ref.get(timeout=0.02)
    values = sess.scatter(["a", "b"])
    assert values.gather() == ["a", "b"]
    assert sess.put(3).gather() == [3, 3]


def test_a_function_with_its_own_timeout_keyword_goes_through_call(sess):
    ref = sess.call(takes_its_own_timeout, "x", timeout=123)
    assert ref.gather(timeout=30) == [("x", 123), ("x", 123)]
    assert sess[1].call(takes_its_own_timeout, 1, timeout=None).get(timeout=30) == (1, None)


def test_a_timeout_in_one_thread_does_not_disturb_a_waiter_in_another(sess):
    long_ref = sess[0].call(slow, 1.0)
    result = {}

    def wait_long():
        result["long"] = long_ref.get()

    waiter = threading.Thread(target=wait_long)
    waiter.start()
    other = sess[1].call(slow, 0.6)
    assert _timed(other.get, worker=1, timeout=SHORT) < QUICK
    waiter.join(10)
    assert not waiter.is_alive()
    assert result["long"][0] == 0
    assert other.get(worker=1)[0] == 1


# -- a timed-out wait loses no error ---------------------------------------------------------


def test_an_error_behind_a_timed_out_sync_surfaces_at_the_next_sync(sess):
    sess.call(fail_after, 0.3, "failed after the timeout")
    with pytest.raises(TimeoutError):
        sess.sync(timeout=0.05)
    with pytest.raises(WorkerError, match="failed after the timeout"):
        sess.sync()
    assert sess.sync() is None


def test_an_error_behind_a_timed_out_gather_surfaces_at_the_next_gather(sess):
    ref = sess.call(fail_after, 0.3, "failed after the timeout")
    with pytest.raises(TimeoutError):
        ref.gather(timeout=0.05)
    with pytest.raises(WorkerError, match="failed after the timeout"):
        ref.gather()
    assert sess.sync() is None


def test_an_error_behind_a_timed_out_gather_of_a_dropped_ref_surfaces_at_sync(sess):
    ref = sess.call(fail_after, 0.3, "nobody fetched this")
    with pytest.raises(TimeoutError):
        ref.gather(timeout=0.05)
    del ref  # the timed-out wait fetched nothing, so the error is still unreported
    with pytest.raises(WorkerError, match="nobody fetched this"):
        sess.sync()
    assert sess.sync() is None


def test_an_error_behind_a_timed_out_run_surfaces_at_sync(sess):
    with pytest.raises(TimeoutError):
        sess.run(fail_after, 0.3, "run gave up waiting", timeout=0.05)
    with pytest.raises(WorkerError, match="run gave up waiting"):
        sess.sync()
    assert sess.sync() is None


# -- a timeout bounds the whole method, even behind a sender blocked on a full queue ----------

BLOB = "x" * 400_000  # in-band (a str rides inside the PUT): five of these fill the command ring


def _fill_until_blocked(sess, worker, stop_at):
    """Send to a busy worker until the command queue is full (the call blocks)."""
    sent = 0
    while time.monotonic() < stop_at:
        sess[worker].put(BLOB)
        sent += 1
    return sent


@pytest.mark.parametrize("channel", ["shm"])
def test_a_get_timeout_holds_while_another_thread_is_blocked_sending(make_session, channel):
    sess = make_session(2, channel=channel)
    sess[0].call(time.sleep, 3.0)
    other = sess[1].call(unison.rank)
    blocked = threading.Event()
    outcome = {}

    def flood():
        try:
            blocked.set()
            for _ in range(40):  # 16 MB: far more than the ring holds
                sess[0].put(BLOB)
        except BaseException as exc:
            outcome["exc"] = exc

    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    blocked.wait()
    time.sleep(0.3)  # the sender is now waiting for room, holding the send lock
    for wait in (lambda: other.get(worker=1, timeout=0.5), lambda: sess.sync(timeout=0.5),
                 lambda: sess.run(unison.rank, timeout=0.5)):
        assert _timed(wait) < 0.5 + 0.5
    sender.join(10)
    assert not sender.is_alive()
    assert "exc" not in outcome, outcome  # the flood got through once the worker woke
    assert other.get(worker=1, timeout=10) == 1


@pytest.mark.parametrize("channel", ["shm"])
def test_send_timeout_gives_a_single_threaded_program_a_way_out(make_session, channel):
    sess = make_session(2, channel=channel, send_timeout=0.5)
    sess[0].call(time.sleep, 2.0)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="Nothing of it was sent"):
        _fill_until_blocked(sess, 0, start + 30)
    assert time.monotonic() - start < 10
    # the message that timed out was not half-sent: the session goes on, in lockstep
    assert sess.run(unison.rank, timeout=30) == [0, 1]
    assert sess.put(7).gather(timeout=30) == [7, 7]


def test_bad_timeouts_are_refused_before_anything_changes(sess):
    ref = sess.call(unison.rank)
    for bad, kind in ((float("nan"), ValueError), (-1, ValueError), ("1", TypeError),
                      (True, TypeError), ([1], TypeError)):
        for wait in (lambda t: ref.get(timeout=t), lambda t: ref.gather(timeout=t),
                     lambda t: sess.sync(timeout=t), lambda t: sess.run(unison.rank, timeout=t)):
            with pytest.raises(kind):
                wait(bad)
        with pytest.raises(kind):
            sess.close(timeout=bad)
        assert not sess.closed
    with pytest.raises(ValueError, match="finite"):
        sess.close(timeout=float("inf"))
    assert not sess.closed
    # an infinite wait is simply no deadline, and numpy numbers count as numbers
    import numpy as np

    assert ref.gather(timeout=float("inf")) == [0, 1]
    assert ref.gather(timeout=np.float32(5)) == [0, 1]
    assert ref.get(timeout=np.int64(5)) == 0
    assert sess.run(unison.rank) == [0, 1]


def test_a_timeout_past_a_floats_range_is_no_deadline(sess):
    """``timeout=10**400`` is longer than any wait, as inf is: it raised a bare "int too
    large to convert to float", naming no parameter (an audit, 2026-12-07)."""
    huge = 10**400
    ref = sess.call(slow, 0.1)
    assert [r for r, _ in ref.gather(timeout=huge)] == [0, 1]
    assert ref.get(timeout=huge)[0] == 0
    sess.call(slow, 0.1)
    assert sess.sync(timeout=huge) is None
    assert [r for r, _ in sess.run(slow, 0.1, timeout=huge)] == [0, 1]

    async def waits():
        assert [r for r, _ in await sess.run_async(slow, 0.1, timeout=huge)] == [0, 1]
        assert [r for r, _ in await sess.call(slow, 0.1).gather_async(timeout=huge)] == [0, 1]
        sess.call(slow, 0.1)
        await sess.sync_async(timeout=huge)

    asyncio.run(waits())
    with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
        sess.sync(timeout=-huge)
    with pytest.raises(ValueError, match="finite"):  # as for inf: a close must end
        sess.close(timeout=huge)
    assert not sess.closed


def test_bad_session_timeouts_are_refused_before_any_worker_starts(make_session):
    for kw in ({"start_timeout": float("nan")}, {"start_timeout": -1},
               {"send_timeout": -0.5}, {"send_timeout": "soon"}):
        with pytest.raises((TypeError, ValueError)):
            make_session(2, **kw)


def big_after(seconds):
    time.sleep(seconds)
    return b"r" * 70_000  # more than a pipe's 64 KiB


@pytest.mark.timeout(120)
def test_a_large_reply_nobody_waits_for_any_more_does_not_block_later_sends(sess):
    """A gather that timed out leaves its replies to come later, with nobody reading: on the
    pipe channel each worker then blocks writing its reply, reading no command, and a send
    larger than the command pipe's room waits for them unless it reads the replies while
    it waits (they go to a backlog, for the next wait)."""
    ref = sess.call(big_after, 0.3)
    with pytest.raises(TimeoutError):
        ref.gather(timeout=0.01)
    time.sleep(0.6)  # the replies are written now (or blocked half-written)
    refs = [sess.call(len, bytes([i]) * 300_000) for i in range(12)]
    assert [r.gather(timeout=30) for r in refs] == [[300_000, 300_000]] * 12
    assert ref.gather(timeout=30) == [b"r" * 70_000] * 2


@pytest.mark.timeout(60)
def test_a_reply_stopped_half_written_still_times_out_at_the_deadline(sess):
    """A worker stopped (SIGSTOP, or a thread holding its GIL) in the middle of writing a
    large reply is a hung worker like any other: the wait raises at its deadline, rather
    than blocking on the rest of a reply that does not come."""
    ref = sess.call(big_then_stopped, 8 << 20, 0.3)
    with pytest.raises(TimeoutError):
        ref.gather(timeout=0)  # asks for the value (8 MiB: more than a pipe holds) and
    time.sleep(0.8)  # leaves: the workers stop while blocked writing the reply nobody reads
    took = _timed(ref.gather, timeout=0.5)
    assert took < 0.5 + 1.0, took


def test_a_signal_handlers_bare_timeout_error_in_a_run_goes_on_as_it_is(sess):
    """A signal handler's bare ``raise TimeoutError`` (a time limit on a block) ending a
    run's wait: run put its function's name before the error's first argument, which it
    had not, and raised IndexError instead."""
    def on_signal(*_):
        raise TimeoutError

    old = signal.signal(signal.SIGUSR1, on_signal)  # (SIGALRM is pytest-timeout's)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    try:
        with pytest.raises(TimeoutError) as info:
            sess.run(time.sleep, 3)
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGUSR1, old)
    assert info.value.args == ()


def test_session_timeouts_past_a_floats_range_or_of_any_real_kind_are_taken_as_checked(
        make_session):
    """The session checked send_timeout and hang_timeout, then kept the value given: with
    ``send_timeout=10**400`` every call raised "int too large to convert to float", with
    ``hang_timeout=10**400`` the start failed in the watchdog's arithmetic, a Fraction
    made the HangError a TypeError of its message's format, and a start_timeout of 1e10 s
    on 2 local workers overflowed the zygote's socket timeout (an audit of timeouts, issue
    9, forty-eighth pass)."""
    from fractions import Fraction

    sess = make_session(2, send_timeout=10**400, hang_timeout=10**400, start_timeout=1e10)
    assert sess.call(unison.rank).gather(timeout=30) == [0, 1]
    assert sess.put(7).gather() == [7, 7]
    hung = make_session(2, hang_timeout=Fraction(1, 2))
    with pytest.raises(unison.HangError, match=r"no progress for 0\.5 s"):
        hung.run(time.sleep, 30, timeout=20)
