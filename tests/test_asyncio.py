"""The asyncio face (issue 11): ``await ref``, ``get_async``, ``run_async``, ``sync_async``.
Waits never block the event loop and cost no thread; cancelling a wait abandons only the
wait; a death or a close ends every pending wait with the session's error."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time
import weakref

import pytest

import unison
from support import (
    await_beside_a_reader_that_empties_the_wake,
    big_then_stopped,
    nap_then_rank,
    recorded,
    wait_gone,
)
from unison import pacing
from unison.session import aio, api
from unison.session.router import Request

pytestmark = pytest.mark.channels


def boom() -> None:
    raise ValueError("boom")


def slow_fail() -> None:
    time.sleep(0.4)
    raise ZeroDivisionError("late")


def rank_and(i: int) -> int:
    return unison.rank() * 1000 + i


def big_reply(data: bytes) -> bytes:
    return data[:65536] + bytes([unison.rank()])  # more than a pipe's 64 KiB


@pytest.mark.timeout(120)
def test_a_send_blocked_on_a_full_pipe_reads_the_reply_its_worker_is_blocked_on(sess):
    """A run's reply larger than a pipe holds, which nobody reads while the event loop goes
    on sending commands larger than a pipe holds: on the pipe channel the worker blocks
    writing the reply, reading no command, and the loop blocks sending, unless the send
    reads the replies while it waits for room (and wakes the loop for them)."""
    async def main() -> None:
        task = asyncio.ensure_future(sess.run_async(big_reply, b"r" * 70_000))
        await asyncio.sleep(0)  # the task sends the run, then waits
        time.sleep(0.2)  # the loop busy: each worker blocks writing its reply
        refs = [sess.call(len, bytes([i]) * 300_000) for i in range(12)]  # no await
        replies = await asyncio.wait_for(task, 30)
        assert [r[-1] for r in replies] == [0, 1]
        assert all(r[:65536] == b"r" * 65536 for r in replies)
        assert [await ref for ref in refs] == [[300_000, 300_000]] * 12

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_an_await_on_a_reply_stopped_half_written_times_out(sess):
    """As test_timeout's blocking wait: the event loop's reads never wait for the rest of a
    reply a stopped worker began (pipe channel: 8 MiB, more than its pipe holds)."""
    async def main() -> None:
        ref = sess.call(big_then_stopped, 8 << 20, 0.3)
        with pytest.raises(TimeoutError):
            ref.gather(timeout=0)  # asks for the value and leaves it unread
        await asyncio.sleep(0.8)  # the workers stop, blocked writing it
        start = time.monotonic()
        with pytest.raises((TimeoutError, asyncio.TimeoutError)):
            await asyncio.wait_for(ref.gather_async(), 0.5)
        assert time.monotonic() - start < 1.5

    asyncio.run(main())


def test_await_ref_and_the_async_forms(sess):
    async def main() -> None:
        ref = sess.call(lambda: 40 + unison.rank())
        assert await ref == [40, 41]
        assert await ref.gather_async() == [40, 41]
        assert await ref.get_async(1) == 41
        assert await sess.run_async(unison.rank) == [0, 1]
        assert await sess[1].run_async(unison.rank) == [1]
        sess.call(int)
        await sess.sync_async()

    asyncio.run(main())


def test_errors_reach_the_awaiting_task(sess):
    async def main() -> None:
        with pytest.raises(unison.WorkerError) as info:
            await sess.run_async(boom)
        assert isinstance(info.value.__cause__, ValueError)
        sess.call(boom)
        with pytest.raises(unison.WorkerError):
            await sess.sync_async()
        await sess.sync_async()  # reported once

    asyncio.run(main())


def test_a_thousand_pending_awaits_and_no_thread_per_wait(sess):
    async def main() -> None:
        threads = threading.active_count()
        refs = [sess.call(lambda i=i: i * 2) for i in range(1000)]
        tasks = [asyncio.ensure_future(ref.get_async(0)) for ref in refs]
        await asyncio.sleep(0)
        assert threading.active_count() == threads
        assert await asyncio.gather(*tasks) == [i * 2 for i in range(1000)]

    asyncio.run(main())


def test_the_event_loop_runs_while_workers_work(sess):
    async def main() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.ensure_future(ticker())
        await sess.run_async(time.sleep, 0.5)
        t.cancel()
        return ticks

    assert asyncio.run(main()) >= 20  # a blocking wait would have allowed none


def test_wait_for_and_cancel_abandon_only_the_wait(sess):
    async def main() -> None:
        ref = sess.call(time.sleep, 0.4)
        with pytest.raises(asyncio.TimeoutError):  # TimeoutError from Python 3.11 on
            await asyncio.wait_for(ref.gather_async(), 0.05)
        with pytest.raises(TimeoutError, match="stays valid"):
            await ref.gather_async(timeout=0.05)
        task = asyncio.ensure_future(sess.run_async(time.sleep, 0.3))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await ref == [None, None]  # the Ref stayed valid
        assert await sess.run_async(unison.rank) == [0, 1]

    asyncio.run(main())


def test_an_error_behind_a_cancelled_wait_reaches_sync(sess):
    async def main() -> None:
        task = asyncio.ensure_future(sess.run_async(slow_fail))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(unison.WorkerError) as info:
            await sess.sync_async()
        assert isinstance(info.value.__cause__, ZeroDivisionError)

    asyncio.run(main())


def test_run_async_reads_its_replies_in_one_step_where_it_can(sess, channel):
    """With the loop idle, ``await run_async`` reads and decodes its replies as the blocking
    run does (one step, no poll, no future), where the channel can (shared memory): of 50
    awaits, fewer than half poll (one only where the workers took longer than the spin).
    A crowded host (CI's, once) can keep every reply past the spin for a while, so up to
    five rounds of 50 are run, and one must show it. Where that cannot be (another
    request's replies come first, an error, the pipe channel), the usual wait still gives
    each await its own."""
    async def main() -> None:
        await sess.run_async(unison.rank)
        counts = []
        for _ in range(5 if channel == "shm" else 1):
            with recorded(sess._router, "poll") as polls:
                for i in range(50):
                    assert await sess.run_async(rank_and, i) == [i, 1000 + i]
            counts.append(len(polls))
            if counts[-1] < 25:
                break
        assert counts[-1] < 25 or channel != "shm", (
            f"polls per round of 50 awaits: {counts}; the host judged crowded until "
            f"{pacing.crowd.until - time.perf_counter():+.3f} s from now")
        slow = asyncio.ensure_future(sess.run_async(lambda: time.sleep(0.2) or "slow"))
        await asyncio.sleep(0.01)  # the slow call is sent first: its replies come first
        assert await sess.run_async(unison.rank) == [0, 1]
        assert await slow == ["slow", "slow"]
        with pytest.raises(unison.WorkerError, match="boom"):
            await sess.run_async(boom)
        assert await sess.run_async(unison.rank) == [0, 1]

    asyncio.run(main())


def test_sync_async_waits_for_work_that_outlasts_its_look(sess):
    """An await of sync_async looks at the workers' progress for a spin at most before it
    asks (SYNC): work still running past that look is waited for, not skipped, and its
    timeout still holds."""
    async def main() -> float:
        sess.call(time.sleep, 0.3)
        start = time.monotonic()
        await sess.sync_async()
        took = time.monotonic() - start
        sess.call(time.sleep, 1.0)
        with pytest.raises(TimeoutError, match="syncing"):
            await sess.sync_async(timeout=0.1)
        await sess.sync_async()
        return took

    assert asyncio.run(main()) >= 0.25


def test_sync_async_after_a_worker_died_idle_raises_worker_died(sess):
    """A worker that ran everything and then died: the look finds nothing left to run, yet
    the await raises WorkerDied, as a blocking sync does, never a quiet return."""
    pids = sess.run(os.getpid)
    sess.call(int)
    sess.sync()
    os.kill(pids[1], signal.SIGKILL)
    assert wait_gone([pids[1]], 5) == []

    async def main() -> None:
        with pytest.raises(unison.WorkerDied) as info:
            await sess.sync_async(timeout=10)
        assert info.value.worker == 1

    start = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - start < 2.0


def test_a_death_ends_every_pending_wait(sess):
    pids = sess.run(os.getpid)

    async def main() -> float:
        waits = [asyncio.ensure_future(sess.run_async(time.sleep, 30)) for _ in range(3)]
        await asyncio.sleep(0.2)
        start = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        results = await asyncio.gather(*waits, return_exceptions=True)
        took = time.monotonic() - start
        assert all(isinstance(r, (unison.WorkerDied, unison.SessionClosed)) for r in results)
        assert any(isinstance(r, unison.WorkerDied) and r.worker == 1 for r in results)
        return took

    assert asyncio.run(main()) < 2.0
    with pytest.raises(unison.SessionClosed):
        sess.run(int)


def test_close_from_another_thread_ends_pending_waits(sess):
    async def main() -> None:
        wait = asyncio.ensure_future(sess.run_async(time.sleep, 30))
        await asyncio.sleep(0.1)
        closer = threading.Thread(target=sess.close, kwargs={"timeout": 0})
        closer.start()
        with pytest.raises(unison.SessionClosed):
            await asyncio.wait_for(wait, 5)
        closer.join()

    asyncio.run(main())


def _close_inside(sess, name: str) -> list[str]:
    """Make the first call of the session channel's ``name`` close the session from another
    thread, all of it, before that call goes on: a close landing in the middle of a look
    that runs without the router's lock. Returns what the call then said, for the test to
    check: False or None, never the released mapping's or a closed fd's error."""
    chan, said = sess._chan, []
    real = getattr(chan, name)

    def once(*args):
        if not said:
            said.append("closing")
            closer = threading.Thread(target=sess.close, kwargs={"timeout": 0})
            closer.start()
            closer.join(10)
            try:
                said.append(repr(real(*args)))
            except BaseException as exc:
                said.append(repr(exc))
                raise
            return False
        return real(*args)

    setattr(chan, name, once)
    return said


def test_a_close_landing_inside_an_awaits_look_ends_it_with_session_closed(sess):
    """Issue 9's thirty-fifth pass: an await's poll between the channel's close and
    fail_all raised 'operation forbidden on released memoryview object'. The spin's look
    (``pending``) runs outside the router's lock; a closed channel answers 'nothing
    pending', and the wait ends with the close's SessionClosed."""
    said = _close_inside(sess, "pending")

    async def main() -> None:
        with pytest.raises(unison.SessionClosed):
            await asyncio.wait_for(sess.run_async(time.sleep, 30), 10)

    asyncio.run(main())
    assert said == ["closing", "False"], said


def test_a_close_landing_inside_sync_async_s_look_ends_it_with_session_closed(sess):
    """The same for sync_async's look at the workers' progress (Channel.settled)."""
    said = _close_inside(sess, "settled")

    async def main() -> None:
        with pytest.raises(unison.SessionClosed):
            await asyncio.wait_for(sess.sync_async(), 10)

    asyncio.run(main())
    assert said == ["closing", "False"], said


def _beside_blocking_runs(sess, main, *args) -> None:
    """Run the coroutine ``main()`` while another thread calls ``sess.run(*args)`` over and
    over; every blocking run must give each worker's rank."""
    stop = threading.Event()
    seen: list[list[int]] = []

    def blocking() -> None:
        while not stop.is_set():
            seen.append(sess.run(*args))

    t = threading.Thread(target=blocking)
    t.start()
    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        stop.set()
        t.join()
    assert seen and all(s == [0, 1] for s in seen)


def test_blocking_waits_in_a_thread_and_awaits_in_the_loop_mix(sess):
    async def main() -> None:
        for _ in range(200):
            assert await sess.run_async(unison.rank) == [0, 1]

    _beside_blocking_runs(sess, main, unison.rank)


def test_blocking_runs_longer_than_their_spin_beside_awaits_lose_no_wake_up(sess):
    """A blocking run whose calls outlast its spin sleeps on the channel's eventfd, the one
    the event loop waits on; each await still gets its replies. (run's quick path never
    sleeps while an await does, as it reads only its own replies: the channel unit tests
    check that rule; this one, that the two kinds of wait mix.)"""
    async def main() -> None:
        for i in range(300):
            got = await (sess.run_async(nap_then_rank, 0.0003) if i % 2
                         else sess.run_async(unison.rank))
            assert got == [0, 1]

    _beside_blocking_runs(sess, main, nap_then_rank, 0.0005)


@pytest.mark.parametrize("reply_first", [False, True], ids=["reply_after_flag",
                                                            "reply_before_flag"])
def test_an_await_turned_away_by_a_reader_that_empties_the_wake_fd_still_wakes(
        sess, monkeypatch, reply_first):
    """A blocking run in another thread holds the router's lock in its quick path (shm:
    sleeping on the eventfd the event loop sleeps on, as it checked the await flag before
    the await raised it): the await's last poll is turned away, the run's sleep empties the
    eventfd, and it reads only its own replies. The await's replies sat in the channel and
    the loop slept for good. Now the turned-away poll is noted, and whoever lets go of the
    lock re-arms the wake fd: the loop polls again. Either way round: the await's replies
    signalled, then emptied; or in before the flag, never signalled."""
    assert await_beside_a_reader_that_empties_the_wake(sess, monkeypatch, reply_first) == [0, 1]
    assert sess.run(unison.rank) == [0, 1]


def _left_on_a_closed_loop(sess, fn, *args) -> asyncio.Task:
    """``await sess.run_async(fn, *args)`` left asleep on an event loop that is then closed
    (a task nobody cancelled): nobody waits for its replies any more."""
    loop = asyncio.new_event_loop()
    task = loop.create_task(sess.run_async(fn, *args))
    loop.run_until_complete(asyncio.sleep(0.05))
    assert sess._waits._asleep == 1
    loop.close()
    task._log_destroy_pending = False  # (left pending on purpose)
    return task


def test_an_await_left_on_a_closed_loop_puts_no_later_wait_out_of_step(sess):
    """The replies of an await left on a closed loop, read by a blocking wait in the loop's
    thread: its ``done`` set the closed loop's future, which raised 'Event loop is closed'
    out of the router in the middle of a batch; the replies read after it were never
    delivered, and the next waits timed out, then found the session out of step. Now it
    lets go of the request; every later wait, in any thread or loop, gets its own."""
    task = _left_on_a_closed_loop(sess, time.sleep, 0.2)
    assert sess.run(unison.rank) == [0, 1]
    got: list[object] = []
    other = threading.Thread(target=lambda: got.append(sess.run(unison.rank, timeout=5)))
    other.start()
    other.join(10)
    assert got == [[0, 1]]
    assert asyncio.run(sess.run_async(unison.rank, timeout=5)) == [0, 1]
    assert not task.done() and not sess.closed


def test_the_next_loop_lowers_the_flag_of_waits_left_asleep_on_a_closed_one(sess,
                                                                            monkeypatch):
    """Waits left asleep on a closed loop raised the channel's "an event loop waits" flag
    and never end: binding the next loop lowers it (else every reply kept signalling the
    eventfd, and blocking waits never dozed), then its own waits raise it as they sleep."""
    waiting = []
    monkeypatch.setattr(sess._chan, "async_waiting",
                        lambda on, real=sess._chan.async_waiting: (waiting.append(on),
                                                                   real(on))[1])
    _left_on_a_closed_loop(sess, time.sleep, 0.2)
    assert waiting == [True]
    assert asyncio.run(sess.run_async(unison.rank, timeout=5)) == [0, 1]
    assert waiting[:2] == [True, False] and waiting[-1] is False


def slow_rank(seconds: float) -> int:
    time.sleep(seconds)
    return unison.rank()


def test_waits_of_a_closed_loop_collected_later_leave_the_next_loops_waits_alone(sess):
    """Tasks left asleep on a closed loop, collected while the next loop's await sleeps:
    each closed coroutine's ``finally`` took its end off the new loop's counts, lowered its
    flag (the workers stopped signalling: the await slept for good) and let a third loop
    bind over the sleeping one. Now an end counts only on the loop it began on."""
    task = _left_on_a_closed_loop(sess, time.sleep, 0.2)
    sess.sync()
    got: list[object] = []

    async def main() -> None:
        def collect() -> None:
            nonlocal task
            del task
            gc.collect()
            other = threading.Thread(target=lambda: got.append(_run_in_a_new_loop(sess)))
            other.start()
            other.join(10)

        asyncio.get_running_loop().call_later(0.1, collect)
        got.append(await sess.run_async(slow_rank, 2.0, timeout=10))  # (2 s: collect is in)

    asyncio.run(main())
    assert got[0] == "refused: another loop waits" and got[1] == [0, 1], got


def _run_in_a_new_loop(sess) -> str:
    try:
        asyncio.run(sess[0].run_async(unison.rank, timeout=5))
    except RuntimeError as exc:
        if "already awaited from another event loop" in str(exc):
            return "refused: another loop waits"
        raise
    return "bound over a loop that waits"


def test_a_close_that_could_not_wait_for_the_loop_leaves_the_next_sessions_readers(
        sess, make_session, channel):
    """close() from another thread while the loop is held past _DETACH_S: it closes the
    fds without the loop's detach, and a session opened next takes their numbers. The late
    detach then removed that session's readers (or its add_reader only swapped the stale
    entry's callback, watching nothing): its await never woke. Now a detach removes only
    its own readers, and an attach clears a stale one first."""
    fds: list[set[int]] = []

    async def main() -> object:
        await sess.run_async(unison.rank)  # the loop watches its fds
        fds.append({fd for fd, _ in sess._waits._readers})
        closer = threading.Thread(target=sess.close)
        closer.start()
        time.sleep(aio._DETACH_S + 0.5)  # a step holds the loop past the close's wait
        closer.join()
        other = make_session(2)
        got = await other.run_async(slow_rank, 0.05, timeout=10)
        fds.append({fd for fd, _ in other._waits._readers})
        return got

    assert asyncio.run(main()) == [0, 1]
    if channel == "shm":  # (the pipe channel's new session happens to take other numbers)
        assert fds[0] & fds[1], fds  # else the numbers were not reused: nothing was tested


@pytest.mark.parametrize("bad", [float("nan"), -1, True, "1", [1]])
def test_sync_async_refuses_a_bad_timeout_as_sync_does(sess, bad):
    """With the workers idle, sync_async's look took nan, -1 and True (a look of no time)
    and met "1" with max()'s bare TypeError; sync refused each, saying what to pass."""
    with pytest.raises((ValueError, TypeError)) as blocking:
        sess.sync(timeout=bad)
    with pytest.raises(type(blocking.value)) as awaited:
        asyncio.run(sess.sync_async(timeout=bad))
    assert str(awaited.value) == str(blocking.value)
    assert sess.run(unison.rank) == [0, 1]


def test_an_error_of_an_await_left_on_a_closed_loop_reaches_sync(sess):
    """Its replies are read as an abandoned wait's: the error they bring is kept for the
    next sync, never dropped."""
    _left_on_a_closed_loop(sess, slow_fail)
    with pytest.raises(unison.WorkerError) as info:
        sess.sync()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    sess.sync()
    assert sess.run(unison.rank) == [0, 1]


@pytest.mark.parametrize("reader", ["poll", "blocking_run"])
def test_a_done_callback_that_raises_drops_no_reply_of_its_batch(sess, monkeypatch, reader):
    """A request's ``done`` callback that raises, in the middle of a batch of replies read
    at once (by the event loop's poll, or a blocking wait's leader): the rest of the batch
    is delivered first, then the error is raised (to the loop's exception handler, or the
    blocking caller), so the replies stay in step."""
    waits, first = sess._waits, []
    real_prepare = waits.prepare

    def prepare(req):
        fut = real_prepare(req)
        if not first:
            first.append(req)
            settle = req.done

            def done(exc):
                settle(exc)
                raise RuntimeError("a done callback's bug")

            req.done = done
        return fut

    monkeypatch.setattr(waits, "prepare", prepare)
    seen: list[object] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: seen.append(context.get("exception")))
        a = asyncio.ensure_future(sess.run_async(time.sleep, 0.05))
        b = asyncio.ensure_future(sess.run_async(unison.rank))
        await asyncio.sleep(0.02)  # both asleep
        time.sleep(0.3)  # (the loop held) every reply is in: one batch
        if reader == "blocking_run":
            with pytest.raises(RuntimeError, match="bug"):
                sess.run(unison.rank)
        assert await asyncio.wait_for(a, 5) == [None, None]
        assert await asyncio.wait_for(b, 5) == [0, 1]

    asyncio.run(main())
    if reader == "poll":
        assert [str(e) for e in seen] == ["a done callback's bug"], seen
    assert sess.run(unison.rank) == [0, 1]


def test_a_second_event_loop_after_the_first_is_done(sess):
    assert asyncio.run(sess.run_async(unison.rank)) == [0, 1]
    assert asyncio.run(sess.run_async(unison.rank)) == [0, 1]
    assert sess.run(unison.rank) == [0, 1]  # and the blocking path still works


def test_an_await_after_the_session_died_raises_session_closed(sess):
    """Every await after a death raises SessionClosed at once. The session's fds are closed
    and their numbers may be the user's by now: binding the loop to them again (OSError
    EBADF, or worse, taking over the user's own reader) must never happen."""
    pids = sess.run(os.getpid)
    os.kill(pids[1], signal.SIGKILL)

    async def main() -> list[str]:
        got = []
        for _ in range(3):
            try:
                await sess.run_async(os.getpid, timeout=10)
            except (unison.WorkerDied, unison.SessionClosed) as exc:
                got.append(type(exc).__name__)
        return got

    got = asyncio.run(main())
    assert got[0] in ("WorkerDied", "SessionClosed") and got[1:] == ["SessionClosed"] * 2, got


def test_a_close_from_another_thread_returns_once_the_loop_watches_none_of_its_fds(sess):
    """close() in another thread asked the event loop to stop watching the session's fds,
    then closed them at once. Until the loop got round to it, a file opened meanwhile with
    one of those numbers (another session's, on this loop) could lose its reader to the
    late remove_reader, or fail its own add_reader on the stale entry. Now close() waits
    (up to a second) for the loop to let go first. The loop is kept busy here while the
    close runs, so the old close returned with the fds still watched."""
    seen: list[set[int]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        wait = asyncio.ensure_future(sess.run_async(time.sleep, 30))
        await asyncio.sleep(0.1)
        watched = {fd for fd, _ in sess._waits._readers}
        assert watched and watched <= set(loop._selector.get_map())  # type: ignore[attr-defined]

        def close() -> None:
            sess.close(timeout=0)
            seen.append(watched & set(loop._selector.get_map()))  # type: ignore[attr-defined]

        closer = threading.Thread(target=close)
        closer.start()
        time.sleep(0.3)  # the loop is busy while the close runs
        with pytest.raises(unison.SessionClosed):
            await asyncio.wait_for(wait, 5)
        await asyncio.get_running_loop().run_in_executor(None, closer.join)

    asyncio.run(main())
    assert seen == [set()]


def test_a_session_dropped_inside_a_running_loop_closes_at_garbage_collection(channel):
    """The loop's readers were bound methods of the router and of the waits, which held the
    session: dropped (never closed) inside a long-running loop, it stayed open with its
    workers up for as long as the loop ran."""

    async def main():
        sess = unison.Session(2, channel=channel)
        try:
            pids = await sess.run_async(os.getpid)
        except BaseException:
            sess.close(timeout=0)
            raise
        gone = weakref.ref(sess)
        del sess
        gc.collect()
        assert gone() is None, gc.get_referrers(gone())
        assert wait_gone(pids, 10.0) == []

    asyncio.run(main())


def test_an_await_timed_out_as_another_threads_run_delivers_its_last_reply(
        sess, monkeypatch):
    """A blocking run in another thread reads the await's last reply; between its check of
    the await's callback and its call, the loop's ``wait_for`` times out and clears it (the
    hold below waits for that, at the moment the reader looks at what is left). Before, the
    reader then called None: its run raised TypeError and dropped the rest of the replies it
    had read, leaving a worker a request behind. Now the callback is read once."""
    reader: list[threading.Thread] = []
    held: list[bool] = []

    class Held(Request):
        __slots__ = ("_left",)

        @property  # type: ignore[override]
        def remaining(self) -> int:
            if self._left == 0 and self.done is not None and threading.current_thread() in reader:
                deadline = time.monotonic() + 5
                while self.done is not None and time.monotonic() < deadline:
                    time.sleep(0.005)  # the loop's wait_for times out meanwhile
                held.append(self.done is None)
            return self._left

        @remaining.setter
        def remaining(self, value: int) -> None:
            self._left = value

    monkeypatch.setattr(api, "Request", Held)
    got: list[object] = []

    def run() -> None:
        try:
            got.append(sess.run(unison.rank))
        except BaseException as exc:
            got.append(exc)

    reader.append(threading.Thread(target=run))

    async def main() -> None:
        task = asyncio.ensure_future(asyncio.wait_for(sess.run_async(nap_then_rank, 0.3), 1))
        await asyncio.sleep(0.1)  # sent, and asleep: the reader's run goes after it
        reader[0].start()
        with pytest.raises(asyncio.TimeoutError):
            await task
        await asyncio.get_running_loop().run_in_executor(None, reader[0].join, 10)

    asyncio.run(main())
    assert held == [True]  # the window was hit: the reader held the await's last reply
    assert got == [[0, 1]]
    monkeypatch.undo()
    assert sess.run(unison.rank) == [0, 1]
    sess.sync()


def busy(seconds: float) -> int:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return unison.rank()


@pytest.mark.parametrize("channel", ["shm", "pipe"])
def test_replies_in_before_a_pause_past_the_deadline_are_returned(make_session, channel):
    """The controller stopped (SIGSTOP: a debugger, a suspended machine) past an awaited
    call's deadline, its replies in before it: the values, as a blocking wait's last look
    gives them. Before (issue 9, forty-ninth pass; an audit of pauses), the loop ran
    wait_for's timer before the replies' reader: TimeoutError "0 worker(s) [] had not
    answered", and run_async's values were lost."""
    import subprocess

    sess = make_session(2, channel=channel)
    me = os.getpid()

    async def main() -> list[int]:
        # stopped 0.3 s in for 2 s: the call (0.5 s) ends during it, the deadline (1.5 s) too
        pauser = subprocess.Popen(
            ["sh", "-c", f"sleep 0.3; kill -STOP {me}; sleep 2; kill -CONT {me}"],
            start_new_session=True)
        try:
            return await sess.run_async(busy, 0.5, timeout=1.5)
        finally:
            pauser.wait()

    assert asyncio.run(main()) == [0, 1]
