"""timeout= abandons only the wait: TimeoutError comes quickly, the call keeps running,
later calls queue behind it, the Ref stays valid and the session stays usable."""

from __future__ import annotations

import threading
import time

import pytest

import unison
from unison import WorkerError

SLOW = 0.6  # seconds a slow call sleeps
SHORT = 0.1  # a timeout well below SLOW
QUICK = SHORT + 0.5  # how long a timed-out wait may take at most

@pytest.fixture(params=["auto", "pipe"])
def channel(request):
    """These behaviours must hold whatever channel carries the messages."""
    return request.param



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
