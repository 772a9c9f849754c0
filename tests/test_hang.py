"""Where the workers are when a wait ends without them (issue 13): every TimeoutError names
the wait and, for each worker still owing a reply, the innermost frames of its stack; and
Session(hang_timeout=...) turns a call that makes no progress into unison.HangError, but not
one that computes (a long numpy call) or waits for a peer that does. Real workers; stopped
workers are continued even when a test fails."""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator

import pytest

import unison
from support import marked_lines
from unison.debug.stacks import short_path

pytestmark = pytest.mark.timeout(120)

HERE = short_path(os.path.realpath(__file__))


# -- what the workers run (by reference) -----------------------------------------------------------


def slow_step(seconds: float) -> int:
    time.sleep(seconds)  # line: slow
    return unison.rank()


def train(seconds: float) -> int:
    return slow_step(seconds)  # line: train


def deadlock() -> None:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # line: deadlock


def never_set() -> None:
    threading.Event().wait()  # line: event


def stuck_somehow() -> None:
    [deadlock, never_set][unison.rank() % 2]()


def numpy_for(seconds: float) -> float:
    import numpy as np

    a = np.random.default_rng(0).random((200, 200))
    end = time.monotonic() + seconds
    total = 0.0
    while time.monotonic() < end:
        total += float((a @ a).sum())  # line: numpy
    return total


def numpy_then_barrier(seconds: float) -> int:
    """Rank 0 computes, the others wait for it in a barrier: the call progresses."""
    if unison.rank() == 0:
        numpy_for(seconds)
    unison.barrier()
    return unison.rank()


def short_children(seconds: float) -> int:
    """A build's shape: a shell that runs one short child after another (each a few ms of
    CPU), idle itself between them."""
    import subprocess

    loop = "while :; do (i=0; while [ $i -lt 3000 ]; do i=$((i+1)); done); done"
    try:
        subprocess.run(["sh", "-c", loop], timeout=seconds)
    except subprocess.TimeoutExpired:
        pass
    return unison.rank()


def c_poll(ms: int) -> tuple[int, int]:
    """libc poll(NULL, 0, ms): 0 after the whole wait, -1 with EINTR if a signal came."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.poll(None, 0, ms)
    return rc, ctypes.get_errno()


LINE = marked_lines(__file__)


@pytest.fixture
def stopped() -> Iterator[list[int]]:
    """Pids to SIGSTOP: each is continued when the test ends, passed or failed."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def stop(pid: int, stopped: list[int]) -> None:
    stopped.append(pid)
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while not _state(pid).startswith("T"):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


# -- TimeoutError texts ----------------------------------------------------------------------------


def test_a_run_timeout_names_the_call_and_each_workers_file_and_line(make_session):
    sess = make_session(2)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        sess.run(train, 30, timeout=1.0)
    assert time.monotonic() - t0 < 1.0 + 3.0  # the report itself is bounded
    text = str(info.value)
    assert text.startswith("run(train): running a call timed out: 2 worker(s) [0, 1]")
    for r in (0, 1):
        assert (f"worker {r} is at {HERE}:{LINE['slow']} in slow_step() <- "
                f"{HERE}:{LINE['train']} in train()") in text, text
    assert not isinstance(info.value, unison.HangError)


def test_a_gather_timeout_names_only_the_workers_still_busy(make_session):
    sess = make_session(2)
    ref = sess.call(lambda: train(30) if unison.rank() == 1 else 0)
    with pytest.raises(TimeoutError) as info:
        ref.gather(timeout=1.5)
    text = str(info.value)
    assert "fetching a value timed out: 1 worker(s) [1]" in text
    assert f"worker 1 is at {HERE}:{LINE['slow']} in slow_step()" in text
    assert "worker 0 is" not in text
    assert ref.get(worker=0) == 0  # the Ref stays valid


def test_an_awaited_timeout_says_where_the_workers_are_too(make_session):
    import asyncio

    sess = make_session(2)

    async def main() -> str:
        with pytest.raises(TimeoutError) as info:
            await sess.run_async(train, 30, timeout=1.0)
        return str(info.value)

    text = asyncio.run(main())
    assert "running a call timed out: 2 worker(s) [0, 1]" in text, text
    assert f"worker 1 is at {HERE}:{LINE['slow']} in slow_step()" in text


def test_a_sync_timeout_says_where_the_workers_are(make_session):
    sess = make_session(2)
    sess.call(train, 30)
    with pytest.raises(TimeoutError) as info:
        sess.sync(timeout=1.0)
    text = str(info.value)
    assert "syncing timed out" in text
    assert f"worker 1 is at {HERE}:{LINE['slow']} in slow_step()" in text


def test_a_timeout_with_a_stopped_worker_says_so_without_waiting(make_session, stopped):
    sess = make_session(2)
    stop(sess._pids[1], stopped)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        sess.run(unison.rank, timeout=0.5)
    assert time.monotonic() - t0 < 3.0
    text = str(info.value)
    assert "worker 1: its process is stopped" in text
    assert "worker 0 is" not in text  # it answered


# -- the hang policy -------------------------------------------------------------------------------


def test_hang_policy_fires_on_a_stopped_worker(make_session, stopped):
    sess = make_session(2, hang_timeout=1.0)
    assert sess.run(unison.rank) == [0, 1]
    stop(sess._pids[1], stopped)
    t0 = time.monotonic()
    with pytest.raises(unison.HangError) as info:
        sess.run(unison.rank, timeout=60)
    took = time.monotonic() - t0
    assert 1.0 <= took < 10.0
    text = str(info.value)
    assert "no progress for 1 s (hang_timeout) on worker(s) [1]" in text
    assert "worker 1: its process is stopped" in text
    assert isinstance(info.value, TimeoutError)
    os.kill(sess._pids[1], signal.SIGCONT)
    assert sess.run(unison.rank, timeout=30) == [0, 1]  # only the wait was abandoned


def test_hang_policy_fires_on_deadlocked_workers_and_says_where(make_session):
    sess = make_session(2, hang_timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(unison.HangError) as info:
        sess.run(stuck_somehow, timeout=60)
    assert time.monotonic() - t0 < 15.0
    text = str(info.value)
    assert "run(stuck_somehow)" in text
    assert f"worker 0 is at {HERE}:{LINE['deadlock']} in deadlock()" in text, text
    assert f"{HERE}:{LINE['event']} in never_set()" in text, text


def test_hang_policy_fires_while_another_thread_keeps_getting_replies(make_session):
    """The thread reading the channel samples its hung call even when no read comes back
    empty: another thread's quick calls on worker 1 keep its batches full (before: no
    HangError until those calls stopped)."""
    sess = make_session(2, hang_timeout=0.5)
    t0 = time.monotonic()
    got: dict[str, object] = {}

    def hung_wait() -> None:
        try:
            sess[0].run(never_set, timeout=30)
        except unison.HangError as exc:
            got["after"] = time.monotonic() - t0
            got["text"] = str(exc)

    waiter = threading.Thread(target=hung_wait)
    waiter.start()
    time.sleep(0.3)  # the waiter reads the channel: the quick calls below follow it
    while "after" not in got and time.monotonic() - t0 < 6.0:
        assert sess[1].run(unison.rank) == [1]
        time.sleep(0.01)
    waiter.join(30)
    assert "after" in got, "no HangError while the other thread kept getting replies"
    assert got["after"] < 3.0, got
    assert "worker(s) [0]" in str(got["text"])


def spin(seconds: float) -> int:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return unison.rank()


def test_hang_policy_fires_for_one_thread_while_others_wait_on_busy_workers(make_session):
    """Threads A and C wait for workers 0 and 2, which compute; thread B waits for worker 1,
    which is deadlocked. The session sampled on one clock, each sample only the sampling
    thread's ranks: A and C came first every time, and worker 1 was never looked at until
    their calls ended (B's HangError at 12.7 s for calls of 10 s). Each thread now samples
    its own ranks on its own clock."""
    sess = make_session(3, hang_timeout=1.0)
    busy = [sess[0].call(spin, 6.0), sess[2].call(spin, 6.0)]
    hung = sess[1].call(deadlock)
    t0 = time.monotonic()
    got: dict[str, object] = {}

    def wait_hung() -> None:
        try:
            hung.get(timeout=30)
        except unison.HangError as exc:
            got["after"] = time.monotonic() - t0
            got["text"] = str(exc)

    threads = [threading.Thread(target=ref.get, kwargs={"timeout": 30}) for ref in busy]
    threads.append(threading.Thread(target=wait_hung))
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert "after" in got, "no HangError for the deadlocked worker"
    assert got["after"] < 4.5, got  # well before the busy calls end (6 s)
    assert "worker(s) [1]" in str(got["text"]), got
    assert f"{HERE}:{LINE['deadlock']}" in str(got["text"]), got


def hang_before_allreduce() -> float:
    if unison.rank() == 1:
        deadlock()
    import numpy as np

    return float(unison.allreduce(np.ones(2))[0])


def test_hang_policy_fires_while_inline_worker_0_waits_in_a_collective(make_session):
    """Worker 0 inline waits in an allreduce (in the controller's thread) for worker 1,
    deadlocked: no controller wait sampled the peers meanwhile, and the call waited for
    ever. Worker 0's collective now gives up once its peers made no progress for
    hang_timeout, and the wait for the others then ends in HangError."""
    sess = make_session(3, hang_timeout=1.0, inline_worker0=True)
    t0 = time.monotonic()
    with pytest.raises(unison.HangError) as raised:
        sess.run(hang_before_allreduce, timeout=60)
    assert time.monotonic() - t0 < 6.0
    assert f"{HERE}:{LINE['deadlock']}" in str(raised.value)
    with pytest.warns(RuntimeWarning, match="made no progress for hang_timeout"):
        sess.close()  # worker 0's own error, which the HangError left unread


def test_hang_policy_in_sync(make_session):
    sess = make_session(1, hang_timeout=0.5)
    sess.call(deadlock)
    with pytest.raises(unison.HangError, match="syncing: no progress"):
        sess.sync(timeout=60)


def test_hang_policy_spares_a_long_numpy_call_and_a_peer_waiting_for_it(make_session):
    sess = make_session(2, hang_timeout=1.0)
    t0 = time.monotonic()
    assert len(sess.run(numpy_for, 3.5, timeout=60)) == 2
    assert sess.run(numpy_then_barrier, 3.5, timeout=60) == [0, 1]
    assert time.monotonic() - t0 >= 7.0


def test_hang_policy_spares_a_worker_whose_short_lived_grandchildren_compute(make_session):
    """The CPU of children the worker's child already reaped counts (before: only what the
    processes alive at each sample had used themselves, so the shell's reaped children never
    counted, and this call was declared hung)."""
    sess = make_session(1, hang_timeout=1.0)
    assert sess.run(short_children, 3.0, timeout=60) == [0]


def test_hang_policy_never_signals_a_worker_waiting_in_c_while_it_samples(make_session):
    """The samples read /proc alone: a C-level poll shorter than hang_timeout runs whole
    (before: the stack-dump signal came at each sample where the CPU stood still, and the
    poll ended with EINTR)."""
    sess = make_session(1, hang_timeout=2.0)
    assert sess.run(c_poll, 1800, timeout=60) == [(0, 0)]


@pytest.fixture
def not_a_worker(monkeypatch) -> Iterator[int]:
    """A live process that is no unison worker; the session's watchdog is handed its pid in
    place of worker -1's, as a worker that joined from another host or pid namespace reports
    a pid that here names some other process."""
    import subprocess

    from unison.session import api

    other = subprocess.Popen(["sleep", "60"])
    real = api.Watchdog

    def foreign(hang_timeout, pids, *rest):  # (any Watchdog signature)
        return real(hang_timeout, [*pids[:-1], other.pid], *rest)

    monkeypatch.setattr(api, "Watchdog", foreign)
    try:
        yield other.pid
    finally:
        other.kill()
        other.wait()


def test_hang_policy_does_not_judge_a_worker_whose_pid_is_not_it_here(make_session, not_a_worker):
    """Worker 1's pid names an idle process that is not it: it is not watched (a warning
    says so) and its long computation is no hang (before: HangError, from the other
    process's CPU)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = make_session(2, hang_timeout=0.5)
    assert len(sess[1].run(numpy_for, 2.5, timeout=60)) == 1
    assert [str(w.message)[:39] for w in caught if w.category is RuntimeWarning] == [
        "hang_timeout cannot watch worker(s) [1]"]
    with pytest.raises(unison.HangError, match=r"worker\(s\) \[0\]"):
        sess[0].run(never_set, timeout=60)  # worker 0 is still watched


def test_hang_timeout_is_refused_where_no_worker_is_on_this_host(make_session, not_a_worker):
    with pytest.raises(ValueError, match="no worker of this session is a process here"):
        make_session(1, hang_timeout=0.5)


def test_hang_policy_spares_calls_that_finish_and_idle_sessions(make_session):
    sess = make_session(2, hang_timeout=0.5)
    for _ in range(50):
        assert sess.run(unison.rank) == [0, 1]
    time.sleep(1.0)  # idle: nothing samples, nothing fires
    assert sess.run(slow_step, 0.2) == [0, 1]
    threads = {t.name for t in threading.enumerate()}
    assert not any("hang" in n or "watchdog" in n for n in threads)


def test_without_hang_timeout_there_is_no_watchdog(make_session):
    sess = make_session(1)
    assert sess._router.hang is None
    with pytest.raises(TimeoutError) as info:
        sess.run(deadlock, timeout=1.5)
    assert not isinstance(info.value, unison.HangError)


@pytest.mark.parametrize("bad", [0, -1, float("nan")])
def test_a_bad_hang_timeout_is_refused(bad):
    with pytest.raises(ValueError, match="hang_timeout"):
        unison.Session(1, hang_timeout=bad)


def test_time_the_watchdog_did_not_watch_counts_toward_no_hang(make_session):
    """Samples past their due (the controller stopped, or the whole session: SIGSTOP of its
    group, a suspended machine) judge no CPU over the gap. Before (issue 9, forty-ninth
    pass; an audit of pauses), a stop of about hang_timeout raised HangError for workers
    busy all along (a longer one started afresh). A worker idle at every regular sample
    after it is still found."""
    sess = make_session(2, hang_timeout=2.0)
    dog = sess._router.hang
    ranks = [0, 1]  # idle workers: no CPU, as stopped ones
    t0 = time.monotonic()
    assert dog._sample("paused", ranks, t0) is None  # the wait's first sample
    assert dog._sample("paused", ranks, t0 + 2.1) is None  # the next, after a 2.1 s stop
    step = dog.interval
    found = [k for k in range(1, 8)
             if dog._sample("paused", ranks, t0 + 2.1 + k * step) is not None]
    assert found and found[0] == round((2.0 - step) / step)  # hang_timeout of watched time


def test_a_follower_thread_finds_a_hang_about_hang_timeout_in(make_session):
    """A thread that waits while another reads the channel (a follower) samples at the
    watchdog's interval, so its samples are never taken for unwatched gaps. Before (the
    review of issue 9's forty-ninth pass), it slept half a second between them: with
    hang_timeout=0.4, each sample counted as a gap, and HangError came after 3 s."""
    sess = make_session(2, hang_timeout=0.4)
    busy = sess[0:1].call(spin, 4.0)
    reader = threading.Thread(target=busy.get, kwargs={"timeout": 10})
    reader.start()
    try:
        time.sleep(0.2)  # the reader is in
        hung = sess[1:2].call(time.sleep, 4.0)  # no CPU: hung, by hang_timeout's measure
        start = time.monotonic()
        with pytest.raises(unison.HangError):
            hung.get(timeout=8)
        assert time.monotonic() - start < 1.8
    finally:
        reader.join(10)
