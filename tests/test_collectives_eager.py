"""send is eager: it returns once the data is copied out, whatever its size, so two ranks
can both send before they receive. Large messages spill into memfds of their own, which the
sender closes once they are taken (or can never be taken): nothing piles up, nothing is left
in /dev/shm."""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import unison

QUICK = 60.0  # a deadlock shows up as TimeoutError instead of stalling the run


def payload(rank: int, nbytes: int) -> np.ndarray:
    return np.frombuffer(hashlib.shake_128(b"rank %d" % rank).digest(nbytes), np.uint8)


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def swap(nbytes: int) -> str:
    """Both ranks send first, then receive: only an eager send lets this finish."""
    r = unison.rank()
    peer = 1 - r
    unison.send(payload(r, nbytes), peer)
    return digest(unison.recv(peer))


def burst(count: int, nbytes: int) -> list[int]:
    """Every rank sends ``count`` messages to every other rank, then receives them all."""
    r, n = unison.rank(), unison.world_size()
    for i in range(count):
        for j in range(n):
            if j != r:
                unison.send(np.full(nbytes, i % 251, np.uint8), j)
    got = []
    for j in range(n):
        if j != r:
            got += [int(unison.recv(j)[0]) for _ in range(count)]
    return got


def unreceived(nbytes: int) -> None:
    """Rank 0 sends a large message that nobody receives in this call."""
    if unison.rank() == 0:
        unison.send(np.zeros(nbytes, np.uint8), 1)


def spill_fds() -> int:
    """How many message spills this worker holds open."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "unison-send" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return count


@pytest.mark.parametrize("nbytes", [8 << 20, 64 << 20], ids=["8MiB", "64MiB"])
def test_both_ranks_send_large_messages_before_receiving(shared, nbytes):
    sess = shared(2)
    got = sess.run(swap, nbytes, timeout=QUICK)
    assert got == [digest(payload(1, nbytes)), digest(payload(0, nbytes))]
    assert sess.run(spill_fds, timeout=QUICK) == [0, 0]  # taken: closed by the sender


@pytest.mark.parametrize("nbytes", [16, 1 << 20], ids=["inline", "spilled"])
def test_many_messages_each_way_before_any_receive(shared, nbytes):
    sess = shared(3)
    got = sess.run(burst, 20, nbytes, timeout=QUICK)
    for r in range(3):
        assert got[r] == list(range(20)) * 2
    assert sess.run(spill_fds, timeout=QUICK) == [0, 0, 0]


def test_a_message_never_received_is_released(shared):
    sess = shared(2)
    for _ in range(3):
        sess.run(unreceived, 4 << 20, timeout=QUICK)
    # the receiver left each call without taking it: the sender closes it by the next call
    assert sess.run(spill_fds, timeout=QUICK) == [0, 0]
    assert sess.run(swap, 1 << 20, timeout=QUICK) == [digest(payload(1, 1 << 20)),
                                                      digest(payload(0, 1 << 20))]


def stale_then_exchange(count: int) -> Any:
    """More messages than the ring holds, none received in their call, then a fresh
    exchange: stale places are reused instead of blocking the sender."""
    if unison.rank() == 0:
        for i in range(count):
            unison.send(i, 1)
    return None


def test_stale_messages_do_not_block_later_sends(shared):
    from unison.collective.shm import RING

    sess = shared(2)
    sess.run(stale_then_exchange, RING, timeout=QUICK)
    sess.run(stale_then_exchange, RING, timeout=QUICK)
    got = sess.run(burst, RING, 8, timeout=QUICK)  # as many as the ring holds
    assert got == [list(range(RING)), list(range(RING))]


# -- a cycle of waits is an error, never a hang ---------------------------------------------------


def send_past_the_ring(extra: int) -> list[int]:
    """Both ranks send RING + ``extra`` messages before receiving any: with extra > 0 each
    send past the ring waits for a take that never comes."""
    from unison.collective.shm import RING

    peer = 1 - unison.rank()
    for i in range(RING + extra):
        unison.send(i, peer)
    return [unison.recv(peer) for _ in range(RING + extra)]


def receive_from_next() -> int:
    """Each rank receives from the next one first: nobody ever sends."""
    r, n = unison.rank(), unison.world_size()
    got = unison.recv((r + 1) % n)
    unison.send(r, (r - 1) % n)
    return int(got)


def late_partner(delay: float, count: int) -> list[int]:
    """Rank 0 sends ``count`` messages to rank 1 and waits for one back; rank 1 sleeps
    first, then takes them all and answers: long waits, but no cycle."""
    import time

    if unison.rank() == 0:
        for i in range(count):
            unison.send(i, 1)
        return [unison.recv(1)]
    time.sleep(delay)
    got = [unison.recv(0) for _ in range(count)]
    unison.send(len(got), 0)
    return got


def errors_of(info: pytest.ExceptionInfo[unison.WorkerError]) -> str:
    """Every worker's error; the first (the exception's own message) must say deadlock too:
    the worker that found it says what it is, the others that it found one. The message
    also names the cycle: where the lowest rank only heard of it, from where it began."""
    assert "deadlock" in str(info.value).splitlines()[0], str(info.value)
    assert "a deadlock: worker" in str(info.value), str(info.value)
    return "\n".join(str(e) for e in info.value.errors.values())


def test_two_ranks_sending_past_the_ring_to_each_other_raise_a_deadlock(shared):
    import time

    from unison.collective.shm import RING

    sess = shared(2)
    assert sess.run(send_past_the_ring, 0, timeout=QUICK) == [list(range(RING))] * 2
    started = time.monotonic()
    with pytest.raises(unison.WorkerError) as info:
        sess.run(send_past_the_ring, 1, timeout=QUICK)
    took = time.monotonic() - started
    text = errors_of(info)
    assert "a deadlock: worker" in text, text
    assert f"waits to send to worker 1 ({RING} messages to it are untaken)" in text, text
    assert took < 5.0, f"the deadlock took {took:.1f} s to be raised"
    assert sess.run(burst, 3, 8, timeout=QUICK) == [[0, 1, 2]] * 2  # the session goes on


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_that_each_receive_first_raise_a_deadlock(shared, n):
    sess = shared(n)
    with pytest.raises(unison.WorkerError) as info:
        sess.run(receive_from_next, timeout=QUICK)
    text = errors_of(info)
    cycle = "; ".join(f"worker {r} waits to receive from worker {(r + 1) % n}"
                      for r in range(n))
    assert cycle in text or any(  # said from whichever worker saw it: a rotation
        "; ".join(f"worker {(s + k) % n} waits to receive from worker {(s + k + 1) % n}"
                  for k in range(n)) in text for s in range(n)), text
    assert sess.run(burst, 2, 8, timeout=QUICK) == [[0, 1] * (n - 1)] * n


def collective_against_recv(kind: str) -> Any:
    """Rank 0 (and any rank past 1) calls a collective; rank 1 receives from rank 0, which
    sends nothing more: each waits on the other."""
    import numpy as np

    from unison.collective.shm import RING

    r = unison.rank()
    if kind == "ring":  # rank 0's send waits on rank 1's takes; rank 1 waits in a barrier
        if r == 0:
            for i in range(RING + 1):
                unison.send(i, 1)
        return unison.barrier()
    if r == 1:
        if kind == "send-then-barrier":
            unison.recv(0)
        return unison.recv(0)
    if kind in ("barrier", "send-then-barrier"):
        if kind == "send-then-barrier" and r == 0:
            unison.send("m", 1)
        return unison.barrier()
    if kind == "group":
        return unison.barrier(group=True)
    if kind == "allreduce":  # the C steps' small path, where they built
        return unison.allreduce(np.ones(3))
    return unison.gather("x", dst=1)


@pytest.mark.parametrize(("kind", "n", "groups", "called"), [
    ("barrier", 2, 1, "barrier()"),
    ("allreduce", 2, 1, "allreduce(op='sum')"),
    ("gather", 2, 1, "gather(dst=1)"),
    ("send-then-barrier", 2, 1, "barrier()"),
    ("barrier", 3, 1, "barrier()"),
    ("group", 4, 2, "barrier()"),
    ("ring", 2, 1, "barrier()"),
])
def test_a_collective_against_a_recv_raises_a_deadlock(shared, kind, n, groups, called):
    """A rank waiting at a collective's meeting published nothing, so the cycle through it
    (its peer in a recv from it, or in a send to it past a full ring) was never seen: both
    hung for good. Now the meeting counts in the graph of waits, and each rank's error says
    what each called."""
    import time

    sess = shared(n, num_groups=groups)
    started = time.monotonic()
    with pytest.raises(unison.WorkerError) as info:
        sess.run(collective_against_recv, kind, timeout=QUICK)
    took = time.monotonic() - started
    text = errors_of(info)
    errors = info.value.errors
    assert all(isinstance(e, unison.CollectiveError) for e in errors.values()), errors
    stuck = [0, 1] if kind != "barrier" or n == 2 else [0, 1, 2]
    assert sorted(errors) == stuck, errors
    peer = "send to worker 1" if kind == "ring" else r"rec(v|eive) from worker 0"
    for r in (0, 1):  # each says both: its own call and its peer's
        said = str(errors[r])
        assert called in said and re.search(peer, said), (r, said)
    assert f"waits in {called}" in text, text
    assert took < 5.0, f"the deadlock took {took:.1f} s to be raised"
    assert sess.run(burst, 2, 8, timeout=QUICK) == [[0, 1] * (n - 1)] * n  # the session goes on


def wait_at_a_barrier_for_a_late_send() -> Any:
    """Rank 0 waits in a barrier while rank 1 waits to receive from rank 2, which sleeps,
    then sends and joins: long waits, but no cycle."""
    import time

    r = unison.rank()
    if r == 1:
        got = unison.recv(2)
    elif r == 2:
        time.sleep(0.5)
        unison.send("late", 1)
        got = None
    else:
        got = None
    unison.barrier()
    return got


def test_a_collective_waiting_on_a_peer_in_a_recv_without_a_cycle_is_not_a_deadlock(shared):
    sess = shared(3)
    assert sess.run(wait_at_a_barrier_for_a_late_send, timeout=QUICK) == [None, "late", None]


def test_long_waits_without_a_cycle_are_not_a_deadlock(shared):
    from unison.collective.shm import RING

    sess = shared(2)
    count = RING + 8  # rank 0's sends wait for rank 1, which sleeps, then takes them all
    got = sess.run(late_partner, 0.4, count, timeout=QUICK)
    assert got == [[count], list(range(count))]


# -- random schedules: a deadlock is raised exactly where there is one ---------------------------


def run_schedule(schedules: list[list[tuple[str, int, int]]]) -> list[Any]:
    """This worker's part: ("send", dst, count) sends ``count`` messages (rank, index) to
    ``dst``; ("recv", src, count) receives ``count`` from ``src``. What it received."""
    me, got, sent = unison.rank(), [], 0
    for what, peer, count in schedules[me]:
        for _ in range(count):
            if what == "send":
                unison.send((me, sent), peer)
                sent += 1
            else:
                got.append(tuple(unison.recv(peer)))
    return got


def simulate(schedules: list[list[tuple[str, int, int]]], ring: int) -> tuple[str, list[Any]]:
    """What the schedules do under the send rule (a send waits while ``ring`` of its
    messages to that peer are untaken; one to a worker that left is dropped) and the recv
    rule (from a worker that left, with nothing queued: an error): "ok" with what each
    received, "error" (a recv from a worker that left), or "deadlock" (workers that wait on
    each other in a cycle; they give up, and the rest goes on)."""
    n = len(schedules)
    steps = [[(w, p) for w, p, c in s for _ in range(c)] for s in schedules]
    pc, sent = [0] * n, [0] * n
    queue: dict[tuple[int, int], list[Any]] = {(s, d): [] for s in range(n) for d in range(n)}
    left, failed, got = [False] * n, [False] * n, [[] for _ in range(n)]
    deadlock = False
    while not all(left):
        moved = False
        for r in range(n):
            while not left[r]:
                if pc[r] == len(steps[r]):
                    left[r] = moved = True
                    break
                what, peer = steps[r][pc[r]]
                if what == "send":
                    if not left[peer]:
                        if len(queue[r, peer]) >= ring:
                            break  # waits
                        queue[r, peer].append((r, sent[r]))
                    sent[r] += 1
                elif queue[peer, r]:
                    got[r].append(queue[peer, r].pop(0))
                elif left[peer]:
                    left[r] = failed[r] = moved = True
                    break
                else:
                    break  # waits
                pc[r] += 1
                moved = True
        if not moved:  # every worker still in the call waits on another: a deadlock
            deadlock = True
            for r in range(n):  # its cycles' members give up (which of them is a race)
                if not left[r]:
                    left[r] = failed[r] = True
    if deadlock:
        return "deadlock", []
    return ("error" if any(failed) else "ok"), got


@st.composite
def schedules(draw: st.DrawFn) -> list[list[tuple[str, int, int]]]:
    from unison.collective.shm import RING

    n = draw(st.sampled_from([2, 3]))
    out = []
    for r in range(n):
        peers = [p for p in range(n) if p != r]
        out.append(draw(st.lists(st.tuples(st.sampled_from(["send", "recv"]),
                                           st.sampled_from(peers),
                                           st.sampled_from([1, 2, RING + 1])),
                                 max_size=4)))
    return out


@settings(max_examples=int(os.environ.get("UNISON_SCHEDULES", "30")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schedules())
def test_random_schedules_raise_a_deadlock_exactly_where_there_is_one(shared, plan):
    """30 schedules a run; UNISON_SCHEDULES=400 for a longer search."""
    from unison.collective.shm import RING

    expect, want = simulate(plan, RING)
    sess = shared(len(plan))
    try:
        got = sess.run(run_schedule, plan, timeout=QUICK)
    except unison.WorkerError as exc:
        said = [str(e) for e in exc.errors.values()]
        assert expect != "ok", (plan, said)
        assert any("a deadlock: worker" in s for s in said) == (expect == "deadlock"), \
            (plan, expect, said)
        return
    assert expect == "ok", (plan, expect, got)
    assert got == want
