"""Ctrl-C at the controller: it stops with one KeyboardInterrupt traceback (never one per
worker), and its workers are gone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time

import pytest

import unison
from support import read_pids, wait_gone

IN_A_LONG_CALL = """
    import os, time
    import unison
    sess = unison.Session(2)
    print(*sess.run(os.getpid), flush=True)
    sess.run(time.sleep, 60)
"""

IN_A_LONG_GATHER_OF_SPINNING_WORKERS = """
    import os
    import unison

    def spin():
        while True:
            pass

    sess = unison.Session(2)
    print(*sess.run(os.getpid), flush=True)
    sess.call(spin).gather()
"""

WHILE_IDLE = """
    import os, time
    import unison
    sess = unison.Session(2)
    print(*sess.run(os.getpid), flush=True)
    time.sleep(60)
"""

IN_A_WITH_BLOCK = """
    import os, time
    import unison
    with unison.Session(2) as sess:
        print(*sess.run(os.getpid), flush=True)
        sess.run(time.sleep, 60)
"""


@pytest.mark.parametrize(
    "script",
    [IN_A_LONG_CALL, IN_A_LONG_GATHER_OF_SPINNING_WORKERS, WHILE_IDLE, IN_A_WITH_BLOCK],
    ids=["long-call", "spinning-workers", "idle", "with-block"],
)
def test_sigint_stops_the_controller_with_one_traceback_and_no_worker_survives(
    controller, script
):
    proc = controller(script, start_new_session=True)
    pids = read_pids(proc)
    time.sleep(0.3)  # the long call is under way
    os.kill(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail("the controller did not stop within 10 s of SIGINT")
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err
    assert err.count("Traceback") <= 1, err
    worker_lines = [line for line in err.splitlines() if line.startswith("[worker")]
    assert not worker_lines, err
    assert wait_gone(pids, 2.0) == []


def test_ctrl_c_during_a_wait_stops_the_workers_and_closes_the_session(make_session):
    sess = make_session(2)
    pids = sess.run(os.getpid)
    ref = sess.call(time.sleep, 30)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ref.gather()
    finally:
        timer.cancel()
    assert wait_gone(pids, 2.0) == []
    with pytest.raises(unison.SessionClosed):
        sess.run(unison.rank)


def test_ctrl_c_during_close_still_stops_the_workers_and_lets_go(make_session):
    """close() waiting out its grace for a long call: Ctrl-C there kills the workers and
    releases their fds before KeyboardInterrupt goes on (a second close could not: the
    session is closed already). Before, they lived until the call ended."""
    sess = make_session(2)
    pids = sess.run(os.getpid)
    sess.call(time.sleep, 30)
    fds_before = len(os.listdir("/proc/self/fd"))
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            sess.close(timeout=10)
    finally:
        timer.cancel()
    assert wait_gone(pids, 2.0) == []
    assert len(os.listdir("/proc/self/fd")) < fds_before  # pidfds and pipes let go


def _held(name: str) -> list[str]:
    """This process's fds that name session ``name``, and its mapping of the session's
    control segment (the workers' reply arenas stay mapped while the Session object lives:
    a fetched array may be a view of them)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if name in target:
            out.append(f"fd {fd} -> {target}")
    with open("/proc/self/maps") as maps:
        out += [line.strip() for line in maps if f"{name}-ctl" in line]
    return out


@pytest.mark.parametrize("wait", ["run", "sync"])
def test_ctrl_c_in_a_wait_lets_go_of_the_sessions_memory_while_its_traceback_lives(
    make_session, wait
):
    """The traceback of a KeyboardInterrupt keeps the frames of the wait alive (a REPL keeps
    it as sys.last_traceback), and with them the channel's C helper: the session it closed
    must still let go of its shared memory and fds."""
    sess = make_session(2)
    sess.run(unison.rank)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            if wait == "run":
                sess.run(time.sleep, 30)
            else:
                sess.call(time.sleep, 30)
                sess.sync()
    finally:
        timer.cancel()
    assert caught.value.__traceback__ is not None  # held here, as a REPL would
    assert _held(sess.name) == []


def ident(x):
    return x


def _signal_after(obj, name, sig=signal.SIGINT, read=False):
    """Make ``obj.name`` raise signal ``sig`` (Ctrl-C's SIGINT, or a test handler's) right
    after it returns, once: where CPython checks for a signal after a C call (the real one,
    delivered at that point). With ``read``, only once the method returned a value
    (Channel.plain_values: the replies were read)."""
    real = getattr(obj, name)

    def once(*args, **kwargs):
        got = real(*args, **kwargs)
        if not (read and got is None):
            setattr(obj, name, real)
            signal.raise_signal(sig)
        return got

    setattr(obj, name, once)


def _strike(sess, where, sig=signal.SIGINT):
    """Arm signal ``sig`` at ``where`` in the session's steps; what runs into it:
    after a run's, a call's or a put's message went out ("run-sent", "call-sent",
    "put-sent"), once a run's request is expected but before its send ("expected"), once
    the quick look read a run's replies ("read"), or between a GET's or SYNC's send and its
    wait ("fetched", "synced")."""
    if where in ("run-sent", "call-sent", "put-sent"):
        _signal_after(sess._chan, "send" if where == "put-sent" else "send_plain", sig)
        return {"run-sent": lambda: sess.run(ident, 1), "call-sent": lambda: sess.call(ident, 1),
                "put-sent": lambda: sess.put(1)}[where]
    if where == "expected":
        _signal_after(sess._router, "expect", sig)
        return lambda: sess.run(ident, 1)
    if where == "read":
        _signal_after(sess._chan, "plain_values", sig, read=True)

        def go():  # a round whose replies came later than the look's wait (a loaded
            for _ in range(200):  # machine) is read by the wait instead: another round
                sess.run(ident, 1)
            raise AssertionError("no run's replies were read by the quick look")
        return go
    if where == "fetched":
        ref = sess.call(ident, 1)
        _signal_after(sess, "_request", sig)
        return ref.gather
    assert where in ("synced", "synced-answered"), where
    sess.call(ident, None, 1)  # a TypeError: the sync asks for it (a SYNC request)
    if where == "synced-answered":  # the answers, with the error, came before the Ctrl-C
        real = sess._request

        def answered(*args, **kwargs):
            sess._request = real
            got = real(*args, **kwargs)
            deadline = time.monotonic() + 10
            while not sess._chan.pending() and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.05)  # (both workers' answers)
            signal.raise_signal(sig)
            return got

        sess._request = answered
        return sess.sync
    _signal_after(sess, "_request", sig)
    return sess.sync


def _closed_and_gone(sess, pids):
    assert sess.closed
    assert wait_gone(pids, 2.0) == []
    with pytest.raises(unison.SessionClosed):
        sess.run(ident, 2, timeout=3)


@pytest.mark.parametrize("where", ["run-sent", "expected", "fetched", "synced",
                                   "synced-answered"])
def test_ctrl_c_inside_a_send_closes_the_session(make_session, where):
    """Ctrl-C inside the session's own steps, outside a wait: after the message went out
    (the request was then forgotten, and the next run raised "answered request 4 where 6
    was expected"), after a reply was expected but before the send (the next run on that
    worker waited for ever), or between a GET's or SYNC's send and its wait (their errors
    went nowhere). Whether the workers got the message is not known there, so the session
    closes, as for a Ctrl-C in a wait."""
    sess = make_session(2)
    pids = sess.run(ident, 0) and sess.run(os.getpid)
    go = _strike(sess, where)
    with contextlib.ExitStack() as stack:
        if where.startswith("synced"):  # the error it asked for is not fetched: the close
            # says so, whether the workers still held it or their answers were in, unread
            stack.enter_context(pytest.warns(RuntimeWarning, match="nobody fetched"))
        with pytest.raises(KeyboardInterrupt):
            go()
    _closed_and_gone(sess, pids)


def test_ctrl_c_in_an_event_loops_reader_closes_the_session(make_session, monkeypatch):
    """An event loop that does not turn Ctrl-C into a task's cancellation
    (``run_until_complete``, as IPython's): the KeyboardInterrupt came out of the reader
    that delivers replies, after they were read and before they were delivered, and the
    session stayed open with those replies lost (the next run took another's slot)."""
    import asyncio

    import unison.session.aio as aio

    monkeypatch.setattr(aio, "_loop_idle", lambda: False)  # a busy loop: no quick path
    sess = make_session(2)
    pids = sess.run(ident, 0) and sess.run(os.getpid)
    _signal_after(sess._chan, "recv")
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(sess.run_async(ident, 1))
    finally:
        loop.close()
    _closed_and_gone(sess, pids)


class _SlowToLoad:
    def __reduce__(self):
        return (_made_slowly, ())


def _made_slowly():
    time.sleep(0.5)
    return _SlowToLoad()


def test_inline_worker0_hands_ctrl_c_on_while_it_loads(make_session):
    """Worker 0 inline runs in the controller: a Ctrl-C while it unpickled a function or a
    put value was stored as that function's or value's error, and the session went on as
    if nothing had been pressed."""
    sess = make_session(2, inline_worker0=True)
    pids = sess.run(os.getpid)[1:]
    captured = _SlowToLoad()
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            sess.run(lambda: type(captured).__name__)  # by value: its pickle holds captured
    finally:
        timer.cancel()
    _closed_and_gone(sess, pids)


class _CtrlCAfterAcquire:
    """The session's send lock, with Ctrl-C landing once just after the main thread's
    acquire returns: before the try that would release it."""

    def __init__(self, lock):
        self.lock, self.armed = lock, True

    def acquire(self, *args, **kwargs):
        got = self.lock.acquire(*args, **kwargs)
        if got and self.armed and threading.current_thread() is threading.main_thread():
            self.armed = False
            signal.raise_signal(signal.SIGINT)
        return got

    def release(self):
        self.lock.release()

    def _is_owned(self):  # (as an RLock answers it: a close asks)
        return self.lock._is_owned()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


@pytest.mark.parametrize("how", ["call", "call-by-deadline", "put", "gather"])
def test_ctrl_c_just_after_taking_the_send_lock_never_blocks_another_thread(make_session,
                                                                            how):
    """Ctrl-C between the send lock's acquire and the try that releases it closes the
    session with the lock still held by the main thread. Another thread's call then waited
    for that lock for ever; now it sees the close and raises SessionClosed."""
    sess = make_session(2)
    pids = sess.run(ident, 0) and sess.run(os.getpid)
    ref = sess.call(ident, 1)
    sess._send_lock = _CtrlCAfterAcquire(sess._send_lock)
    go = {"call": lambda: sess.call(ident, 1),
          "call-by-deadline": lambda: sess.run(ident, 1, timeout=5),
          "put": lambda: sess.put(1),
          "gather": ref.gather}[how]
    with pytest.raises(KeyboardInterrupt):
        go()
    assert not sess._send_lock.armed
    got = []

    def other():
        try:
            sess.call(ident, 2)
        except BaseException as exc:
            got.append(exc)

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), "a thread's call waited for a lock a Ctrl-C left held"
    assert len(got) == 1 and isinstance(got[0], unison.SessionClosed)
    _closed_and_gone(sess, pids)


class _Alarm(Exception):
    """A signal handler's own exception: a time limit on a block of user code."""


@pytest.fixture
def alarm_handler():
    """A SIGUSR1 handler raising ``kind("time limit")`` (set by the test), as one that puts a
    time limit on a block would (SIGALRM is pytest-timeout's); the old one back at the end."""
    kind = [_Alarm]

    def on_signal(*_):
        raise kind[0]("time limit")

    old = signal.signal(signal.SIGUSR1, on_signal)
    try:
        yield kind
    finally:
        signal.signal(signal.SIGUSR1, old)


@pytest.mark.parametrize("kind", [_Alarm, TimeoutError])
@pytest.mark.parametrize("where", ["run-sent", "call-sent", "put-sent", "read", "fetched",
                                   "in-a-wait"])
def test_a_signal_handlers_exception_inside_a_send_or_a_wait_closes_the_session(
    make_session, alarm_handler, where, kind
):
    """Any signal handler's exception (a time limit's, raised from a SIGALRM handler, say)
    inside the session's steps is handled as Ctrl-C is: it goes on as it was raised, and
    the session closes, as whether the message went or a reply was read is not known.
    Before, only KeyboardInterrupt was: after a message went out the request was forgotten
    (the next run raised "sent a reply that no request was waiting for"; a CALL's or PUT's
    object stayed on the workers), after the quick path read a run's replies the request
    stayed first in line (the next run waited for ever), and in a wait the call's later
    error was lost."""
    alarm_handler[0] = kind
    sess = make_session(2)
    pids = sess.run(ident, 0) and sess.run(os.getpid)
    timer = None
    if where == "in-a-wait":
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        go = lambda: sess.run(time.sleep, 30)
    else:
        go = _strike(sess, where, signal.SIGUSR1)
    try:
        with pytest.raises(kind) as info:
            go()
    finally:
        if timer is not None:
            timer.cancel()
            timer.join()
    assert type(info.value) is kind and info.value.args == ("time limit",)
    _closed_and_gone(sess, pids)


HANDLER_EXITS_JUST_AFTER_A_SEND = """
    import os, signal, sys
    import unison

    def ident(x):
        return x

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    with unison.Session(2) as sess:
        print(*sess.run(os.getpid), flush=True)
        sess.run(ident, 0)  # (defined on the workers: the next run is one message)
        real = sess._chan.send_plain

        def once(*args):  # SIGTERM lands just after the run's message went out
            sess._chan.send_plain = real
            got = real(*args)
            signal.raise_signal(signal.SIGTERM)
            return got

        sess._chan.send_plain = once
        sess.run(ident, 1)
"""


def test_a_sigterm_handlers_sys_exit_just_after_a_send_exits_with_its_code(controller):
    """A SIGTERM handler's sys.exit(7) just after a run's message went out, inside
    ``with Session``: the session closes and the process exits 7, quietly. Before, the
    request was forgotten and the close read its reply as out of step: exit 1, two
    tracebacks."""
    proc = controller(HANDLER_EXITS_JUST_AFTER_A_SEND)
    pids = read_pids(proc)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the controller did not exit within 30 s")
    assert proc.returncode == 7, err
    assert "Traceback" not in err, err
    assert wait_gone(pids, 2.0) == []


def _signalled():
    """Raise SIGUSR1 here: its handler's exception comes out of this unpickling (or this
    pickling, through ``_SignalsWhenPickled``)."""
    signal.raise_signal(signal.SIGUSR1)


class _SignalsWhenPickled:
    def __reduce__(self):
        _signalled()
        return (int, ())


class _SignalsWhenLoaded:
    def __reduce__(self):
        return (_signalled, ())


def _loaded_here():
    return _SignalsWhenLoaded()  # (on the controller, its load raises the signal)


@pytest.mark.parametrize("where", ["argument", "put", "function", "reply"])
def test_a_signal_handlers_exception_while_pickling_goes_on_as_it_is(
    make_session, alarm_handler, where
):
    """A signal handler's exception that lands while the controller pickles a call's
    arguments, a put value or a function, or unpickles a reply, goes on as it was raised.
    Before, it was taken for that object's fault: "cannot be pickled: time limit"
    (TypeError), or the reply's worker's error (WorkerError)."""
    sess = make_session(2)
    pids = sess.run(os.getpid)
    held = _SignalsWhenPickled()
    go = {"argument": lambda: sess.call(ident, held),
          "put": lambda: sess.put(held),
          "function": lambda: sess.run(lambda: held and 1),  # by value: held is captured
          "reply": lambda: sess.run(_loaded_here)}[where]
    with pytest.raises(_Alarm, match="time limit"):
        go()
    if where == "function":  # under the send lock, in the send: as any signal handler's
        _closed_and_gone(sess, pids)  # exception there
    else:  # before the send, or once every reply was in: the session goes on in step
        assert sess.run(ident, 2) == [2, 2]
