"""Collectives when a peer fails: a worker that raises, returns early or dies never leaves the
others waiting. Each waiting collective raises CollectiveError within a second; the
controller gets a WorkerError (or WorkerDied, for a death) at once; after a raise the session
goes on, and the next collective in a new call gives the right answer; after a death no
worker process survives. The same holds with the torch.distributed backend (gloo).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import unison
from support import wait_gone
from unison import CollectiveError, SessionClosed, WorkerDied, WorkerError

DETECT = 1.0  # the contract: a waiting collective gives up within 1 s of the peer's failure
DELAY = 0.2  # the failing worker fails this long after the call starts
LIMIT = 10.0  # wait no longer than this for any call: a hang fails instead of stalling


# -- functions the workers run ------------------------------------------------------------------


def join(kind: str) -> Any:
    """Join one collective of kind ``kind`` (every worker passes the same shapes)."""
    r = unison.rank()
    if kind == "allreduce":
        return unison.allreduce(np.full(4, float(r)))
    if kind == "allreduce-large":  # past the small path: reduce-scatter, then allgather
        return unison.allreduce(np.full(1 << 18, float(r)))
    if kind == "reduce_scatter":
        return unison.reduce_scatter(np.arange(6.0))
    if kind == "barrier":
        return unison.barrier()
    if kind == "allgather":
        return unison.allgather({"rank": r})
    if kind == "broadcast":
        return unison.broadcast("hello" if r == 0 else None)
    if kind == "gather":
        return unison.gather(r)
    if kind == "torch-allreduce":
        import torch

        return unison.allreduce(torch.full((4,), float(r)))
    raise AssertionError(kind)


def fail_or_join(stamps: np.ndarray, failer: int, how: str, kind: str) -> Any:
    """Worker ``failer`` fails after DELAY (``how``: raise, return, exit or kill); the others
    join the collective. ``stamps[r]`` gets (when r failed or joined, when its collective
    gave up), on the clock every process shares."""
    r = unison.rank()
    if r == failer:
        time.sleep(DELAY)
        stamps[r, 0] = time.monotonic()
        if how == "raise":
            raise ValueError(f"boom on worker {r}")
        if how == "exit":
            os._exit(7)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return "left early"
    stamps[r, 0] = time.monotonic()
    try:
        return join(kind)
    except CollectiveError:
        stamps[r, 1] = time.monotonic()
        raise


def die_or_join(failer: int, how: str, kind: str) -> Any:
    """As fail_or_join, without the stamps (a dead session's shared memory goes away)."""
    if unison.rank() == failer:
        time.sleep(DELAY)
        if how == "exit":
            os._exit(7)
        os.kill(os.getpid(), signal.SIGKILL)
    return join(kind)


def allreduce_rank() -> Any:
    return unison.allreduce(np.array([unison.rank() + 1.0, 2.0]), "sum")


def allreduce_large_rank() -> float:
    out = unison.allreduce(np.full(1 << 18, unison.rank() + 1.0), "max")
    return float(out.min())


def torch_allreduce_rank() -> list[float]:
    import torch

    return unison.allreduce(torch.tensor([unison.rank() + 1.0, 2.0])).tolist()


def recv_after(sender_sends: int, receiver_recvs: int, sender_raises: bool) -> Any:
    """Worker 0 sends ``sender_sends`` messages to worker 1 (then maybe raises); worker 1
    tries to receive ``receiver_recvs``."""
    if unison.rank() == 0:
        for i in range(sender_sends):
            unison.send(f"message {i}", 1)
        if sender_raises:
            raise KeyError("the sender failed")
        return None
    got = []
    for _ in range(receiver_recvs):
        got.append(unison.recv(0))
    return got


def ping() -> Any:
    """A plain exchange: worker 0 sends its rank-stamped message, worker 1 answers."""
    if unison.rank() == 0:
        unison.send("ping", 1)
        return unison.recv(1)
    msg = unison.recv(0)
    unison.send(msg + "-pong", 0)
    return msg


def group_barrier_or_leave(leaver: int) -> str:
    if unison.rank() == leaver:
        return "left"
    unison.barrier(group=True)
    return "passed"


# -- checks --------------------------------------------------------------------------------------


def stamps_for(sess: unison.Session) -> np.ndarray:
    """An array the workers write and the controller reads: in the session's shared memory,
    and large enough to travel out of band (small arrays are copied into the message)."""
    stamps = sess.empty((sess.num_workers, 1 << 13), np.float64)
    stamps[:] = np.nan
    return stamps


def check_prompt_failure(sess: unison.Session, failer: int, how: str, kind: str) -> WorkerError:
    """Run the failing call; check that the controller and every waiter gave up at once."""
    n = sess.num_workers
    stamps = stamps_for(sess)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        sess.run(fail_or_join, stamps, failer, how, kind, timeout=LIMIT)
    elapsed = time.monotonic() - start
    assert elapsed < DELAY + DETECT + 0.3, f"the controller waited {elapsed:.2f} s"
    err = info.value
    waiters = [r for r in range(n) if r != failer]
    # every waiter's collective raised CollectiveError, soon after the failure
    failed_at = stamps[failer, 0]
    for r in waiters:
        assert isinstance(err.errors.get(r), CollectiveError), (r, err.errors)
        gave_up = stamps[r, 1]
        assert not np.isnan(gave_up), f"worker {r}'s collective did not raise"
        assert gave_up - failed_at < DETECT, f"worker {r} waited {gave_up - failed_at:.2f} s"
        assert f"worker {failer}" in str(err.errors[r]), "the error names the peer that left"
        assert err.errors[r].peer == failer, "the error says whose leaving it reports"
    assert err.worker == min(err.errors)  # the contract: the lowest failed rank
    text = str(err)
    if how == "raise":
        assert isinstance(err.errors[failer], ValueError)
        assert "boom" in str(err.errors[failer])
        assert sorted(err.errors) == list(range(n))
    else:
        assert sorted(err.errors) == waiters
    if how == "raise" and failer != err.worker:  # the message leads to where it began
        assert (f"It began on worker {failer}, which raised ValueError: boom on worker "
                f"{failer}") in text, text
        assert f"Remote traceback (worker {failer}, where it began):" in text, text
        assert 'raise ValueError(f"boom on worker {r}")' in text, text
    else:  # the lowest rank's own error is where it began
        assert "It began" not in text, text
    return err


def check_session_goes_on(sess: unison.Session) -> None:
    """A new call's collectives work and give the right answer."""
    n = sess.num_workers
    want = [n * (n + 1) / 2, 2.0 * n]
    for got in sess.run(allreduce_rank, timeout=LIMIT):
        np.testing.assert_array_equal(got, want)
    assert sess.run(allreduce_large_rank, timeout=LIMIT) == [float(n)] * n
    assert sess.run(join, "barrier", timeout=LIMIT) == [None] * n


def leave_a_barrier_behind(path: str) -> None:
    """Start a thread that joins a barrier once this call has returned, and writes what came
    of it to ``path``."""

    def later() -> None:
        time.sleep(DELAY)
        try:
            unison.barrier()
            got = "joined"
        except BaseException as exc:
            got = f"{type(exc).__name__}: {exc}"
        Path(path + ".part").write_text(got)
        os.replace(path + ".part", path)  # whole, or not there

    threading.Thread(target=later, daemon=True).start()


# -- a worker raises ---------------------------------------------------------------------------


def test_a_collective_from_a_thread_that_outlived_its_call_raises_at_once(make_session,
                                                                          tmp_path):
    """No call runs, so the collective has none to belong to: it raises, where it once took
    the last call's id and waited for peers that had left it."""
    sess = make_session(2)
    check_session_goes_on(sess)  # the workers' collectives have begun a call before
    out = tmp_path / "got"
    sess[0].run(leave_a_barrier_behind, str(out), timeout=LIMIT)
    deadline = time.monotonic() + LIMIT
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert out.read_text().startswith("RuntimeError: unison collectives only work inside a "
                                      "function"), out.read_text()
    assert "while it runs" in out.read_text()
    check_session_goes_on(sess)



def two_threads_at_once(inline_send: bool) -> str:
    """Worker 0: a thread waits in a recv from worker 1 while the call's own thread starts
    an allreduce (or a send); worker 1 sends once that has had its time. What worker 0's
    second collective did, and the recv's value."""
    if unison.rank() == 1:
        time.sleep(0.5)
        unison.send("late", 0)
        return "sent"
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(unison.recv(1)))
    waiter.start()
    time.sleep(0.2)  # the waiter is inside its recv by now (worker 1 sends at 0.5 s)
    try:
        if inline_send:
            unison.send("x", 1)
        else:
            unison.allreduce(np.ones(4))
        what = "ran"
    except RuntimeError as exc:
        what = str(exc)
    waiter.join()
    return f"{what} | {got}"


def collective_from_one_thread_at_a_time() -> float:
    """A collective from a thread of the call, joined before the next one: allowed."""
    out: list[Any] = []
    helper = threading.Thread(target=lambda: out.append(unison.allreduce(np.ones(3))))
    helper.start()
    helper.join()
    return float(unison.allreduce(out[0])[0])


@pytest.mark.parametrize("inline_send", [False, True], ids=["allreduce", "send"])
def test_two_threads_of_a_worker_in_collectives_at_once_are_refused(make_session, inline_send):
    """Two threads of one worker in collectives at once took each other's places in the
    order every worker follows (which one met a peer's first was chance), or wrote one
    message slot twice: wrong results, with no error. The second now raises at once, and
    the first goes on."""
    sess = make_session(2)
    said, sent = sess.run(two_threads_at_once, inline_send, timeout=LIMIT)
    assert sent == "sent"
    assert said.startswith("a thread of this worker called "
                           + ("send" if inline_send else "allreduce")
                           + " while another of its threads is inside recv: "), said
    assert said.endswith(" | ['late']"), said
    assert sess.run(collective_from_one_thread_at_a_time, timeout=LIMIT) == [4.0, 4.0]
    check_session_goes_on(sess)


def allreduce_for_ever() -> None:
    x = np.ones(4)
    while True:
        unison.allreduce(x)


def in_a_collective() -> bool:
    from unison import collective

    return bool(collective._inside[0])


def test_cancels_landing_anywhere_in_a_collective_never_leave_it_marked(make_session):
    """A lock taken around each collective stayed held where a Cancelled landed between its
    acquire and its try (a review found it, 1 cancel in 16): every later collective of that
    worker raised "another of its threads is inside allreduce"."""
    import random

    rng = random.Random(0)
    sess = make_session(2)
    for _ in range(60):
        ref = sess.call(allreduce_for_ever)
        time.sleep(rng.uniform(0.002, 0.02))
        ref.cancel(timeout=LIMIT)
        with pytest.raises((unison.CancelledError, WorkerError)):
            ref.gather(timeout=LIMIT)
        assert sess.run(in_a_collective, timeout=LIMIT) == [False, False]
    check_session_goes_on(sess)


@pytest.mark.parametrize("kind", ["allreduce", "allreduce-large", "reduce_scatter", "barrier",
                                  "allgather", "broadcast"])
def test_a_raise_before_a_collective_fails_the_waiters_within_a_second(make_session, kind):
    sess = make_session(3)
    check_prompt_failure(sess, 1, "raise", kind)
    check_session_goes_on(sess)


def test_repeated_failures_leave_the_session_usable(make_session):
    """Failures by different workers, at different collectives, one after the other."""
    sess = make_session(3)
    for failer, kind in [(0, "allreduce"), (2, "barrier"), (1, "allreduce-large")]:
        check_prompt_failure(sess, failer, "raise", kind)
        check_session_goes_on(sess)


# -- a worker returns early ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["barrier", "allreduce"])
def test_a_worker_returning_early_fails_the_others(make_session, kind):
    sess = make_session(3)
    err = check_prompt_failure(sess, 0, "return", kind)
    assert all(isinstance(e, CollectiveError) for e in err.errors.values())
    check_session_goes_on(sess)


def return_or_join(leaver: int, kind: str) -> Any:
    """Worker ``leaver`` returns after DELAY without joining; the others join ``kind``."""
    if unison.rank() == leaver:
        time.sleep(DELAY)
        return "left"
    return join(kind)


@pytest.mark.parametrize("kind", ["allreduce", "reduce_scatter", "barrier", "allgather"])
def test_a_peer_already_in_the_next_call_is_never_taken_for_one_that_joined(make_session,
                                                                          kind):
    """The next call is queued, so the worker that returned early runs the same collective
    there at once, while the others still wait in this call. Its arrival (and its data)
    belongs to the next call: the waiters must raise, not return a result mixed with it."""
    sess = make_session(2)
    first = sess.call(return_or_join, 1, kind)
    second = sess.call(join, kind)
    with pytest.raises(WorkerError) as info:
        first.gather(timeout=LIMIT)
    assert isinstance(info.value.errors.get(0), CollectiveError), info.value.errors
    assert "worker 1 left the call" in str(info.value.errors[0])
    again = sess.run(join, kind, timeout=LIMIT)  # a call nobody left: the right answer
    assert [repr(v) for v in second.gather(timeout=LIMIT)] == [repr(v) for v in again]


def read_late_or_fail_after_meeting(values: list[float]) -> tuple[str, Any]:
    """Worker 0 pauses between the meeting and reading its peers' inputs; worker 1 fails
    right after the meeting, and its next call (queued) runs another allreduce at once.
    complex128: numpy's path, whose Python steps can be made to fail here (a float64 sum
    runs its meeting and its reads in one C call: unison/_coll.c)."""
    from unison.collective import shm

    r = unison.rank()
    if r == 0:
        plain_meet = shm.ShmCollectives._meet

        def late(self: Any, *args: Any) -> None:
            plain_meet(self, *args)
            shm.ShmCollectives._meet = plain_meet
            time.sleep(DELAY)

        shm.ShmCollectives._meet = late
    if r == 1:
        plain_reduce = shm._reduce_into

        def fail(*args: Any) -> None:
            shm._reduce_into = plain_reduce
            raise RuntimeError("failed after the meeting")

        shm._reduce_into = fail
    try:
        return "ok", unison.allreduce(np.full(4, values[r], np.complex128)).real.tolist()
    except Exception as exc:
        return type(exc).__name__, str(exc)


def test_a_peer_that_fails_after_the_meeting_never_overwrites_what_others_read(make_session):
    """Its next call must not write its input slot while a slower peer still reads the
    failed call's: that peer's result is the right sum or an error, never the next call's
    data mixed in."""
    sess = make_session(2)
    first = sess.call(read_late_or_fail_after_meeting, [1.0, 2.0])
    second = sess.call(join, "allreduce")
    got = first.gather(timeout=LIMIT)
    assert got[1][0] == "RuntimeError", got
    assert got[0] in [("ok", [3.0] * 4)] or got[0][0] == "CollectiveError", got
    assert [v.tolist() for v in second.gather(timeout=LIMIT)] == [[1.0] * 4] * 2


def catch_then_go_on(leaver: int, then: str) -> str:
    """Worker ``leaver`` returns at once; the others catch their failed allreduce and go on
    to another collective in the same call (a barrier, or a small allreduce: the C steps
    take its generation where they were built)."""
    if unison.rank() == leaver:
        return "left"
    try:
        unison.allreduce(np.ones(4))
    except CollectiveError:
        pass
    try:
        if then == "barrier":
            unison.barrier()
        else:
            unison.allreduce(np.ones(4))
    except CollectiveError as exc:
        return str(exc)
    return f"the {then} passed"


@pytest.mark.parametrize("then", ["barrier", "allreduce"])
def test_after_a_failed_collective_the_rest_of_the_call_raises(make_session, then):
    """Peers of a failed collective may be anywhere in it (one still reading our input),
    so a worker that catches the error and goes on is out of step: its next collective
    in that call raises at once, saying so; the next call is in step again."""
    sess = make_session(3)
    got = sess.run(catch_then_go_on, 1, then, timeout=LIMIT)
    assert got[1] == "left"
    for r in (0, 2):
        assert "an earlier collective of this call failed" in got[r], got
    check_session_goes_on(sess)


def leave_messages_unreceived() -> None:
    if unison.rank() == 0:
        for i in range(64):  # every entry of the ring to worker 1, never taken
            unison.send(i, 1)
    unison.barrier()


def spill_fails_or_recv() -> str:
    """Worker 0's send of a large array fails making its spill; worker 1 waits for it."""
    from unison.collective import shm

    if unison.rank() == 0:
        plain = shm._spill

        def no_room(*args: Any) -> int:
            shm._spill = plain
            raise OSError(28, "no room for the spill (simulated)")

        shm._spill = no_room
        try:
            unison.send(np.zeros(1 << 20), 1)  # 8 MiB: more than fits inline
        except OSError as exc:
            return f"send failed: {exc}"
        return "sent"
    time.sleep(DELAY)  # worker 0 has failed and left by now
    try:
        unison.recv(0)
    except CollectiveError as exc:
        return str(exc)
    return "received"


def test_a_send_that_fails_leaves_the_receiver_an_error_not_a_spin(make_session):
    """The failed send must not leave its ring entry marked 'being written' (here over a
    stale message of the last call): the receiver would spin on it at 100% CPU forever,
    never looking whether the sender left."""
    sess = make_session(2)
    sess.run(leave_messages_unreceived, timeout=LIMIT)
    sent, received = sess.run(spill_fails_or_recv, timeout=LIMIT)
    assert sent.startswith("send failed"), sent
    assert "worker 0 left the call without sending" in received, received
    check_session_goes_on(sess)


def pass_it_down() -> int:
    """Worker 2 raises; worker 1 waits to receive from 2, worker 0 from 1: a chain of
    reports, each of a peer that left."""
    r = unison.rank()
    if r == 2:
        raise KeyError("the first failure")
    return int(unison.recv(r + 1))


def test_a_chain_of_reports_leads_to_the_worker_where_it_began(make_session):
    sess = make_session(3)
    with pytest.raises(WorkerError) as info:
        sess.run(pass_it_down, timeout=LIMIT)
    err = info.value
    assert err.worker == 0 and sorted(err.errors) == [0, 1, 2]
    assert [getattr(err.errors[r], "peer", None) for r in range(3)] == [1, 2, None]
    text = str(err)
    assert "It began on worker 2, which raised KeyError: 'the first failure'" in text, text
    assert "Remote traceback (worker 2, where it began):" in text, text
    assert sess.run(unison.rank, timeout=LIMIT) == [0, 1, 2]


def test_a_worker_leaving_a_group_barrier_fails_only_its_group(make_session):
    sess = make_session(4, num_groups=2)
    with pytest.raises(WorkerError) as info:
        sess.run(group_barrier_or_leave, 3, timeout=LIMIT)
    assert sorted(info.value.errors) == [2]
    assert isinstance(info.value.errors[2], CollectiveError)
    assert sess.run(group_barrier_or_leave, -1, timeout=LIMIT) == ["passed"] * 4


# -- a worker dies -------------------------------------------------------------------------------


def check_prompt_death(sess: unison.Session, failer: int, how: str, kind: str) -> None:
    n = sess.num_workers
    pids = sess.run(os.getpid, timeout=LIMIT)
    start = time.monotonic()
    with pytest.raises(WorkerDied) as info:
        sess.run(die_or_join, failer, how, kind, timeout=LIMIT)
    elapsed = time.monotonic() - start
    assert elapsed < DELAY + DETECT, f"WorkerDied came {elapsed - DELAY:.2f} s after the death"
    died = info.value
    assert died.worker == failer
    assert died.exitcode == (7 if how == "exit" else -signal.SIGKILL)
    assert wait_gone(pids, 3.0) == [], "worker processes survived the death"
    with pytest.raises(SessionClosed) as closed:
        sess.run(unison.rank)
    assert closed.value.__cause__ is died
    assert len(pids) == n


@pytest.mark.parametrize("how", ["exit", "kill"])
@pytest.mark.parametrize("kind", ["allreduce", "allreduce-large", "barrier"])
def test_a_death_during_a_collective_raises_worker_died_within_a_second(make_session, how,
                                                                        kind):
    check_prompt_death(make_session(3), 2, how, kind)


# -- point to point ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sends", "recvs", "raises"),
    [(0, 1, False), (0, 1, True), (1, 2, False), (2, 3, True)],
    ids=["returned", "raised", "one-short", "raised-after-two"],
)
def test_recv_from_a_worker_that_left_without_sending_raises(make_session, sends, recvs,
                                                              raises):
    sess = make_session(2)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        sess.run(recv_after, sends, recvs, raises, timeout=LIMIT)
    assert time.monotonic() - start < DETECT
    err = info.value.errors[1]
    assert isinstance(err, CollectiveError), info.value.errors
    assert "worker 0" in str(err)
    if raises:
        assert isinstance(info.value.errors[0], KeyError)
    else:
        assert sorted(info.value.errors) == [1]
    # the pair still talks in the next call
    assert sess.run(ping, timeout=LIMIT) == ["ping-pong", "ping"]
    assert sess.run(recv_after, 3, 3, False, timeout=LIMIT) == [
        None, ["message 0", "message 1", "message 2"]]


# -- the torch backend (gloo) --------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_torch_backend_raise_fails_the_waiters_and_the_session_goes_on(make_session):
    pytest.importorskip("torch.distributed")
    sess = make_session(3, collectives="torch")
    want = [[6.0, 6.0]] * 3
    assert sess.run(torch_allreduce_rank, timeout=50) == want  # gloo is up
    check_prompt_failure(sess, 1, "raise", "torch-allreduce")
    check_prompt_failure(sess, 0, "return", "torch-allreduce")
    assert sess.run(torch_allreduce_rank, timeout=LIMIT) == want
    check_session_goes_on(sess)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_torch_backend_death_raises_worker_died_within_a_second(make_session, how):
    pytest.importorskip("torch.distributed")
    sess = make_session(3, collectives="torch")
    assert sess.run(torch_allreduce_rank, timeout=50) == [[6.0, 6.0]] * 3
    check_prompt_death(sess, 1, how, "torch-allreduce")
