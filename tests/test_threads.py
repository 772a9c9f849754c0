"""One Session used from many threads at once, like the handlers of a server: every result
is right, nothing deadlocks, and a long wait in one thread does not hold up the others."""

from __future__ import annotations

import gc
import os
import random
import signal
import threading
import time

import pytest

import unison

THREADS = 8
OPS = 50


def add(a, b):
    return a + b


def tag(x):
    return (unison.rank(), x)


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def _run_threads(target, count, timeout=60.0):
    errors = []
    start = threading.Barrier(count)

    def body(i):
        try:
            start.wait()
            target(i)
        except BaseException as exc:
            errors.append((i, exc))

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"threads deadlocked: {hung}"
    assert not errors, errors


def test_eight_threads_doing_mixed_work_all_get_the_right_results(make_session):
    sess = make_session(2)

    def worker(tid):
        rng = random.Random(tid)
        for i in range(OPS):
            x = tid * 1000 + i
            op = rng.randrange(7)
            if op == 0:
                assert sess.call(add, x, 1).gather() == [x + 1, x + 1]
            elif op == 1:
                assert sess.run(tag, x) == [(0, x), (1, x)]
            elif op == 2:
                ref = sess.put(x)
                assert sess.run(add, ref, ref) == [2 * x, 2 * x]
            elif op == 3:
                ref = sess.scatter([x, -x])
                assert ref.get(worker=1) == -x
                assert ref.get() == x
            elif op == 4:
                sess.call(add, x, x)
                sess.sync()
            elif op == 5:
                r = rng.randrange(2)
                assert sess[r].run(tag, x) == [(r, x)]
            else:
                assert sess.run(lambda v: v * 3 + unison.rank(), x) == [3 * x, 3 * x + 1]

    _run_threads(worker, THREADS)
    assert sess.run(unison.rank) == [0, 1]


@pytest.mark.parametrize("how", ["get", "run"])
def test_a_long_wait_in_one_thread_does_not_block_short_calls_on_other_workers(make_session,
                                                                               how):
    """Nor does run's quick path on worker 0 (which, on shared memory, sleeps on past other
    replies only where it waits for every worker's): a wait slice raised to 5 s makes a
    short call's wait behind it take 5 s, past the long call's end."""
    sess = make_session(2)
    sess._router.slice = 5.0
    done = {}

    def long_waiter():
        if how == "get":
            assert sess[0].call(sleep_then, 1.5, "long").get() == "long"
        else:
            assert sess[0].run(sleep_then, 1.5, "long") == ["long"]
        done["long"] = time.monotonic()

    def short_calls():
        time.sleep(0.1)  # the long wait is under way
        for i in range(20):
            assert sess[1].run(add, i, 1) == [i + 1]
        done["short"] = time.monotonic()

    t_long = threading.Thread(target=long_waiter)
    t_short = threading.Thread(target=short_calls)
    t_long.start()
    t_short.start()
    t_long.join(30)
    t_short.join(30)
    assert not t_long.is_alive() and not t_short.is_alive()
    assert set(done) == {"long", "short"}
    assert done["short"] < done["long"], "short calls on worker 1 waited behind worker 0"


def test_a_waiter_takes_over_reading_when_another_thread_times_out(make_session):
    sess = make_session(2)
    results = {}
    slow_ref = sess[0].call(sleep_then, 5, "never waited for")
    other_ref = sess[1].call(sleep_then, 0.6, "value")

    def impatient():
        try:
            slow_ref.get(timeout=0.2)
        except TimeoutError:
            results["impatient"] = "timed out"

    def patient():
        time.sleep(0.05)
        results["patient"] = other_ref.get(worker=1)

    threads = [threading.Thread(target=impatient), threading.Thread(target=patient)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {"impatient": "timed out", "patient": "value"}


def test_refs_dropped_from_many_threads_are_all_freed(make_session):
    sess = make_session(2)
    baseline = sess.run(unison.worker.object_count)

    def churn(tid):
        for i in range(50):
            ref = sess.put((tid, i))
            if i % 2:
                ref.free()
            del ref

    _run_threads(churn, THREADS)
    assert sess.run(unison.worker.object_count) == baseline


def fail(i):
    raise ValueError(f"failure {i}")


def test_concurrent_syncs_report_each_error_exactly_once(make_session):
    sess = make_session(2)
    for i in range(10):
        sess.call(fail, i)  # never fetched: each must surface at some sync, once
    seen = []
    lock = threading.Lock()

    def syncer(_):
        for _ in range(30):
            try:
                sess.sync()
            except unison.WorkerError as err:
                with lock:
                    seen.append(str(err.__cause__))

    _run_threads(syncer, THREADS)
    assert sorted(seen) == sorted(f"failure {i}" for i in range(10))
    assert sess.sync() is None


def test_close_while_threads_are_busy_ends_every_thread_with_session_closed(make_session):
    sess = make_session(2)
    outcomes = {}
    started = threading.Barrier(THREADS + 1)

    def busy(tid):
        started.wait()
        try:
            while True:
                sess.run(sleep_then, 0.01, tid)
        except BaseException as exc:
            outcomes[tid] = exc

    threads = [threading.Thread(target=busy, args=(i,), daemon=True) for i in range(THREADS)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.3)
    sess.close(timeout=0.5)
    for t in threads:
        t.join(5)
    assert not [t for t in threads if t.is_alive()], "threads hung after close()"
    assert all(isinstance(e, unison.SessionClosed) for e in outcomes.values()), outcomes


def rank_sum():
    return unison.allreduce(float(unison.rank() + 1))


def test_a_call_held_up_before_it_is_sent_never_overtakes_with_a_lower_id(make_session):
    """Call ids must grow in the order calls reach the workers: their collectives tell calls
    apart by id. Thread A is held up on its way to the send lock while thread B sends; had
    A taken its id before the lock, its call would arrive with the lower id, after B's, and
    their allreduces would take each other for peers that left."""
    sess = make_session(2)
    sess.run(rank_sum)
    plain = sess._send_lock

    class HoldsUpA:
        def acquire(self, *args, **kwargs):
            if threading.current_thread().name == "A":
                time.sleep(0.3)
            return plain.acquire(*args, **kwargs)

        def release(self):
            return plain.release()

        def _is_owned(self):
            return plain._is_owned()

        def __enter__(self):  # the send's with-statement (_send_quick)
            return self.acquire()

        def __exit__(self, *exc):
            self.release()

    got = {}

    def a():
        got["A"] = sess.run(rank_sum, timeout=15)

    def b():
        time.sleep(0.1)
        got["B"] = sess.call(rank_sum).gather(timeout=15)

    sess._send_lock = HoldsUpA()
    try:
        threads = [threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        sess._send_lock = plain
    assert got == {"A": [3.0, 3.0], "B": [3.0, 3.0]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("inner", ["call", "run"])
def test_a_del_the_garbage_collector_runs_inside_a_send_or_wait_is_refused(make_session,
                                                                            inner):
    """A ``__del__`` that tells the workers to drop their state, run by the cyclic garbage
    collector in the middle of the session's own send: the send lock is re-entrant, so the
    nested call got in and the outer run sent the inner call's function with its own
    arguments ([("drop", 2)] where ("ident", 2) was asked). Inside a wait, a nested run took
    the outer call's replies and waited for ever. Now the nested use raises RuntimeError
    (which Python prints as an ignored exception of __del__), and the outer call is right."""
    sess = make_session(2)
    refused: list[str] = []
    done: list[int] = []

    def ident(i):  # the script's own functions: sent by value, each proved current at a call
        return ("ident", i)

    def drop(key):  # counted on each worker: a refused call must never run
        import builtins
        builtins.unison_test_drops = getattr(builtins, "unison_test_drops", 0) + 1
        return ("drop", key)

    def drops():
        import builtins
        return getattr(builtins, "unison_test_drops", 0)

    class Remote:
        def __init__(self, key):
            self.key, self.me = key, self  # a cycle: only the cyclic collector frees it

        def __del__(self):
            try:
                if inner == "call":
                    sess.call(drop, self.key)
                else:
                    sess.run(drop, self.key, timeout=10)
                done.append(self.key)
            except RuntimeError as exc:
                refused.append(str(exc))

    old = gc.get_threshold()
    gc.set_threshold(3)  # collections land inside the session's steps often
    try:
        for i in range(300):
            Remote(-i)
            assert sess.run(ident, i) == [("ident", i)] * 2  # (no timeout: the quick path)
    finally:
        gc.set_threshold(*old)
        gc.collect()
    assert refused, "no collection landed inside a send or a wait"
    assert all("middle of its own send or wait" in r for r in refused)
    assert done  # outside the session's steps, a __del__'s call goes through
    sess.sync()
    assert sess.run(drops) == [len(done)] * 2  # (before, a run refused in a wait was sent)


class _SlowToPickle:
    def __reduce__(self):
        time.sleep(0.5)
        return (_SlowToPickle, ())


def _sleeper(s):
    time.sleep(s)
    return s


def test_a_call_whose_function_cannot_be_pickled_leaves_later_syncs_whole(make_session):
    """A call whose DEFINE raised (a closure over a lock) left its id as the one still on
    its way out, so every later sync stopped below it and returned quietly."""
    sess = make_session(2)
    sess.call(fail, 0)  # defined: its next call takes the quick path
    with pytest.raises(unison.WorkerError, match="failure 0"):
        sess.sync()
    lock = threading.Lock()
    with pytest.raises(TypeError):
        sess.call(lambda: lock)
    sess.call(fail, 1)
    with pytest.raises(unison.WorkerError, match="failure 1"):
        sess.sync()


def _count_on_worker():
    import builtins
    builtins.unison_test_counted = getattr(builtins, "unison_test_counted", 0) + 1


def _counted():
    import builtins
    return getattr(builtins, "unison_test_counted", 0)


def test_a_run_from_a_signal_handler_during_a_wait_is_refused_before_it_is_sent(make_session):
    """The refusal of a use inside the session's own wait came after the inner run's
    message had gone: the workers ran it, and its reply was read and thrown away."""
    sess = make_session(2)
    refused = []

    def handler(signum, frame):
        try:
            sess.run(_count_on_worker)
        except RuntimeError as exc:
            refused.append(str(exc))

    old = signal.signal(signal.SIGUSR1, handler)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        assert sess.run(time.sleep, 1.0) == [None, None]
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, old)
    assert refused and "middle of its own send or wait" in refused[0]
    assert sess.run(_counted) == [0, 0]


def test_a_sync_does_not_raise_the_error_of_a_call_still_on_its_way_out(make_session):
    """Thread B's call took its id under the send lock, then pickled its new function for
    0.5 s; thread A's sync began meanwhile, with a floor above B's id. A's sync raised B's
    error and B's own sync returned quietly. A call is a sync's only once it is sent, and
    B's sync must find the error although A's SYNC brought it in."""
    sess = make_session(2)
    sess.run(unison.rank)
    out = {}
    c_ref = sess.call(_sleeper, 1.5)
    tc = threading.Thread(target=lambda: out.setdefault("C", c_ref.get()))  # a GET in flight
    tc.start()
    time.sleep(0.1)
    slow = _SlowToPickle()

    def b_fails():
        slow  # noqa: B018  # captured: the function is pickled by value, slowly
        raise ValueError("B's call failed")

    def b():
        sess.call(b_fails)
        time.sleep(0.3)
        try:
            sess.sync()
            out["B"] = "quiet"
        except unison.WorkerError as e:
            out["B"] = str(e.__cause__)

    tb = threading.Thread(target=b)
    tb.start()
    time.sleep(0.1)  # B holds its id and the send lock, pickling
    try:
        sess.sync()
        out["A"] = "quiet"
    except unison.WorkerError as e:
        out["A"] = str(e.__cause__)
    tb.join(30)
    tc.join(30)
    assert out == {"C": 1.5, "A": "quiet", "B": "B's call failed"}
