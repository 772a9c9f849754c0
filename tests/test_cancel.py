"""Cancellation (issue 11): ``ref.cancel()`` skips a call still queued on a worker and
interrupts one that runs (``unison.Cancelled`` at its next bytecode); fetching the Ref raises
``unison.CancelledError``; a call stuck in C code is reported as such; everything else in
the session stays intact."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import math
import os
import signal
import time

import pytest

import unison
from support import stranger_at, wait_gone
from unison.cancel import SIGNAL, TABLE

pytestmark = pytest.mark.channels


def spin() -> None:
    while True:
        pass


def stuck_in_c(seconds: float) -> str:
    """A call the cancellation signal cannot reach, as in a C extension that never returns
    to Python: the signal stays pending until it ends."""
    signal.pthread_sigmask(signal.SIG_BLOCK, [SIGNAL])
    try:
        time.sleep(seconds)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [SIGNAL])
    return "done"


def catches(seconds: float) -> str:
    try:
        time.sleep(seconds)
    except unison.Cancelled:
        return "cleaned up"
    return "finished"


def tidies_up(seconds: float) -> str:
    """Catches Cancelled, then takes a while (in Python) to tidy up."""
    try:
        time.sleep(30)
    except unison.Cancelled:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        return "tidied"
    return "finished"


def polite() -> bool:
    """Spins until the cancellation lands, then asks whether its call was cancelled."""
    try:
        while True:
            pass
    except unison.Cancelled:
        return unison.cancelled()


def _pending(pid: int) -> dict[str, int]:
    """The signals pending on a process's main thread (SigPnd) and on the process (ShdPnd),
    and those its main thread blocks (SigBlk)."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k], 16) for k in ("SigPnd", "ShdPnd", "SigBlk", "SigIgn")}


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line for line in f if line.startswith("State:"))[6:].strip()


def running(sess, ref, ranks=None) -> None:
    """Wait until every worker of ``ref`` (or ``ranks``) is inside its call: a fresh session on
    a loaded machine may take a while to get there, and cancelling earlier skips the call."""
    board = sess._res.board
    deadline = time.monotonic() + 20
    for r in ranks or ref.workers:
        while board.running(r) != ref._id:
            assert time.monotonic() < deadline, f"worker {r} never started the call"
            time.sleep(0.005)


def test_a_queued_call_is_skipped(sess):
    busy = sess.call(time.sleep, 0.5)
    marks = sess.put([])
    queued = sess.call(lambda m: m.append("ran") or len(m), marks)
    queued.cancel()
    with pytest.raises(unison.CancelledError) as info:
        queued.gather()
    assert info.value.workers == [0, 1]
    assert isinstance(info.value, concurrent.futures.CancelledError)
    assert busy.gather() == [None, None]  # the call before it was not touched
    assert marks.gather() == [[], []]  # the skipped call never ran


@pytest.mark.parametrize("fn", [spin, lambda: time.sleep(30)], ids=["python-loop", "sleep"])
def test_a_running_call_is_interrupted(sess, fn):
    ref = sess.call(fn)
    running(sess, ref)
    start = time.monotonic()
    ref.cancel()
    assert time.monotonic() - start < 0.5
    with pytest.raises(unison.CancelledError, match="while it ran"):
        ref.gather()
    sess.sync()  # a cancelled call is not an error to report
    assert sess.run(unison.rank) == [0, 1]


def gives_up(reason):
    raise unison.Cancelled(reason)


def test_a_cancelled_the_function_raised_of_itself_is_an_error(sess):
    """``unison.Cancelled`` raised by the function, with no ``ref.cancel()``, is an error like
    any other: a WorkerError whose cause it is, reported at sync and once. Before (an
    audit, issue 9, forty-ninth pass), ``run`` called it a ``ref.cancel()``, and after
    ``call`` it was never reported at all."""
    with pytest.raises(unison.WorkerError, match="input shard empty") as info:
        sess.run(gives_up, "input shard empty")
    assert not isinstance(info.value, unison.CancelledError)
    assert isinstance(info.value.__cause__, unison.Cancelled)
    sess.call(gives_up, "no data")
    with pytest.raises(unison.WorkerError, match="no data") as info:
        sess.sync()
    assert sorted(info.value.errors) == [0, 1]
    assert sess.sync() is None
    ref = sess.call(gives_up, "mine")
    with pytest.raises(unison.WorkerError, match="mine"):
        ref.gather()


def test_the_function_may_catch_cancelled_or_poll(sess):
    # the board says a worker entered the call a few steps before the function is inside
    # its try: a cancel landing there is the call's error, not the function's to catch (CI,
    # a loaded machine, 2026-12-06), so each cancel waits until the function is surely in
    ref = sess.call(catches, 30)
    running(sess, ref)
    time.sleep(0.2)
    ref.cancel()
    assert ref.gather() == ["cleaned up", "cleaned up"]
    ref = sess.call(polite)
    running(sess, ref)
    time.sleep(0.2)
    ref.cancel()
    assert ref.gather() == [True, True]  # unison.cancelled() sees its call cancelled
    assert sess.run(unison.cancelled) == [False, False]  # a fresh call is not


def test_a_call_that_caught_its_cancel_may_tidy_up_past_the_re_signals(sess):
    """The controller signals again every 0.1 s while a cancelled call runs (a signal may
    be lost in C code): a call that caught Cancelled and took longer than that to tidy up
    got a second Cancelled, and its value was lost (a review, 2026-12-07). One Cancelled
    a call."""
    ref = sess.call(tidies_up, 0.5)
    running(sess, ref)
    time.sleep(0.2)  # (inside its try: see test_the_function_may_catch_cancelled_or_poll)
    with contextlib.suppress(TimeoutError):  # (it tidies up for longer than that)
        ref.cancel(timeout=0.1)
    assert ref.gather(timeout=10) == ["tidied", "tidied"]


def test_a_call_stuck_in_c_is_reported(sess):
    ref = sess.call(stuck_in_c, 1.5)
    running(sess, ref)
    bit = 1 << (SIGNAL - 1)
    deadline = time.monotonic() + 20  # inside the call is not yet past its pthread_sigmask:
    for pid in sess._pids:  # a signal before it lands and ends the call (CI, 2026-12-05)
        while not _pending(pid)["SigBlk"] & bit:
            assert time.monotonic() < deadline, f"worker {pid} never blocked the signal"
            time.sleep(0.005)
    with pytest.raises(TimeoutError, match=r"blocks the cancellation signal \(SIGRTMIN\+3\)"):
        ref.cancel(timeout=0.3)
    # The signal waits on each worker's main thread, not on the process: sent to the process,
    # any thread that does not block it (a thread of the user's) could take it, and then a
    # sleep in the main thread would never wake (issue 11's CI failure of 2026-12-02).
    for pid in sess._pids:
        pending = _pending(pid)
        assert pending["SigPnd"] & bit and not pending["ShdPnd"] & bit, (pid, pending)
    with pytest.raises(unison.CancelledError):  # once back in Python, the pending signal lands
        ref.gather(timeout=10)
    assert sess.run(unison.rank) == [0, 1]


@pytest.mark.parametrize("timeout", [0, 1e-300])
def test_a_cancel_too_short_for_the_signal_to_land_does_not_say_stuck_in_c(sess, timeout):
    """A cancel of a Python loop with ``timeout=0`` said the workers "are stuck in C code",
    though the call ended cancelled within milliseconds (an audit, 2026-12-07): a wait that
    short tells nothing of where they are."""
    ref = sess.call(spin)
    running(sess, ref)
    with pytest.raises(TimeoutError, match="had not yet left the call") as info:
        ref.cancel(timeout=timeout)
    assert "stuck in C" not in str(info.value)
    with pytest.raises(unison.CancelledError, match="while it ran"):
        ref.gather(timeout=10)
    assert sess.run(unison.rank) == [0, 1]


def keeps_the_signal_out(how: str, seconds: float) -> str:
    """A call in pure Python that blocks or ignores the cancellation signal, as some libraries
    do with real-time signals: no C code to be stuck in."""
    if how == "blocks":
        signal.pthread_sigmask(signal.SIG_BLOCK, [SIGNAL])
    else:
        signal.signal(SIGNAL, signal.SIG_IGN)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return "finished"


@pytest.mark.parametrize("how", ["blocks", "ignores"])
def test_a_call_that_keeps_the_signal_out_is_named_and_ends_cancelled(sess, how):
    """Before (an audit, 2026-12-07), such a call was said to be "stuck in C code ... It ends
    cancelled if it ever returns", then it returned its value and ``get`` gave it: nothing
    looked at the board once the call had begun. Now the worker looks as it leaves."""
    ref = sess.call(keeps_the_signal_out, how, 1.5)
    running(sess, ref)
    bit, field = 1 << (SIGNAL - 1), "SigBlk" if how == "blocks" else "SigIgn"
    deadline = time.monotonic() + 20  # past its pthread_sigmask or signal.signal: a signal
    for pid in sess._pids:  # before it lands and ends the call at once
        while not _pending(pid)[field] & bit:
            assert time.monotonic() < deadline, f"worker {pid} never kept the signal out"
            time.sleep(0.005)
    with pytest.raises(TimeoutError, match=f"worker 0 {how} the cancellation signal") as info:
        ref.cancel(timeout=0.3)
    assert "worker 1 " + how in str(info.value) and "stuck in C" not in str(info.value)
    with pytest.raises(unison.CancelledError, match="while it ran"):
        ref.gather(timeout=10)
    sess.sync()  # a cancelled call is not an error to report
    assert sess.run(unison.rank) == [0, 1]


def blocks_and_polls() -> str:
    signal.pthread_sigmask(signal.SIG_BLOCK, [SIGNAL])  # (unblocked, the pending signal
    while not unison.cancelled():  # would land: Cancelled)
        pass
    return "stopped early"


def test_a_call_that_learned_of_its_cancel_keeps_what_it_returns(sess):
    """Only a call never told is made to end cancelled as it leaves: one that polled
    ``unison.cancelled()`` (or caught Cancelled) returns what it chose."""
    ref = sess.call(blocks_and_polls)
    running(sess, ref)
    ref.cancel()
    assert ref.gather(timeout=10) == ["stopped early", "stopped early"]


def test_a_stopped_worker_is_said_to_be_stopped_not_stuck_in_c(sess):
    """A worker whose process is stopped cannot leave the call: the report said it was
    "stuck in C code" (as for a long C call, test_a_call_stuck_in_c_is_reported), where
    stacks() and the timeouts' reports said it was stopped. It now says so."""
    ref = sess.call(spin)
    running(sess, ref)
    pids = sess._pids
    os.kill(pids[1], signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 20  # stopped, not inside the signal's handler
        while not _state(pids[1]).startswith("T"):
            assert time.monotonic() < deadline, "the worker never stopped"
            time.sleep(0.005)
        with pytest.raises(TimeoutError, match=r"worker\(s\) \[1\] are still inside") as info:
            ref.cancel(timeout=0.3)
        text = str(info.value)
        assert "worker 1's process is stopped (SIGSTOP, Ctrl-Z or a debugger): the " \
               "cancellation lands once it continues" in text, text
        assert "stuck in C" not in text and "unblocked" not in text, text
    finally:
        os.kill(pids[1], signal.SIGCONT)
    with pytest.raises(unison.CancelledError):
        ref.gather(timeout=10)


def test_cancel_on_one_worker_and_other_objects_stay(sess):
    keep = sess.put("kept")
    ref = sess[1].call(time.sleep, 30)
    running(sess, ref)
    ref.cancel()
    with pytest.raises(unison.CancelledError) as info:
        ref.get(1)
    assert info.value.workers == [1]
    assert keep.gather() == ["kept", "kept"]


def test_cancelling_a_finished_call_changes_nothing(sess):
    ref = sess.call(lambda: 7)
    assert ref.gather() == [7, 7]
    ref.cancel()
    assert ref.gather() == [7, 7]


def test_async_cancel_of_a_running_call(sess):
    import asyncio

    async def main() -> None:
        ref = sess.call(time.sleep, 30)
        waiter = asyncio.ensure_future(ref.gather_async())
        running(sess, ref)
        ref.cancel()
        with pytest.raises(unison.CancelledError):
            await waiter

    asyncio.run(main())


def ident(i: int) -> int:
    return i


def test_hundreds_of_cancelled_queued_calls_are_all_skipped(sess):
    """However many calls are cancelled while the workers are busy, a worker skips each one
    when it comes to it (a ring of the last 256 cancellations forgot the oldest: 44 of 300
    ran and returned values)."""
    sess.run(ident, 0)
    busy = sess.call(time.sleep, 1.0)
    refs = [sess.call(ident, i) for i in range(600)]
    for ref in refs:
        ref.cancel(timeout=5)
    ran = []
    for i, ref in enumerate(refs):
        try:
            ran.append((i, ref.gather(timeout=30)))
        except unison.CancelledError:
            pass
    assert ran == []
    busy.gather(timeout=30)
    assert sess.run(ident, 7) == [7, 7]


def die_inside() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # its board word stays: inside this call


def test_cancel_of_a_call_its_worker_died_in_signals_no_stranger(make_session):
    """A worker killed inside a call leaves its word on the board saying so, and cancel
    signalled every worker its word showed inside, by pid. By the time the cancel came, the
    kernel may have given that pid to another program: the cancellation signal's default
    action ends a process. Now a pid is signalled only while it is the process that started
    then (its start time, read at the session's start), and the cancel raises WorkerDied,
    where it reported the dead worker as stuck in C code."""
    sess = make_session(2)
    worker = sess[1].run(os.getpid)[0]
    ref = sess[1].call(die_inside)
    wait_gone([worker], 10.0)
    deadline = time.monotonic() + 10.0
    while True:  # its keeper reaps it: only then is the number free
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "the dead worker was never reaped"
        time.sleep(0.01)
    stranger = stranger_at(worker)
    try:
        with pytest.raises(unison.WorkerDied) as info:
            ref.cancel(timeout=0.3)
        assert info.value.worker == 1
        assert stranger.poll() is None, "the cancellation signal reached another program"
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.parametrize("timeout", [math.nan, -1, "1"])
def test_a_bad_cancel_timeout_is_refused_before_anything_is_cancelled(sess, timeout):
    """The timeout was read only after the cancel was posted: a string raised TypeError with
    the call cancelled all the same, NaN waited as long as the call stayed in C, -1 passed.
    (None waits while the workers live, as inf does.)"""
    ref = sess.call(time.sleep, 0.5)
    running(sess, ref)
    with pytest.raises((TypeError, ValueError), match="timeout must be a number of seconds"):
        ref.cancel(timeout=timeout)
    assert ref.gather(timeout=10) == [None, None]  # not cancelled


def test_an_unbounded_cancel_ends_at_a_death_inside_the_call(make_session):
    """``timeout=inf`` waits while a worker lives inside the call: one that died there
    leaves its word set for good, and is WorkerDied at once, never a wait without end."""
    sess = make_session(2)
    worker = sess[1].run(os.getpid)[0]
    ref = sess[1].call(die_inside)
    wait_gone([worker], 10.0)
    started = time.monotonic()
    with pytest.raises(unison.WorkerDied):
        ref.cancel(timeout=None)  # as inf: while a worker lives inside the call
    assert time.monotonic() - started < 5.0


def note(marks: list[str]) -> int:
    marks.append("ran")
    return len(marks)


def test_a_cancel_in_the_same_slot_never_uncancels_a_queued_call(sess):
    """The board keeps a cancelled id at id % TABLE. A cancel of a call TABLE ids later, to
    another worker (calls to worker 0 do not fill worker 1's ring), wrote over a cancelled
    call still queued on busy worker 1, which then ran it and returned a value. Now that
    cancel raises, cancelling nothing, until worker 1 is past the queued call. (The id
    counter jumps by TABLE: 2**20 real calls take half a minute.)"""
    marks = sess[1].put([])
    busy = sess[1].call(time.sleep, 30)
    running(sess, busy)
    queued = sess[1].call(note, marks)
    queued.cancel()
    sess._ids = itertools.count(queued._id + TABLE)
    later = sess[0].call(time.sleep, 30)
    assert later._id % TABLE == queued._id % TABLE
    running(sess, later)
    with pytest.raises(RuntimeError, match=f"shares its slot.*#{queued._id}.*\\[1\\]"):
        later.cancel()
    busy.cancel()
    with pytest.raises(unison.CancelledError):
        queued.get(1, timeout=10)
    assert marks.get(1) == []
    later.cancel()  # worker 1 is past the queued call now: the slot is free to take
    with pytest.raises(unison.CancelledError, match="while it ran"):
        later.get(0, timeout=10)


def test_cancelling_a_finished_call_never_uncancels_a_queued_one(sess):
    """A cancel of a finished call (documented to change nothing) wrote its id into the
    slot of a cancelled call TABLE ids later, still queued: that call ran and returned a
    value. A call its workers are past is not posted at all now."""
    old = sess.call(ident, 3)
    assert old.gather() == [3, 3]
    marks = sess[1].put([])
    busy = sess[1].call(time.sleep, 30)
    running(sess, busy)
    sess._ids = itertools.count(old._id + TABLE)
    queued = sess[1].call(note, marks)
    assert queued._id % TABLE == old._id % TABLE
    queued.cancel()
    old.cancel()
    busy.cancel()
    with pytest.raises(unison.CancelledError):
        queued.get(1, timeout=10)
    assert marks.get(1) == []
    assert old.gather() == [3, 3]
