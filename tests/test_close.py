"""close(): idempotent; lets calls in flight finish for a grace period, then stops the
workers; happens on leaving a with-block, at garbage collection and at interpreter exit;
after it every use raises SessionClosed."""

from __future__ import annotations

import atexit
import concurrent.futures
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

import unison
from support import FORKS_ON_PURPOSE, open_fds, wait_gone
from unison import SessionClosed
from unison.session.router import Request


def write_after(path, seconds):
    time.sleep(seconds)
    with open(os.path.join(path, f"worker-{unison.rank()}"), "w") as f:
        f.write("done")
    return unison.rank()


def test_close_is_idempotent(sess):
    pids = sess.run(os.getpid)
    sess.close()
    sess.close()
    sess.close(timeout=0)
    assert sess.closed
    assert wait_gone(pids, 2.0) == []


def test_close_from_two_threads_at_once(sess):
    pids = sess.run(os.getpid)
    errors = []

    def close():
        try:
            sess.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=close) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    assert sess.closed
    assert wait_gone(pids, 2.0) == []


def test_close_stops_the_workers(sess):
    pids = sess.run(os.getpid)
    sess.close()
    assert wait_gone(pids, 2.0) == []


def test_close_releases_every_file_descriptor_the_session_opened():
    gc.collect()
    before = open_fds()
    sess = unison.Session(2)
    sess.run(unison.rank)
    sess.close()
    leaked = open_fds() - before
    assert not leaked, f"left open after close(): {sorted(leaked)}"


@pytest.mark.parametrize("step", ["drain", "fail_all"])
def test_a_close_whose_reply_step_raises_still_releases_everything(monkeypatch, step):
    """A done callback that raises inside close (in drain, or as the waits are failed) is
    raised, but only after every fd is closed and the session has left the live set."""
    from unison.session import api
    from unison.session.router import Router

    real = getattr(Router, step)

    def raising(self, *args):
        real(self, *args)
        raise RuntimeError(f"a callback raised in {step}")

    gc.collect()
    before = open_fds()
    sess = unison.Session(2)
    pids = sess.run(os.getpid)
    monkeypatch.setattr(Router, step, raising)
    with pytest.raises(RuntimeError, match=f"raised in {step}"):
        sess.close()
    monkeypatch.undo()
    assert sess.closed and sess not in api._live
    assert wait_gone(pids, 2.0) == []
    leaked = open_fds() - before
    assert not leaked, f"left open after close(): {sorted(leaked)}"


def test_every_use_after_close_raises_session_closed(sess):
    ref = sess.put(1)
    view = sess[0]
    sess.close()
    uses = {
        "call": lambda: sess.call(unison.rank),
        "run": lambda: sess.run(unison.rank),
        "put": lambda: sess.put(1),
        "scatter": lambda: sess.scatter([1, 2]),
        "sync": lambda: sess.sync(),
        "get": lambda: ref.get(),
        "gather": lambda: ref.gather(),
        "index": lambda: sess[0],
        "slice": lambda: sess[0:1],
        "group": lambda: sess.group(0),
        "view.call": lambda: view.call(unison.rank),
        "view.run": lambda: view.run(unison.rank),
        "view.sync": lambda: view.sync(),
        "view.put": lambda: view.put(1),
        "view.scatter": lambda: view.scatter([1]),
    }
    for name, use in uses.items():
        with pytest.raises(SessionClosed):
            use()
            pytest.fail(f"{name} worked after close")


def test_freeing_and_dropping_refs_after_close_is_harmless(sess):
    ref, other = sess.put(1), sess.put(2)
    sess.close()
    ref.free()
    ref.free()
    del other
    gc.collect()


def test_a_with_block_closes_the_session():
    with unison.Session(2) as sess:
        pids = sess.run(os.getpid)
    assert sess.closed
    assert wait_gone(pids, 2.0) == []


def test_a_with_block_closes_the_session_when_the_block_raises():
    with pytest.raises(KeyError), unison.Session(2) as sess:
        pids = sess.run(os.getpid)
        raise KeyError("from the block")
    assert sess.closed
    assert wait_gone(pids, 2.0) == []


def test_close_lets_a_short_call_in_flight_finish(sess, tmp_path):
    sess.call(write_after, str(tmp_path), 0.3)
    sess.close(timeout=5)
    assert sorted(os.listdir(tmp_path)) == ["worker-0", "worker-1"]


def test_close_with_a_default_grace_lets_a_short_call_finish(sess, tmp_path):
    sess.call(write_after, str(tmp_path), 0.2)
    sess.close()
    assert sorted(os.listdir(tmp_path)) == ["worker-0", "worker-1"]


def test_close_stops_a_long_call_after_the_grace_period(sess, tmp_path):
    pids = sess.run(os.getpid)
    sess.call(write_after, str(tmp_path), 30)
    start = time.monotonic()
    sess.close(timeout=0.3)
    assert time.monotonic() - start < 2.5
    assert wait_gone(pids, 1.0) == []
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("grace", [1e10, sys.maxsize, 1e300])
def test_close_with_a_grace_past_what_a_lock_waits_stops_the_workers(sess, tmp_path, grace):
    """A grace past threading.TIMEOUT_MAX (some 292 years) raised OverflowError from the
    send lock's acquire after the session was marked closed: later closes returned at once
    and the workers lived until the controller exited (an audit, 2026-12-07)."""
    pids = sess.run(os.getpid)
    sess.call(write_after, str(tmp_path), 0.2)
    sess.close(timeout=grace)
    assert sorted(os.listdir(tmp_path)) == ["worker-0", "worker-1"]  # a grace all the same
    assert wait_gone(pids, 2.0) == []


def test_close_from_another_thread_wakes_a_waiter_with_session_closed(sess):
    ref = sess.call(write_after, "/nonexistent", 30)
    outcome = {}

    def wait():
        try:
            ref.gather()
        except BaseException as exc:
            outcome["exc"] = exc

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    sess.close(timeout=0)
    waiter.join(5)
    assert not waiter.is_alive(), "the waiter hung after close()"
    assert isinstance(outcome.get("exc"), SessionClosed), outcome


class _SignalInside:
    """``lock`` as its owner takes it, but ``signum`` is raised once it is held (the signal
    landing between the ``with`` and its body); a second acquire gives up after 2 s
    (``stuck``) rather than hang: a plain Lock taken again by the thread that holds it."""

    def __init__(self, lock, signum=signal.SIGTERM):
        self.lock, self.signum, self.fired, self.stuck = lock, signum, False, False

    def __enter__(self):
        if not self.lock.acquire(timeout=2):
            self.stuck = True
            raise RuntimeError("the lock's own thread waited for it: deadlocked")
        if not self.fired:
            self.fired = True
            try:
                signal.raise_signal(self.signum)
            except BaseException:
                self.lock.release()
                raise

    def __exit__(self, *exc):
        self.lock.release()


@pytest.mark.parametrize("where", ["close", "salvage"])
def test_a_signal_handlers_close_landing_inside_a_locked_step_returns(sess, where):
    """A SIGTERM handler that closes the session (as services write), the signal landing
    while the main thread holds one of the locks that close takes: the session's state lock
    (inside close itself: a SIGTERM as a with-block exits) or the router's (keeping the errors
    of a timed-out call's late reply; close's drain does that too). Both were plain Locks:
    the handler, on the thread that held one, waited for it for ever."""
    pids = sess.run(os.getpid)
    owner = sess if where == "close" else sess._router
    lock = owner._state_lock
    inside = _SignalInside(lock)
    owner._state_lock = inside
    closed = []
    previous = signal.signal(signal.SIGTERM, lambda *_: closed.append(sess.close()))
    try:
        if where == "close":
            sess.close()
        else:
            sess._router.abandon(Request(0, 0))
    finally:
        signal.signal(signal.SIGTERM, previous)
        owner._state_lock = lock
    assert inside.fired and not inside.stuck
    assert closed == [None] and sess.closed
    assert wait_gone(pids, 2.0) == []
    with pytest.raises(SessionClosed):
        sess.run(os.getpid)


@pytest.fixture
def closing_on_sigusr1(sess):
    """A SIGUSR1 handler that closes ``sess`` (as a SIGTERM handler in a service would;
    SIGALRM is pytest-timeout's); what each close returned, in order."""
    closed = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: closed.append(sess.close()))
    yield closed
    signal.signal(signal.SIGUSR1, previous)


@pytest.mark.timeout(30)  # (pipe's drain waited for ever for the read's own rx lock)
def test_a_signal_handlers_close_during_a_wait_raises_session_closed(sess, closing_on_sigusr1):
    """The handler's close released the ring's memory under the wait it interrupted (the
    wait's locks are the handler's thread's, so close went through): the wait then raised
    the released memoryview's ValueError, not SessionClosed."""
    pids = sess.run(os.getpid)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    try:
        with pytest.raises(SessionClosed, match="the session is closed"):
            sess.run(time.sleep, 2)
    finally:
        timer.cancel()
    assert closing_on_sigusr1 == [None]
    assert wait_gone(pids, 2.0) == []


@pytest.mark.parametrize("channel", ["shm"])  # (its rx lock)
def test_a_signal_handlers_close_inside_a_read_neither_hangs_nor_reads(sess, closing_on_sigusr1):
    """The signal lands while the wait reads the ring, under the channel's rx lock: close's
    drain (reading the workers' goodbye) took that lock again, a plain one, in the thread
    that held it, for ever. A close inside this thread's own read leaves the reading out."""
    pids = sess.run(os.getpid)
    inside = _SignalInside(sess._chan._rx_lock, signal.SIGUSR1)
    sess._chan._rx_lock = inside
    with pytest.raises(SessionClosed, match="the session is closed"):
        sess.run(time.sleep, 0.3, timeout=10)  # (a deadline: the router's wait, its recv)
    assert inside.fired and not inside.stuck
    assert closing_on_sigusr1 == [None]
    assert wait_gone(pids, 2.0) == []


def test_a_signal_handlers_close_inside_a_send_raises_session_closed(sess, closing_on_sigusr1,
                                                                     monkeypatch):
    """The signal lands while a send holds the send lock: close's goodbye went into the
    stream amid the message, and the send then wrote to the released ring (ValueError).
    Now close sends nothing there and stops the workers at once, and the send raises
    SessionClosed."""
    pids = sess.run(os.getpid)
    sess.call(time.sleep, 10)  # busy workers: a goodbye would wait out the grace for them
    send = sess._chan.send

    def signalled(*args, **kwargs):
        signal.raise_signal(signal.SIGUSR1)
        return send(*args, **kwargs)

    monkeypatch.setattr(sess._chan, "send", signalled)
    start = time.monotonic()
    with pytest.raises(SessionClosed, match="the session is closed"):
        sess.put(b"x" * 100_000)
    assert time.monotonic() - start < 2.5  # (no grace spent waiting for workers to exit)
    assert closing_on_sigusr1 == [None]
    assert wait_gone(pids, 2.0) == []


def test_a_closed_channels_looks_answer_nothing_and_raise_nothing(sess):
    """The looks an await or a sync makes without the router's lock, on a channel another
    thread closed: 'nothing pending', 'not settled' (the caller's long way then says the
    session closed), and no flag to raise; never the released mapping's ValueError or a
    closed fd's OSError."""
    chan = sess._chan
    sess.run(os.getpid)
    sess.close()
    assert chan.pending() is False
    assert chan.settled(sess.workers, 0.01) is False
    assert chan.async_waiting(True) is None
    assert chan.async_waiting(False) is None
    if chan.tracks_progress:
        assert chan.wait_done(sess.workers, 0, 0.01) is False
    with pytest.raises(SessionClosed):
        sess.sync()


@pytest.mark.parametrize("channel", ["auto", "pipe"])
def test_garbage_collection_closes_the_session(channel):
    sess = unison.Session(2, channel=channel)
    pids = sess.run(os.getpid)
    del sess
    gc.collect()
    assert wait_gone(pids, 2.0) == []


@pytest.mark.parametrize("inline", [False, True])
def test_the_last_reference_dropped_closes_the_session_at_once(inline):
    """Without the cycle collector: the router and the waits held the session itself, a
    reference cycle, so a dropped session stayed open (workers running, about 29 fds held)
    until gc ran, and a function that opened an inline session and returned left the
    process's inline slot taken (an audit, issue 9, forty-seventh pass)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(2):  # the second: the inline slot was given back
            sess = unison.Session(2, inline_worker0=inline)
            pids = [p for p in sess.run(os.getpid) if p != os.getpid()]
            sess.call(lambda: 1 / 0)  # never fetched: the close warns of it
            with pytest.warns(RuntimeWarning, match="nobody fetched that error"):
                del sess
            assert wait_gone(pids, 3.0) == []
    finally:
        if enabled:
            gc.enable()


def test_a_session_in_a_cycle_of_the_users_closes_at_collection(tmp_path):
    """A session the cycle collector finds (its owner in a cycle), traced, a call running:
    it closes cleanly, and says why the trace lacks the workers' events (still in a call).
    The collector clears weak references before __del__ runs, and the router's was the
    session's: its looks at the workers failed on the dead proxy, and the trace's loss was
    put down to "weakly-referenced object no longer exists" (a review of the forty-seventh
    pass)."""
    class Box:
        pass

    box = Box()
    box.me = box  # type: ignore[attr-defined]
    box.sess = unison.Session(2, trace=tmp_path / "trace.json")  # type: ignore[attr-defined]
    pids = box.sess.run(os.getpid)  # type: ignore[attr-defined]
    box.sess.call(time.sleep, 1.5)  # type: ignore[attr-defined]
    del box
    ignored: list[object] = []
    hook, sys.unraisablehook = sys.unraisablehook, ignored.append
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            gc.collect()
    finally:
        sys.unraisablehook = hook
    assert ignored == []  # no "Exception ignored in __del__"
    texts = [str(w.message) for w in said]
    assert not any("weakly-referenced" in t for t in texts), texts
    assert any("still in a call" in t for t in texts), texts
    assert wait_gone(pids, 3.0) == []


@pytest.mark.parametrize("channel", ["auto", "pipe"])
def test_garbage_collection_closes_a_session_with_calls_in_flight(channel):
    sess = unison.Session(2, channel=channel)
    pids = sess.run(os.getpid)
    sess.call(time.sleep, 30)
    del sess
    gc.collect()
    assert wait_gone(pids, 3.0) == []


@pytest.mark.parametrize("tail", [
    "",
    "ref = sess.call(time.sleep, 0.1)\n",
    "ref = sess.call(time.sleep, 30)\n",
], ids=["idle", "short-call-in-flight", "long-call-in-flight"])
@pytest.mark.parametrize("channel", ["auto", "pipe"])
def test_interpreter_exit_closes_a_session_never_closed(tail, channel):
    code = textwrap.dedent(
        f"""
        import os, time
        import unison
        sess = unison.Session(2, channel={channel!r})
        print(*sess.run(os.getpid), flush=True)
        """
    ) + tail
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, timeout=30, env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2
    assert wait_gone(pids, 2.0) == []


@pytest.mark.parametrize("channel", ["auto", "pipe"])
def test_close_is_not_held_up_by_a_thread_blocked_sending_to_a_busy_worker(
    make_session, channel
):
    sess = make_session(2, channel=channel)
    pids = sess.run(os.getpid)
    sess.call(time.sleep, 8)  # the workers are busy, so what is sent next piles up
    outcome = {}

    def flood():
        try:
            for _ in range(300):  # 30 MB: more than any channel buffers
                sess.put("x" * 100_000)  # a str: in-band, inside the PUT
        except BaseException as exc:
            outcome["exc"] = exc

    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    time.sleep(0.5)
    start = time.monotonic()
    sess.close(timeout=0.3)
    took = time.monotonic() - start
    sender.join(5)
    assert took < 3.0, f"close(timeout=0.3) took {took:.1f} s"
    assert wait_gone(pids, 1.0) == []
    assert not sender.is_alive(), "the sending thread hung after close()"
    assert isinstance(outcome.get("exc", SessionClosed("")), SessionClosed), outcome


@FORKS_ON_PURPOSE
def test_a_forked_child_exiting_leaves_the_parents_workers_alone(make_session):
    sess = make_session(2)
    pid = os.fork()
    if pid == 0:  # the child's copy of the session closes at exit, and must not touch them
        try:
            sess.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert sess.run(unison.rank) == [0, 1]


# -- an error nobody fetched is not dropped at close() or exit --------------------------------


def fails_on(rank, message):
    if unison.rank() == rank:
        raise ValueError(message)
    return unison.rank()


def test_close_warns_about_an_error_nobody_fetched_naming_call_and_worker(make_session):
    sess = make_session(2)
    sess.call(fails_on, 1, "nobody looked at this")
    sess.call(unison.rank).gather()  # the failed call has run, its error is still unfetched
    with pytest.warns(RuntimeWarning, match=r"fails_on raised ValueError: nobody looked at "
                                            r"this on worker\(s\) \[1\]"):
        sess.close()


def test_a_with_block_that_raises_still_says_the_errors_nobody_fetched(channel):
    """Leaving a with block on an exception closes with a short grace, not none: idle
    workers still hand over the errors nobody fetched (before, they were lost in silence)."""
    with (pytest.warns(RuntimeWarning, match=r"fails_on raised ValueError: unseen"),
          pytest.raises(KeyError), unison.Session(2, channel=channel) as sess):
        sess.call(fails_on, 1, "unseen")
        sess.call(unison.rank).gather()
        raise KeyError("the block's own error")


def test_warnings_as_errors_a_with_blocks_own_error_goes_on_with_the_close_warnings_as_notes(
        channel):
    """Under -W error the close's warning of an error nobody fetched replaced the block's
    own exception; now that exception goes on, the warning as its note."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(KeyError) as info, unison.Session(2, channel=channel) as sess:
            sess.call(fails_on, 1, "unseen")
            sess.call(unison.rank).gather()
            raise KeyError("the block's own error")
    assert "fails_on raised ValueError: unseen" in "".join(getattr(info.value, "__notes__", []))
    assert sess.closed


def test_close_without_grace_says_that_errors_were_left_behind(make_session):
    """close(timeout=0) stops the workers at once, so it cannot collect their errors; where
    the channel shows that a worker held some (shared memory), it says so."""
    sess = make_session(2, channel="shm")
    sess.call(fails_on, 1, "left behind")
    sess.call(unison.rank).gather()
    with pytest.warns(RuntimeWarning, match=r"worker\(s\) \[1\] held errors of calls nobody "
                                            r"fetched"):
        sess.close(timeout=0)


def test_close_says_errors_held_by_workers_that_went_busy(make_session, channel):
    """The pipe channel knew a worker held an error only from reports it had read: one
    waiting unread in the pipe (the worker reported it when idle, then took a long call)
    was lost at close with no warning (an audit, issue 9, forty-seventh pass)."""
    sess = make_session(2, channel=channel)
    sess.call(fails_on, 1, "reported, then busy")
    time.sleep(1.0)  # the call has failed and the idle worker reported it
    sess.call(time.sleep, 30)
    with pytest.warns(RuntimeWarning, match=r"worker\(s\) \[1\] held errors of calls nobody "
                                            r"fetched"):
        sess.close(timeout=0.2)


def test_close_does_not_warn_about_errors_that_were_fetched(make_session, recwarn):
    sess = make_session(2)
    ref = sess.call(fails_on, 0, "seen")
    with pytest.raises(unison.WorkerError):
        ref.gather()
    sess.call(fails_on, 1, "seen at sync")
    with pytest.raises(unison.WorkerError):
        sess.sync()
    sess.close()
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("errors", [False, True])
def test_interpreter_exit_warns_about_an_error_nobody_fetched(controller, errors):
    """With ``errors``, warnings are errors (-W error): the close's warning is raised out
    of atexit (which prints it), not swallowed as before."""
    proc = controller(f"""
        import warnings
        import unison

        if {errors}:
            warnings.simplefilter("error")

        def boom():
            raise KeyError("lost at exit")

        sess = unison.Session(2)
        sess.call(boom)
        sess.run(unison.rank)
    """)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "RuntimeWarning" in err and "boom raised KeyError" in err, err


def test_warnings_as_errors_still_say_every_error_nobody_fetched(make_session):
    """Under -W error (pytest's filterwarnings = error) close raises the first error's
    RuntimeWarning, the others' as its notes, once the workers are stopped. Before, the
    raised warning was swallowed as if the interpreter were shutting down: nothing said."""
    sess = make_session(2)
    sess.call(fails_on, 0, "first unseen")
    sess.call(fails_on, 1, "second unseen")
    pids = sess.run(os.getpid)  # both calls have run: their errors are still unfetched
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="first unseen") as info:
            sess.close()
    assert "second unseen" in "".join(getattr(info.value, "__notes__", [])), info.value
    assert sess.closed
    assert wait_gone(pids, 2.0) == []


_KEPT: list = []


def keep_open(base: str) -> None:
    """A file written and kept open in a global, never flushed nor closed by the user."""
    f = open(f"{base}-kept-{unison.rank()}", "w")  # noqa: SIM115 (kept open on purpose)
    f.write("every word\n" * 100)
    _KEPT.append(f)


def write_at_exit(base: str, seconds: float = 0.0) -> None:
    def ending() -> None:
        time.sleep(seconds)
        with open(f"{base}-atexit-{unison.rank()}", "w") as f:
            f.write("ran")

    atexit.register(ending)


@pytest.mark.parametrize("n", [1, 2], ids=["own-interpreter", "forked"])
def test_a_workers_end_runs_its_atexit_functions_and_loses_no_write(make_session, tmp_path,
                                                                    n):
    """A worker ends as a Python program ends: its atexit functions run (logging's flush
    among them) and a file it kept open keeps its writes. Before, a lone worker (an
    interpreter of its own) ran atexit but lost the file's buffered text, and forked
    workers (N > 1) lost both."""
    base = str(tmp_path / "w")
    sess = make_session(n)
    sess.run(keep_open, base)
    sess.run(write_at_exit, base)
    sess.close()  # returns once the workers have exited
    for rank in range(n):
        assert (tmp_path / f"w-kept-{rank}").read_text() == "every word\n" * 100
        assert (tmp_path / f"w-atexit-{rank}").read_text() == "ran"


def write_later(base: str, seconds: float) -> None:
    """A non-daemon thread and a thread pool's queued job, each writing a file a while
    after the call returned."""
    def later(what: str) -> None:
        time.sleep(seconds)
        with open(f"{base}-{what}-{unison.rank()}", "w") as f:
            f.write("ran")

    threading.Thread(target=later, args=("thread",)).start()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool.submit(time.sleep, seconds)
    pool.submit(later, "pool")  # queued behind the first


@pytest.mark.parametrize("n", [1, 2], ids=["own-interpreter", "forked"])
def test_a_workers_end_waits_for_its_non_daemon_threads(make_session, tmp_path, n):
    """As a Python program (and a multiprocessing child) ends: the user's non-daemon
    threads finish, a thread pool's queued work among them, within the close's grace.
    Before, the worker ended at once and they were cut off without a word."""
    base = str(tmp_path / "w")
    sess = make_session(n)
    sess.run(write_later, base, 0.3)
    start = time.monotonic()
    sess.close(timeout=10)
    assert time.monotonic() - start < 5.0
    for rank in range(n):
        assert (tmp_path / f"w-thread-{rank}").read_text() == "ran"
        assert (tmp_path / f"w-pool-{rank}").read_text() == "ran"


@pytest.mark.parametrize("stays", [write_at_exit, write_later],
                         ids=["atexit-function", "non-daemon-thread"])
def test_an_end_that_never_comes_is_cut_off_by_the_grace(make_session, tmp_path, stays):
    """An atexit function that hangs, or a non-daemon thread that never ends."""
    sess = make_session(2)
    pids = sess.run(os.getpid)
    sess.run(stays, str(tmp_path / "w"), 60.0)
    start = time.monotonic()
    sess.close(timeout=0.5)
    assert time.monotonic() - start < 3.0
    assert wait_gone(pids, 2.0) == []
    assert not list(tmp_path.iterdir())
