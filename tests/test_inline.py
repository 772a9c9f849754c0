"""Worker 0 inline in the controller (Session(n, inline_worker0=True)): the same results,
errors, collectives and cleanup as with a process, worker 0's share run by the calling
thread, and the limits it has said out loud."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from tests.support import await_beside_a_reader_that_empties_the_wake, wait_dead

import unison
from unison import worker
from unison.cancel import Board
from unison.errors import WorkerDied, WorkerError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def inline() -> Iterator[Callable[..., unison.Session]]:
    """``inline(n, **kw)``: a Session(n, inline_worker0=True), closed when the test ends;
    afterwards this process holds no fd, thread or register more than before."""
    fds = len(os.listdir("/proc/self/fd"))
    threads = threading.active_count()
    sessions: list[unison.Session] = []

    def make(n: int = 2, **kw: object) -> unison.Session:
        sess = unison.Session(n, inline_worker0=True, **kw)  # type: ignore[arg-type]
        sessions.append(sess)
        return sess

    yield make
    for sess in sessions:
        sess.close(timeout=2)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and threading.active_count() > threads:
        time.sleep(0.01)
    assert len(os.listdir("/proc/self/fd")) == fds
    assert threading.active_count() == threads
    assert worker.registers == {}


def who() -> tuple[int, int, int]:
    return unison.rank(), unison.world_size(), os.getpid()


def add(a: float, b: float) -> float:
    return a + b


def rank_array() -> np.ndarray:
    return np.full(1000, unison.rank() + 1.0)


def boom() -> None:
    raise ValueError(f"boom on {unison.rank()}")


def boom_on_0() -> int:
    if unison.rank() == 0:
        raise ValueError("boom on 0")
    return unison.rank()


def noop() -> None:
    return None


def test_worker_0_is_this_process_and_results_are_right(inline: Callable[..., unison.Session]
                                                        ) -> None:
    sess = inline(3)
    got = sess.run(who)
    assert [g[:2] for g in got] == [(0, 3), (1, 3), (2, 3)]
    assert got[0][2] == os.getpid()
    assert len({g[2] for g in got}) == 3
    ref = sess.call(add, 2, 0.5)
    assert ref.gather() == [2.5, 2.5, 2.5]
    assert sess[0].run(add, 1, 1) == [2]
    assert sess[1:].run(add, 1, 2) == [3, 3]


def test_who_this_is_answers_only_inside_worker_0s_calls(
        inline: Callable[..., unison.Session]) -> None:
    """While an inline session was open, unison.rank() anywhere in the controller said 0
    (and world_size() N), where it should raise as without a session."""
    sess = inline(2, num_groups=2)
    asks = (unison.rank, unison.world_size, unison.group, unison.group_rank,
            unison.group_size)
    for _ in range(2):  # before any call, and after one
        for ask in asks:
            with pytest.raises(RuntimeError, match="only works inside a function that a "
                                                   "unison worker runs"):
                ask()
        assert sess.run(lambda: [ask() for ask in asks]) == [[0, 2, 0, 0, 1], [1, 2, 1, 0, 1]]


def test_data_in_and_out_and_frees(inline: Callable[..., unison.Session]) -> None:
    sess = inline(2)
    big = np.arange(1 << 20, dtype=np.float64)  # 8 MiB: through the arena
    ref = sess.put(big)
    total = sess.call(lambda a: float(a.sum()), ref)
    assert total.gather() == [float(big.sum())] * 2
    parts = sess.scatter([np.ones(3), np.zeros(3)])
    back = parts.gather()
    assert [b.tolist() for b in back] == [[1, 1, 1], [0, 0, 0]]
    back[0][:] = 7  # the fetched copy is ours: worker 0's object is not changed through it
    assert parts.get(0).tolist() == [1, 1, 1]
    made = sess.call(np.full, 1 << 20, 3.0).gather()
    assert all(m.shape == (1 << 20,) and m[0] == 3.0 for m in made)
    del ref, total, parts, back
    sess.sync()
    sess.run(noop)  # carries the frees
    assert worker.object_count() == 0  # worker 0's registers are this process's
    assert sess[1].run(worker.object_count) == [0]


def test_collectives_across_worker_0_and_processes(inline: Callable[..., unison.Session]) -> None:
    sess = inline(3)
    out = sess.run(lambda: unison.allreduce(rank_array()))
    assert all(np.all(o == 6.0) for o in out)
    assert sess.run(lambda: unison.allgather(unison.rank())) == [[0, 1, 2]] * 3
    assert sess.run(lambda: unison.broadcast(unison.rank() * 10, src=2)) == [20] * 3


def test_errors_come_back_as_from_a_process(inline: Callable[..., unison.Session]) -> None:
    sess = inline(2)
    with pytest.raises(WorkerError, match="boom on 0") as info:
        sess.run(boom)
    assert sorted(info.value.errors) == [0, 1]
    sess.call(boom_on_0)
    with pytest.raises(WorkerError, match="boom on 0"):
        sess.sync()
    sess.sync()  # reported once
    assert sess.run(unison.rank) == [0, 1]


class ReprFails:
    """A callable object whose repr() raises: its error report names it all the same."""

    def __call__(self, x: int) -> None:
        raise ValueError("bad input")

    def __repr__(self) -> str:
        return f"ReprFails({self.weights})"  # type: ignore[attr-defined]


def test_an_error_its_report_trips_over_is_worker_0s_error_and_sync_returns(
        inline: Callable[..., unison.Session]) -> None:
    """Worker 0's error report never raises into the controller: the call's error comes
    back as a WorkerError, and worker 0's done position moves on (a sync returns)."""
    sess = inline(2)
    with pytest.raises(WorkerError, match="bad input"):
        sess[0].run(ReprFails(), 1, timeout=5)
    sess[0].call(ReprFails(), 1)
    with pytest.raises(WorkerError, match=r"bad input \(in <repr\(\) of this ReprFails"):
        sess.sync(timeout=5)
    assert sess.sync() is None
    assert sess.run(unison.rank) == [0, 1]


def test_an_exception_that_leaves_worker_0s_loop_leaves_no_sync_waiting(
        inline: Callable[..., unison.Session], monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever leaves worker 0's loop in the middle of a command (raised to the caller),
    that command is done: a later sync with no timeout does not wait for it for ever."""
    sess = inline(2)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the report broke")

    monkeypatch.setattr(worker.protocol, "pack_error", broken)
    with pytest.raises(RuntimeError, match="the report broke"):
        sess[0].call(boom)
    monkeypatch.undo()
    done = threading.Event()
    threading.Thread(target=lambda: (sess.sync(), done.set()), daemon=True).start()
    assert done.wait(5), "sync waits for a command worker 0 left"
    assert sess.run(unison.rank) == [0, 1]


class StrInterrupts(Exception):
    def __str__(self) -> str:
        raise KeyboardInterrupt


def raise_str_interrupts() -> None:
    raise StrInterrupts()


def test_ctrl_c_while_worker_0_reports_an_error_is_the_controllers(
        inline: Callable[..., unison.Session]) -> None:
    """Worker 0's error report swallows what a broken str() raises, but a KeyboardInterrupt
    there is the controller's Ctrl-C, as in the call itself: raised on, the session closed."""
    sess = inline(2)
    with pytest.raises(KeyboardInterrupt):
        sess[0].run(raise_str_interrupts)
    assert sess.closed


def test_many_calls_wrap_the_ring(inline: Callable[..., unison.Session]) -> None:
    """Worker 0 reads every entry as it is sent: the ring never waits for it."""
    sess = inline(2)
    payload = "x" * 3000
    for _ in range(3000):  # ~9 MB through a 2 MiB ring, each Ref freed by the next call
        sess.call(len, payload)
    sess.sync()
    assert sess.run(len, payload) == [3000, 3000]


def test_await_on_an_inline_session(inline: Callable[..., unison.Session]) -> None:
    sess = inline(2)

    async def main() -> list[object]:
        ref = sess.call(add, 1, 2)
        return [await ref, await sess.run_async(unison.rank)]

    assert asyncio.run(main()) == [[3, 3], [0, 1]]


@pytest.mark.parametrize("reply_first", [False, True], ids=["reply_after_flag",
                                                            "reply_before_flag"])
def test_an_await_turned_away_by_a_reader_that_empties_the_wake_fd_still_wakes(
        inline: Callable[..., unison.Session], monkeypatch: pytest.MonkeyPatch,
        reply_first: bool) -> None:
    """As tests/test_asyncio.py's, with worker 0's share run by the sending threads."""
    sess = inline(2)
    assert await_beside_a_reader_that_empties_the_wake(sess, monkeypatch, reply_first) == [0, 1]
    assert sess.run(unison.rank) == [0, 1]


def test_a_dead_process_worker_is_still_noticed(inline: Callable[..., unison.Session]) -> None:
    sess = inline(2)
    pid = sess[1].run(os.getpid)[0]
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    with pytest.raises(WorkerDied) as info:
        sess.run(noop)
    assert info.value.worker == 1
    again = inline(2)  # worker 0's place is free again once the session is closed
    assert again.run(unison.rank) == [0, 1]


def exit_or_allreduce() -> object:
    if unison.rank() == 1:
        os._exit(3)
    return unison.allreduce(np.ones(3))


def test_a_peer_dying_while_worker_0_waits_in_a_collective(
        inline: Callable[..., unison.Session]) -> None:
    """Worker 0's collective runs in the controller's own thread, which no other wait can
    interrupt: it must see the peer's death itself (it hung for good before)."""
    sess = inline(2)
    start = time.monotonic()
    with pytest.raises(WorkerDied) as info:
        sess.run(exit_or_allreduce, timeout=30)
    assert info.value.worker == 1
    assert time.monotonic() - start < 2.0


def stop_or_barrier() -> object:
    if unison.rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # stopped: alive, but never arrives
    unison.barrier()
    return unison.rank()


def test_a_stopped_peer_holds_worker_0_no_longer_than_the_deadline(
        inline: Callable[..., unison.Session]) -> None:
    """A stopped peer is no death that worker 0 could see, and worker 0's wait runs in the
    controller's thread: its collective gives up at the run's deadline, so the controller
    raises TimeoutError then (before: only once the peer went on), naming the stopped one."""
    sess = inline(2)
    peer = sess._pids[1]
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError) as info:
            sess.run(stop_or_barrier, timeout=0.5)
        took = time.monotonic() - start
    finally:
        os.kill(peer, signal.SIGCONT)
    assert took < 2.0, f"worker 0 waited {took:.1f} s for a stopped peer past a 0.5 s deadline"
    assert "1 worker(s) [1] had not answered" in str(info.value), str(info.value)
    assert "stopped" in str(info.value)
    assert sess.run(stop_or_barrier_later, timeout=30) == [0, 1]  # the session goes on
    # worker 0's own error in the timed-out run: said at close, as any error never fetched
    with pytest.warns(RuntimeWarning, match=r"barrier\(\) on worker 0 gave up at the deadline"):
        sess.close()


def stop_or_barrier_later() -> object:
    unison.barrier()
    return unison.rank()


def late_allgather() -> object:
    if unison.rank() == 1:
        time.sleep(0.3)  # worker 0 waits long enough to watch its peer's pid
    return unison.allgather(unison.rank())


def test_a_long_wait_leaves_no_fd_once_the_call_ends(
        inline: Callable[..., unison.Session]) -> None:
    """Worker 0's long waits open a pidfd per peer; they close with the call, not the
    session (the chaos loop saw one left open between rounds)."""
    sess = inline(2)
    assert sess.run(unison.rank, timeout=30) == [0, 1]  # no collective yet
    fds = sorted(os.listdir("/proc/self/fd"))
    for _ in range(3):
        assert sess.run(late_allgather, timeout=30) == [[0, 1]] * 2
    assert sorted(os.listdir("/proc/self/fd")) == fds


KEPT: list[BaseException] = []


def allreduce_and_keep_an_error() -> object:
    """User code that keeps a collective's error, traceback and all (say, to log later)."""
    try:
        unison.allreduce(np.ones(2), op="no such op")
    except Exception as exc:
        if unison.rank() == 0:
            KEPT.append(exc)
    return unison.allreduce(np.ones(2)).tolist()


def test_worker_0s_collectives_unmap_at_close_even_where_user_code_keeps_a_frame(
        inline: Callable[..., unison.Session]) -> None:
    """A kept traceback holds worker 0's collectives by its frames: their mapping (and its
    copy of the segment's fd) must still go at close, not with the last reference."""
    before = sorted(os.listdir("/proc/self/fd"))
    sess = inline(2)
    assert sess.run(allreduce_and_keep_an_error, timeout=30) == [[2.0, 2.0]] * 2
    assert KEPT
    sess.close()
    try:
        assert sorted(os.listdir("/proc/self/fd")) == before
    finally:
        KEPT.clear()


def test_one_inline_session_per_process(inline: Callable[..., unison.Session]) -> None:
    first = inline(2)
    with pytest.raises(RuntimeError, match="only one session at a time"):
        unison.Session(2, inline_worker0=True)
    first.close()
    assert inline(2).run(unison.rank) == [0, 1]


def open_inline_inside() -> tuple[int, str]:
    """What a worker's function gets from Session(2, inline_worker0=True), and its rank after."""
    try:
        unison.Session(2, inline_worker0=True).close()
        why = "opened"
    except RuntimeError as exc:
        why = str(exc)
    return unison.rank(), why


def test_an_inline_session_inside_a_worker_is_refused(make_session) -> None:
    """Opened inside a worker's function, an inline session took over that worker's state:
    its rank (worker 1's rank() said 0), its Refs (the inner put overwrote the outer Ref's
    register) and its collectives; after its close, rank() raised there."""
    outer = make_session(2)
    kept = outer.put("outer value")
    got = outer.run(open_inline_inside, timeout=60)
    assert [rank for rank, _ in got] == [0, 1]
    for _, why in got:
        assert "inside a function that a unison worker runs" in why
        assert "open Session(n) without inline_worker0" in why
    assert kept.gather(timeout=30) == ["outer value"] * 2
    assert outer.run(unison.rank, timeout=30) == [0, 1]
    # worker 0 inline is a unison worker too: the same refusal inside its calls
    sess = make_session(2, inline_worker0=True)
    assert [why for _, why in sess.run(open_inline_inside, timeout=60)] == [got[0][1]] * 2


@pytest.mark.parametrize("kw, match", [
    ({"env": {0: {"A": "1"}}}, "env\\[0\\]"),
    ({"cpu_affinity": {0: [sorted(os.sched_getaffinity(0))[0]]}}, "cpu_affinity"),
    ({"channel": "pipe"}, "shared-memory channel"),
    ({"collectives": "torch"}, "collectives='shm'"),
    ({"launcher": "connect"}, "local launcher"),
])
def test_what_worker_0_cannot_have_is_refused(
        inline: Callable[..., unison.Session], kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        inline(2, **kw)


def test_a_cancel_never_signals_the_controller() -> None:
    """A board that sees worker 0 (this process) inside the call must not signal it: the
    signal's default action would end the controller. It reports it as still inside."""
    board = Board(2)
    try:
        board.mark(0).enter(7)
        assert board.stop(7, [0], [os.getpid()], [None], timeout=0.05) == ([0], set())
    finally:
        board.close()


def test_stacks_and_cancel_never_signal_the_controller(
        inline: Callable[..., unison.Session]) -> None:
    sess = inline(2)
    stacks = sess.stacks()
    assert "inline in the controller" in stacks[0].error
    assert stacks[1].main is not None

    def slow() -> int:
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            time.sleep(0.01)
        return unison.rank()

    box: list[object] = []
    t = threading.Thread(target=lambda: box.append(sess.call(slow)))
    t.start()  # worker 0's share runs in that thread; worker 1 runs it too
    time.sleep(0.2)
    ref = sess.call(noop)  # waits for the send lock: the thread holds it while worker 0 runs
    t.join()
    slow_ref = box[0]
    assert isinstance(slow_ref, unison.Ref)
    # a Ref comes back once worker 0's share is done, so a cancel never finds worker 0
    # inside its call; worker 1 may still run it: it is interrupted, we are not signalled
    slow_ref.cancel(timeout=2.0)
    assert ref.gather() == [None, None]
    assert sess.run(unison.rank) == [0, 1]


def sleep_for(*, seconds: float) -> None:
    time.sleep(seconds)


@pytest.mark.timeout(20)  # (before: the handler's close waited for ever)
@pytest.mark.parametrize("how", ["run", "call"])
def test_a_signal_handlers_close_inside_worker_0s_call(
        inline: Callable[..., unison.Session], how: str) -> None:
    """A signal handler closes the session while worker 0's share of a call runs, in this
    thread, under the launcher's lock: stop() took that plain Lock again and waited for
    ever. Now pump closes worker 0 once its call returns: the handler's close returns, the
    call raises SessionClosed, and nothing is left (the fixture's checks; worker 0's place
    in this process is free again)."""
    sess = inline(2)
    pids = sess.run(os.getpid)
    closed: list[bool] = []

    def close(*_: object) -> None:
        sess.close()
        closed.append(True)

    previous = signal.signal(signal.SIGUSR1, close)  # (SIGALRM is pytest-timeout's)
    timer = threading.Timer(0.2, signal.pthread_kill, (threading.get_ident(), signal.SIGUSR1))
    timer.start()
    try:
        with pytest.raises(unison.SessionClosed, match="the session is closed"):
            if how == "run":
                sess.run(time.sleep, 1)
            else:
                sess.call(time.sleep, 1)
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, previous)
    assert closed == [True]
    wait_dead(pids[1])
    assert inline(2).run(unison.rank) == [0, 1]


RAN: list[int] = []


def note_rank(*, tag: int = 0) -> None:
    RAN.append(unison.rank())


def ran_here() -> list[int]:
    return list(RAN)


def forget_ran() -> None:
    RAN.clear()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("how", ["quick", "general"])
def test_a_signal_handlers_call_inside_worker_0s_call_is_refused_before_it_is_sent(
        inline: Callable[..., unison.Session], how: str) -> None:
    """A handler's call (not a close) inside worker 0's call: worker 0 could not run it
    until that call ends. It was refused only after the message went out, so the workers
    ran it all the same (worker 0 later), behind an error that said it could not run. Now
    it raises before anything is sent, and the session goes on."""
    sess = inline(2)
    sess.run(note_rank)  # both ways defined on the workers: the handler's call is a CALL
    sess.run(note_rank, tag=1)
    sess.run(forget_ran)
    got: list[BaseException] = []

    def call_inside(*_: object) -> None:
        try:
            if how == "quick":
                sess.call(note_rank)
            else:
                sess.call(note_rank, tag=1)
        except RuntimeError as exc:
            got.append(exc)

    previous = signal.signal(signal.SIGUSR1, call_inside)
    timer = threading.Timer(0.2, signal.pthread_kill, (threading.get_ident(), signal.SIGUSR1))
    timer.start()
    try:
        assert sess.run(sleep_for, seconds=0.6) == [None, None]
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, previous)
    try:
        assert sess.run(ran_here) == [[], []]  # (before: the refused call ran all the same)
    finally:
        RAN.clear()  # (worker 0's list is this process's)
    assert len(got) == 1 and "nothing was sent" in str(got[0])


@pytest.mark.parametrize("path", ["quick", "general"])
def test_ctrl_c_in_worker_0s_call_is_the_controllers(
        inline: Callable[..., unison.Session], path: str) -> None:
    """Worker 0's call runs in the controller's thread: Ctrl-C there is Ctrl-C during a
    wait (KeyboardInterrupt, the session closed), never that call's error. Both ways a
    call is sent: plain arguments (Session._send_quick's own frame) and keywords."""
    sess = inline(2)
    timer = threading.Timer(0.1, signal.pthread_kill, (threading.get_ident(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            if path == "quick":
                sess.run(time.sleep, 30)
            else:
                sess.run(sleep_for, seconds=30)
    finally:
        timer.join()
    assert sess.closed


def _sleep_then(x: float) -> float:
    time.sleep(x)
    return x


def test_a_sync_from_one_thread_waits_for_worker_0s_call_in_another(make_session) -> None:
    """The check that this thread is not inside worker 0's inline call looked at a flag of
    the whole process: a plain sync() from thread A raised "worker 0 runs inline in this
    thread, where it is in the middle of a call" while thread B's call ran worker 0."""
    sess = make_session(2, inline_worker0=True)
    t = threading.Thread(target=lambda: sess.call(_sleep_then, 1.0))
    t.start()
    try:
        time.sleep(0.2)
        sess.sync(timeout=30)  # waits for B's call
    finally:
        t.join(30)
    assert sess.run(abs, -3) == [3, 3]


RELEASE = threading.Event()


def wait_for_release() -> bool:
    return RELEASE.wait(30)


def test_a_close_from_another_thread_does_not_wait_for_worker_0s_call(
        inline: Callable[..., unison.Session]) -> None:
    """close(timeout=0.5) from one thread while another's call ran in worker 0 waited for
    that whole call (worker 0's lock, then the send lock its thread held)."""
    sess = inline(2)
    pid = sess._pids[1]
    got: list[object] = []

    def call() -> None:
        try:
            got.append(sess[0].run(wait_for_release))
        except unison.SessionClosed as exc:
            got.append(exc)

    RELEASE.clear()
    t = threading.Thread(target=call)
    t.start()
    try:
        launcher = sess._res.launcher
        deadline = time.monotonic() + 10
        while not launcher._pumping:  # (until worker 0's call runs in that thread)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        sess.close(timeout=0.5)
        assert time.monotonic() - t0 < 3.0  # (its grace 0.5 s; before, the call's 30 s)
        wait_dead(pid, 1.0)  # the processes are stopped as ever
        assert t.is_alive()  # worker 0's call goes on
    finally:
        RELEASE.set()
        t.join(30)
    assert len(got) == 1 and isinstance(got[0], unison.SessionClosed)
    # worker 0 let go of all it held once its call returned (the fixture counts the fds):
    # another inline session may open
    assert inline(2).run(unison.rank) == [0, 1]


def test_the_exit_does_not_wait_for_worker_0s_call_in_a_daemon_thread(controller) -> None:
    """At the interpreter's exit, atexit's close(timeout=1.0) waited for a call running in
    worker 0 in a daemon thread (15 s of a sleep; for ever for a serving loop)."""
    proc = controller("""
        import os, threading, time
        import unison

        sess = unison.Session(2, inline_worker0=True)
        threading.Thread(target=sess.run, args=(time.sleep, 60), daemon=True).start()
        time.sleep(0.5)
        print(sess._pids[1], flush=True)
    """)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert time.monotonic() - t0 < 10, err
    wait_dead(int(out.split()[0]), 2.0)


def spin_for(seconds: float) -> int:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return unison.rank()


def test_a_cancel_landing_while_worker_0_runs_the_call_is_a_cancel(
        inline: Callable[..., unison.Session]) -> None:
    """A ``ref.cancel()`` from another thread while worker 0 (inline) runs the call: a
    CancelledError, nothing left to report at sync. Before (the review of issue 9's
    forty-ninth pass), worker 0's end of it was taken for a Cancelled its function raised
    of itself (the check read a board only worker processes set): WorkerError."""
    from unison.refs import Ref

    sess = inline(2)
    box: dict[str, unison.Ref] = {}
    t = threading.Thread(target=lambda: box.setdefault("ref", sess.call(spin_for, 1.0)))
    t.start()
    board = sess._res.board
    end = time.monotonic() + 5
    while not board.running(1) and time.monotonic() < end:  # worker 1 inside the call
        time.sleep(0.01)
    ghost = Ref(sess, board.running(1), (0, 1))  # the Ref the thread gets only at the end
    try:
        ghost.cancel(timeout=3.0)
    finally:
        ghost._freed = True  # (the thread's own Ref frees it)
        t.join()
    with pytest.raises(unison.CancelledError):
        box["ref"].gather()
    assert sess.sync() is None
    assert sess.run(unison.rank) == [0, 1]
