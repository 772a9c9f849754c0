"""A worker process dies: the wait that notices raises WorkerDied within a second, with the
rank, the exit code and the last lines it wrote to stderr; the session is closed, every
later use raises SessionClosed caused by that WorkerDied, and no other worker survives."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import pickle
import signal
import sys
import threading
import time
import warnings

import pytest

import unison
from support import alive, open_fds, wait_dead, wait_gone
from unison import SessionClosed, WorkerDied, WorkerError

DETECT = 1.0  # the contract: WorkerDied within 1 s of the death


def sleep_then_rank(seconds):
    time.sleep(seconds)
    return unison.rank()


def exit_with(code):
    os._exit(code)


def segfault():
    ctypes.string_at(0)


def say_then_exit(text, code):
    print(text, file=sys.stderr, flush=True)
    os._exit(code)


def _kill_later(pid, delay):
    """SIGKILL ``pid`` after ``delay`` seconds; returns a dict that gets the kill time."""
    when = {}

    def kill():
        when["t"] = time.monotonic()
        os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(delay, kill)
    timer.daemon = True
    timer.start()
    return when, timer


def _assert_closed_by(sess, died, ref=None):
    """Every later use raises SessionClosed whose cause is ``died``."""
    uses = [
        lambda: sess.call(unison.rank),
        lambda: sess.run(unison.rank),
        lambda: sess.put(1),
        lambda: sess.scatter([1] * sess.num_workers),
        lambda: sess.sync(),
        lambda: sess[0],
        lambda: sess.group(0),
    ]
    if ref is not None:
        uses += [lambda: ref.get(), lambda: ref.gather()]
    for use in uses:
        with pytest.raises(SessionClosed) as info:
            use()
        assert info.value.__cause__ is died
    sess.close()  # closing again is harmless


# -- a death while idle ------------------------------------------------------------------------


def _assert_idle_death(died, channel):
    """Shared memory shows that the worker had run all it had taken: the message says it
    died between calls, not in the call the controller had just sent (other channels cannot
    tell, and name only what the controller was doing)."""
    text = str(died)
    if channel == "pipe":
        assert not died.idle and "between calls" not in text, text
    else:
        assert died.idle, text
        assert f"worker {died.worker} died between calls, having run everything it had " \
               f"taken (seen while {died.during})" in text, text
    assert pickle.loads(pickle.dumps(died)).args == died.args  # .idle travels too


def test_a_worker_killed_while_idle_makes_the_next_use_raise_worker_died(sess, channel):
    pids = sess.run(os.getpid)
    sess.sync()  # (a worker publishes that it is done at its next take, after its reply)
    os.kill(pids[1], signal.SIGKILL)
    wait_dead(pids[1])
    start = time.monotonic()
    with pytest.raises(WorkerDied) as info:
        sess.call(unison.rank)
        sess.sync()
    assert time.monotonic() - start < DETECT
    assert info.value.worker == 1
    assert info.value.exitcode == -signal.SIGKILL
    assert "worker 1" in str(info.value)
    _assert_idle_death(info.value, channel)
    _assert_closed_by(sess, info.value)


def test_a_worker_killed_while_idle_is_noticed_by_sync(sess, channel):
    pids = sess.run(os.getpid)
    keeper = sess[0].run(os.getppid)[0]  # the session learns of the death when it ends
    sess.sync()  # (a worker publishes that it is done at its next take, after its reply)
    os.kill(pids[0], signal.SIGKILL)
    wait_dead(pids[0])
    wait_dead(keeper)
    with pytest.raises(WorkerDied) as info:
        sess.sync()
    assert (info.value.worker, info.value.exitcode) == (0, -9)
    _assert_idle_death(info.value, channel)
    _assert_closed_by(sess, info.value)


@pytest.mark.parametrize("channel", ["shm"])
def test_a_close_landing_inside_the_idle_look_still_raises_worker_died(sess):
    """The look at whether a dead worker was idle reads the channel's mapping without the
    session's locks (sync's wait holds none): another thread's close() released it in the
    middle, and sync raised the released memoryview's ValueError, not WorkerDied."""
    pids = sess.run(os.getpid)
    chan, said = sess._chan, []
    real = chan.was_idle

    def close_first(rank):
        closer = threading.Thread(target=sess.close, kwargs={"timeout": 0})
        closer.start()
        closer.join(10)
        chan._closed = False  # the look read this flag first: as if the close came after
        try:
            said.append(real(rank))
        finally:
            chan._closed = True
        return said[-1]

    chan.was_idle = close_first
    os.kill(pids[1], signal.SIGKILL)
    wait_dead(pids[1])
    with pytest.raises(WorkerDied) as info:
        sess.call(unison.rank)  # (a sync alone may find nothing to wait for)
        sess.sync()
    assert said == [False] and not info.value.idle, (said, str(info.value))


def stop_own_group():
    """What a worker's code may do to pause itself and its children (the shell's Ctrl-Z)."""
    signal.signal(signal.SIGTSTP, signal.SIG_IGN)
    os.killpg(os.getpgrp(), signal.SIGTSTP)


@pytest.mark.parametrize("n", [1, 2], ids=["lone", "zygote"])
@pytest.mark.parametrize("who", ["outside", "worker"])
def test_a_worker_killed_while_its_process_group_is_stopped(make_session, n, who):
    # kill -STOP -PGID of a worker's group (or the worker's own killpg of SIGTSTP), then the
    # worker dies: its keeper, outside that group, still reports it. Before, the keeper
    # shared the group, stopped too, and the wait hung (a timeout said "the work goes on").
    sess = make_session(n)
    pid = sess[n - 1].run(os.getpid)[0]
    group = os.getpgid(pid)
    try:
        if who == "outside":
            os.killpg(group, signal.SIGSTOP)
        else:
            sess[n - 1].run(stop_own_group)
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDied) as info:
            sess.run(unison.rank, timeout=10)
        assert time.monotonic() - start < 2 * DETECT
        assert (info.value.worker, info.value.exitcode) == (n - 1, -9)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGCONT)  # (the keeper's number: held until it is reaped)


# -- a death while the controller waits --------------------------------------------------------


@pytest.mark.parametrize("timeout", [None, 20], ids=["no-timeout", "with-timeout"])
def test_a_worker_killed_while_the_controller_waits_on_it(sess, timeout):
    pids = sess.run(os.getpid)
    ref = sess.call(sleep_then_rank, 30)
    killed, _ = _kill_later(pids[1], 0.3)
    with pytest.raises(WorkerDied) as info:
        ref.gather(timeout=timeout)
    assert time.monotonic() - killed["t"] < DETECT
    assert (info.value.worker, info.value.exitcode) == (1, -9)
    assert not info.value.idle, str(info.value)  # it died in the call
    assert "worker 1 died while fetching a value" in str(info.value)
    _assert_closed_by(sess, info.value, ref)


def test_a_worker_killed_while_the_controller_waits_on_another_worker(sess):
    pids = sess.run(os.getpid)
    ref = sess[0].call(sleep_then_rank, 30)
    killed, _ = _kill_later(pids[1], 0.3)
    with pytest.raises(WorkerDied) as info:
        ref.get()
    assert time.monotonic() - killed["t"] < DETECT
    assert (info.value.worker, info.value.exitcode) == (1, -9)
    _assert_closed_by(sess, info.value, ref)


def test_a_worker_killed_in_the_middle_of_a_long_call_while_another_is_awaited(make_session):
    sess = make_session(3)
    pids = sess.run(os.getpid)
    ref = sess.call(sleep_then_rank, 30)
    killed, _ = _kill_later(pids[2], 0.3)
    with pytest.raises(WorkerDied) as info:
        ref.get(worker=0)
    assert time.monotonic() - killed["t"] < DETECT
    assert (info.value.worker, info.value.exitcode) == (2, -9)


def test_a_death_during_sync_is_noticed(sess):
    pids = sess.run(os.getpid)
    sess.call(sleep_then_rank, 30)
    killed, _ = _kill_later(pids[0], 0.3)
    with pytest.raises(WorkerDied) as info:
        sess.sync()
    assert time.monotonic() - killed["t"] < DETECT
    assert info.value.worker == 0


def test_a_sync_with_nothing_to_wait_for_notices_a_death(sess):
    # a sync whose workers finish while it waits skips the look (they were alive to finish);
    # one that finds them done already looks, so a loop of syncs sees a worker die
    pids = sess.run(os.getpid)
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(WorkerDied) as info:
        while time.monotonic() - killed < 5:
            sess.sync()
            time.sleep(0.01)
    assert time.monotonic() - killed < DETECT
    assert info.value.worker == 1


def test_a_death_wakes_every_waiting_thread(make_session):
    sess = make_session(2)
    pids = sess.run(os.getpid)
    refs = [sess[r].call(sleep_then_rank, 30) for r in (0, 1)]
    outcomes = {}

    def wait(i):
        try:
            refs[i].gather()
        except BaseException as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=wait, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    _kill_later(pids[1], 0.3)
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads), "a waiter hung after a death"
    assert all(isinstance(e, (WorkerDied, SessionClosed)) for e in outcomes.values()), outcomes
    assert any(isinstance(e, WorkerDied) for e in outcomes.values())


def test_a_death_while_the_controller_is_blocked_sending_to_a_busy_worker(sess):
    pids = sess.run(os.getpid)
    sess.call(sleep_then_rank, 30)  # what is sent next piles up in the channel
    killed, _ = _kill_later(pids[0], 0.3)
    with pytest.raises(WorkerDied) as info:
        for _ in range(300):  # 30 MB: more than any channel buffers
            sess.put("x" * 100_000)  # a str: in-band, inside the PUT
        sess.sync()
    assert time.monotonic() - killed["t"] < DETECT
    assert (info.value.worker, info.value.exitcode) == (0, -9)
    _assert_closed_by(sess, info.value)


# -- how it died -------------------------------------------------------------------------------


def test_a_worker_that_calls_os_exit_reports_its_exit_code(sess):
    with pytest.raises(WorkerDied) as info:
        sess[1].run(exit_with, 3)
    assert (info.value.worker, info.value.exitcode) == (1, 3)
    assert "3" in str(info.value)
    assert not info.value.idle
    assert "worker 1 died while running a call" in str(info.value)


def test_a_segfault_reports_sigsegv(sess):
    with pytest.raises(WorkerDied) as info:
        sess[0].run(segfault)
    assert (info.value.worker, info.value.exitcode) == (0, -signal.SIGSEGV)
    assert "SIGSEGV" in str(info.value)


def test_the_message_includes_the_last_lines_written_to_stderr(sess):
    with pytest.raises(WorkerDied) as info:
        sess[1].run(say_then_exit, "last words: out of cheese", 7)
    assert info.value.exitcode == 7
    assert "last words: out of cheese" in str(info.value)


def say_a_lot_then_exit(lines):
    for i in range(lines):
        print(f"line {i} of the worker's last words", file=sys.stderr, flush=True)
    os._exit(9)


def test_the_message_keeps_the_last_lines_of_a_long_stderr(sess):
    with pytest.raises(WorkerDied) as info:
        sess[0].run(say_a_lot_then_exit, 200)
    text = str(info.value)
    assert "line 199 of the worker's last words" in text
    assert "line 0 of the worker's last words" not in text  # the tail, not everything


def test_a_death_detected_at_sync_after_os_exit(sess):
    sess[0].call(exit_with, 4)
    with pytest.raises(WorkerDied) as info:
        sess.sync()
    assert (info.value.worker, info.value.exitcode) == (0, 4)
    assert not info.value.idle, str(info.value)  # it died in the call sync waited for
    _assert_closed_by(sess, info.value)


def test_a_worker_that_dies_while_starting_makes_session_raise_worker_died():
    start = time.monotonic()
    with pytest.raises(WorkerDied) as info:
        # the interpreter of worker 1 cannot find its standard library: it exits at start
        unison.Session(2, env={1: {"PYTHONHOME": "/nonexistent-python-home"}})
    assert time.monotonic() - start < 10
    assert info.value.worker == 1
    assert info.value.exitcode not in (None, 0)
    assert "encodings" in str(info.value)  # what it wrote to stderr as it died
    assert not info.value.idle and "died while starting" in str(info.value)


def test_close_after_an_unnoticed_death_does_not_raise(sess):
    pids = sess.run(os.getpid)
    os.kill(pids[1], signal.SIGKILL)
    wait_dead(pids[1])
    start = time.monotonic()
    sess.close()
    assert time.monotonic() - start < 4.0
    assert wait_gone(pids, 1.0) == []


# -- errors nobody fetched survive a death -----------------------------------------------------


def fail_with(text):
    raise ValueError(text)


ASK = 0.5  # how long survivors that hold such errors have to hand them over


def test_a_survivors_unfetched_error_is_warned_when_another_worker_dies(sess):
    """A death closes the session, but an idle survivor known to hold an error nobody
    fetched (maybe the death's cause) is asked for it first, briefly: it is warned, as
    close warns (before, it was lost without a word)."""
    sess[0].call(fail_with, "the real problem")
    assert sess[0].run(unison.rank) == [0]  # worker 0 is done with it, and idle
    start = time.monotonic()
    said_it = r"raised ValueError: the real problem on worker\(s\) \[0\]"
    with pytest.warns(RuntimeWarning, match=said_it) as said, pytest.raises(WorkerDied) as info:
        sess[1].run(exit_with, 3)
    assert time.monotonic() - start < DETECT + ASK
    assert (info.value.worker, info.value.exitcode) == (1, 3)
    assert not [w for w in said if "closed before they could hand them over" in str(w.message)]
    _assert_closed_by(sess, info.value)


def test_a_busy_survivor_holding_an_unfetched_error_is_named_when_another_worker_dies(sess):
    """A survivor that holds such an error but is still busy cannot hand it over within the
    short grace: a warning names it, and WorkerDied still comes at once."""
    sess[0].call(fail_with, "unseen")
    assert sess[0].run(unison.rank) == [0]
    sess[0].call(time.sleep, 30)
    start = time.monotonic()
    named = r"worker\(s\) \[0\] held errors of calls nobody fetched.*after worker 1 died"
    with pytest.warns(RuntimeWarning, match=named), pytest.raises(WorkerDied):
        sess[1].run(exit_with, 3)
    assert time.monotonic() - start < DETECT + ASK


def test_an_error_sync_raised_is_not_named_as_held_when_another_worker_dies(sess, recwarn):
    """A worker that handed its errors to a sync holds none: a death later neither waits
    for it nor names it (the pipe's SYNC reply said it still held them: the worker cleared
    its list after it replied)."""
    sess[0].call(fail_with, "seen")
    with pytest.raises(WorkerError, match="seen"):
        sess.sync()
    sess[0].call(time.sleep, 30)
    start = time.monotonic()
    with pytest.raises(WorkerDied):
        sess[1].run(exit_with, 3)
    assert time.monotonic() - start < DETECT
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_warnings_as_errors_a_death_is_still_worker_died_with_the_close_warnings_as_notes(sess):
    """Under -W error the death's close raised its warning about the survivor's error nobody
    fetched, which replaced WorkerDied: ``except WorkerDied`` missed it. Now WorkerDied goes
    on, that warning as its note, and the session is closed all the same."""
    pids = sess.run(os.getpid)
    sess[0].call(fail_with, "the real problem")
    assert sess[0].run(unison.rank) == [0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(WorkerDied) as info:
            sess[1].run(exit_with, 3)
    assert "the real problem" in "".join(getattr(info.value, "__notes__", [])), info.value
    assert wait_gone(pids, 2.0) == []
    _assert_closed_by(sess, info.value)


# -- nothing survives a death ------------------------------------------------------------------


def test_the_other_workers_are_stopped_after_a_death(make_session):
    sess = make_session(3)
    pids = sess.run(os.getpid)
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerDied):
        sess.run(sleep_then_rank, 0)
    assert wait_gone(pids, 1.0) == []


def test_a_worker_that_dies_with_a_child_takes_the_child_along(sess):
    import subprocess

    child = sess[0].run(lambda: subprocess.Popen(["sleep", "60"]).pid)[0]
    assert alive(child)
    with pytest.raises(WorkerDied):
        sess[0].run(exit_with, 1)
    assert wait_gone([child], 2.0) == []


def test_a_death_releases_every_file_descriptor_the_session_opened(channel):
    gc.collect()
    before = open_fds()
    sess = unison.Session(2, **({"channel": channel} if channel else {}))
    try:
        with pytest.raises(WorkerDied):
            sess[1].run(exit_with, 2)
    finally:
        sess.close()
    leaked = open_fds() - before
    assert not leaked, f"left open after a death: {sorted(leaked)}"
