"""One session, shared memory for the workers on the controller's host and TCP for the others
(issue 12). A small launcher starts every worker as the Ray launcher's actors do, with
``connect_command`` under a parent process of its own, and says which ranks are local (and,
for the collectives, on which "host" the others run: all are on this machine, so a group
said to share another host really does share its memory); so this runs without Ray
(test_ray.py runs it across Ray nodes)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

import unison
from support import (
    HIGH_FD,
    Box,
    barrier_after,
    channel_kind,
    check_sync_reads_progress,
    collective_backend,
    fds_past_1023_possible,
    hold_fds_below,
    hold_fds_on_worker,
    nap_then_rank,
    release_fds_on_worker,
    wait_gone,
    warm_torch_store,
)
from unison import WorkerDied
from unison.launch import DeathReport, Launcher, Network, connect_command
from unison.spec import WorkerSpec

pytestmark = pytest.mark.timeout(120)

warm_torch_store()


class SpawnLauncher(Launcher):
    """Starts each worker with ``connect_command`` (as a Ray actor would); ``local`` ranks
    are said to run on the controller's host, and the others on the hosts ``nodes`` names
    (unknown where it names none). ``death`` takes ``death_s``, as a launcher that asks a
    remote agent may."""

    def __init__(self, local: Sequence[int], nodes: Mapping[int, str] | None = None,
                 death_s: float = 0.0) -> None:
        self.local = frozenset(local)
        self.hosts = dict(nodes or {})
        self.death_s = death_s
        self.procs: list[subprocess.Popen[bytes]] = []

    def network(self) -> Network:
        return Network(bind="127.0.0.1", advertise="127.0.0.1", secret=os.urandom(32))

    def local_ranks(self, num_workers: int, num_groups: int) -> frozenset[int]:
        return self.local

    def nodes(self, num_workers: int, num_groups: int) -> Mapping[int, str]:
        return self.hosts

    def start(self, specs: Sequence[WorkerSpec], env: Mapping[int, Mapping[str, str]]) -> None:
        for spec in specs:
            argv, extra = connect_command(spec)
            self.procs.append(subprocess.Popen(argv, env={**os.environ, **extra}))

    def watch_fds(self) -> list[int]:
        return []

    def ended(self) -> int | None:
        return None

    def death(self, rank: int, grace: float) -> DeathReport:
        time.sleep(self.death_s)
        return DeathReport(rank, None, "", "")

    def stop(self, grace: float) -> None:
        for p in self.procs:
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                p.kill()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


@pytest.fixture
def mixed() -> Iterator[unison.Session]:
    launcher = SpawnLauncher(local=[0, 2])
    sess = unison.Session(3, launcher=launcher, start_timeout=60)
    yield sess
    sess.close(timeout=3)
    launcher.stop(0)


def test_local_workers_use_shared_memory_and_the_others_tcp(mixed):
    assert mixed.run(channel_kind) == ["ShmWorkerChannel", "TcpWorkerChannel",
                                       "ShmWorkerChannel"]
    assert mixed.run(unison.rank) == [0, 1, 2]
    data = np.random.default_rng(1).random(1_000_000)
    ref = mixed.put(data)  # 8 MB: out of band, through the arena or the socket
    assert mixed.run(lambda x: float(x.sum()), ref) == [float(data.sum())] * 3
    big = mixed.call(lambda: np.full(2_000_000, float(unison.rank()))).gather()
    assert [float(b[-1]) for b in big] == [0.0, 1.0, 2.0]
    part = mixed.scatter([1, 2, 3])
    assert mixed[1:].call(lambda x: x * 10, mixed[1:].scatter([5, 6])).gather() == [50, 60]
    assert mixed.call(lambda x: x + 1, part).gather() == [2, 3, 4]
    with pytest.raises(unison.WorkerError, match="ZeroDivisionError"):
        mixed.run(lambda: 1 / 0)
    mixed.call(lambda: 1 / 0)
    with pytest.raises(unison.WorkerError):
        mixed.sync()
    mixed.sync()


def test_a_value_over_the_tcp_frame_limit_is_refused_before_the_local_half_goes(
        mixed, monkeypatch):
    """The TCP half refused it, after the shared-memory half had gone: the message half
    sent, and the session closed, for a value that nothing should have sent."""
    from unison.channel import tcp

    monkeypatch.setattr(tcp, "MAX_FRAME", 1000)
    with pytest.raises(ValueError, match="over the TCP channel's limit"):
        mixed.run(len, b"x" * 2000)
    assert mixed.run(len, b"abc") == [3, 3, 3]


def test_a_mixed_session_refuses_shared_arrays_rather_than_copy_them(mixed):
    with pytest.raises(RuntimeError, match="join over TCP"):
        mixed.empty(10)


def _fill_sevens(a: np.ndarray) -> None:
    a[...] = 7.0


def test_another_sessions_shared_array_is_refused_for_the_tcp_workers_too(mixed):
    """Shared memory refused another session's ``sess.empty`` array, but a message only for
    the workers over TCP sent it as a copy, their writes lost in silence. Now it raises
    ValueError for either half, with nothing sent, and the session goes on."""
    with unison.Session(1) as local:
        a = local.empty(1000)
        a[:] = 0
        for view in (mixed, mixed[1], mixed[1:]):
            with pytest.raises(ValueError, match="shared memory of another session"):
                view.run(_fill_sevens, a)
            with pytest.raises(ValueError, match="shared memory of another session"):
                view.put(a)
        assert not a.any()
    assert mixed.run(len, b"abc") == [3, 3, 3]


@pytest.mark.parametrize("waiting", ["gather", "await", "sync", "sync_async"])
@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_worker_local_or_not_gives_worker_died_within_2_s(mixed, victim, waiting):
    """Whether the controller waits for a reply, or for everything sent to have run (the
    local workers' done positions, the others' reports), blocking or from an event loop
    (which watches the local workers' pidfds too: a local death woke nothing there before
    the thirty-fourth pass of issue 9, and the await hung)."""
    pids = mixed.run(os.getpid)
    ref = mixed.call(time.sleep, 30)
    start = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    with pytest.raises(WorkerDied) as info:
        if waiting == "gather":
            ref.gather()
        elif waiting == "await":
            asyncio.run(_awaited(ref))
        elif waiting == "sync":
            mixed.sync()
        else:
            asyncio.run(mixed.sync_async())
    assert time.monotonic() - start < 2.0
    assert info.value.worker == victim
    mixed.close(timeout=1)
    assert wait_gone(pids, 5.0) == []


async def _awaited(ref: unison.Ref) -> Any:
    return await ref


def _boom_on(rank: int) -> None:
    if unison.rank() == rank:
        raise ValueError(f"boom on {rank}")


@pytest.mark.parametrize("awaited", [False, True], ids=["sync", "sync_async"])
def test_sync_after_a_quick_call_asks_neither_half(mixed, awaited):
    """The local workers' done positions and the others' reports say all ran: sync (or
    ``await sync_async``) sends no SYNC to either half, and an error held on either still
    reaches it, once."""
    check_sync_reads_progress(mixed, lambda: [mixed._chan.tcp._sent[1]], awaited)

    def sync() -> None:
        if awaited:
            asyncio.run(mixed.sync_async())
        else:
            mixed.sync()

    for rank in (0, 1):  # local, then over TCP
        mixed.call(_boom_on, rank)
        with pytest.raises(unison.WorkerError, match=f"boom on {rank}"):
            sync()
        mixed.call(int)
        sync()  # reported once


def test_collectives_in_a_mixed_session_go_through_torch():
    torch = pytest.importorskip("torch")
    launcher = SpawnLauncher(local=[1])
    sess = unison.Session(2, launcher=launcher, collectives="torch", start_timeout=60)
    try:
        out = sess.run(lambda: unison.allreduce(torch.ones(3) * (unison.rank() + 1)).tolist())
        assert out == [[3.0, 3.0, 3.0]] * 2
    finally:
        sess.close(timeout=3)
        launcher.stop(0)


def _returns_or_reduces(who: int) -> object:
    import torch

    if unison.rank() == who:
        return "returned"
    return float(unison.allreduce(torch.ones(1))[0])


def test_a_rank_on_either_channel_that_ran_no_collective_fails_its_peer_at_once():
    """A rank that returns from a call in which it ran no collective marks the call in the
    store once it waits for its next command: on TCP at the controller's heartbeat; on
    shared memory (a mixed session's workers beside the controller, as a Ray cluster's
    driver node gives) its sleep gave no such moment, and its TCP peer waited until the
    call's timeout (a review, issue 9, forty-eighth pass). Its sleep now wakes for it."""
    pytest.importorskip("torch")
    launcher = SpawnLauncher(local=[1])
    sess = unison.Session(2, launcher=launcher, collectives="torch", start_timeout=60)
    try:
        assert sess.run(unison.rank) == [0, 1]
        for who in (0, 1, 1, 0):  # on TCP, on shared memory
            start = time.monotonic()
            with pytest.raises(unison.WorkerError) as info:
                sess.run(_returns_or_reduces, who, timeout=20)
            assert time.monotonic() - start < 5
            assert set(info.value.errors) == {1 - who}
            assert "left the call without joining it" in str(info.value.errors[1 - who])
        assert sess.run(_returns_or_reduces, -1, timeout=20) == [2.0, 2.0]
    finally:
        sess.close(timeout=3)
        launcher.stop(0)


def group_collectives() -> tuple[list[int], list[float], dict[str, int], int]:
    r, g = unison.rank(), unison.group()
    boxes = unison.allgather(Box(r), group=True)
    total = unison.allreduce(np.full(3, float(r)), group=True)
    root = unison.broadcast({"from": r} if unison.group_rank() == 1 else None, src=1,
                            group=True)
    big = unison.allreduce(np.full(200_000, 1.0), group=True)  # past SMALL: shared reduce
    assert [b.rank for b in boxes] == [2 * g, 2 * g + 1]
    return [b.lam() for b in boxes], total.tolist(), root, int(big.sum())


@pytest.fixture
def two_hosts() -> Iterator[Callable[..., unison.Session]]:
    """``two_hosts(**session_kw)``: 4 workers in 2 groups, group 0 on the controller's host
    (its segment comes with the channel's fds) and group 1 on host "b" (rank 2 makes its
    segment and hands it to rank 3)."""
    made: list[tuple[unison.Session, SpawnLauncher]] = []

    def make(death_s: float = 0.0, **kw: Any) -> unison.Session:
        launcher = SpawnLauncher(local=[0, 1], nodes={2: "b", 3: "b"}, death_s=death_s)
        sess = unison.Session(4, 2, launcher=launcher, **{"start_timeout": 60, **kw})
        made.append((sess, launcher))
        return sess

    yield make
    for sess, launcher in made:
        sess.close(timeout=3)
        launcher.stop(0)


def test_groups_each_on_one_host_run_group_collectives_on_shared_memory(two_hosts):
    sess = two_hosts()
    assert sess.run(channel_kind) == ["ShmWorkerChannel"] * 2 + ["TcpWorkerChannel"] * 2
    assert sess.run(collective_backend, True) == ["ShmCollectives"] * 4
    assert sess.run(collective_backend, False) == ["none"] * 4  # the world spans hosts, no torch
    out = sess.run(group_collectives)
    assert [o[0] for o in out] == [[0, 10]] * 2 + [[20, 30]] * 2
    assert [o[1] for o in out] == [[1.0] * 3] * 2 + [[5.0] * 3] * 2
    assert [o[2] for o in out] == [{"from": 1}] * 2 + [{"from": 3}] * 2
    assert [o[3] for o in out] == [400_000] * 4
    with pytest.raises(unison.WorkerError, match="collectives='torch'"):
        sess.run(lambda: unison.allreduce(np.ones(2)))
    # the mismatch check and a peer that left still work in both kinds of segment
    with pytest.raises(unison.WorkerError, match="mismatched collectives"):
        sess.run(lambda: unison.allreduce(1, group=True) if unison.group_rank()
                 else unison.allgather(1, group=True))
    with pytest.raises(unison.WorkerError, match="left the call"):
        sess.run(lambda: None if unison.group_rank() else unison.barrier(group=True))
    assert sess.run(lambda: unison.allreduce(unison.rank(), group=True)) == [1, 1, 5, 5]


NEEDS_FDS = pytest.mark.skipif(not fds_past_1023_possible(),
                               reason=f"RLIMIT_NOFILE's hard limit is under {HIGH_FD + 1024}")


@NEEDS_FDS
def test_a_controller_with_fds_past_1023_starts_runs_and_closes_a_mixed_session(two_hosts):
    """select refuses fds >= 1024: before, the waits of both halves (the TCP half's accept
    loop, recv and pending; shared memory's sleeps) raised ``ValueError: filedescriptor out
    of range in select()``. They are in poll now (tests/test_many_fds.py: the other
    channels)."""
    undo = hold_fds_below(HIGH_FD)
    try:
        sess = two_hosts(start_timeout=15)
        assert sess.run(nap_then_rank, 0.2) == [0, 1, 2, 3]
        assert asyncio.run(sess.run_async(nap_then_rank, 0.1)) == [0, 1, 2, 3]
        sess.call(nap_then_rank, 0.1)
        sess.sync()
        assert sess.run(barrier_after, 0.2, True) == [0, 1, 2, 3]
        sess.close(timeout=3)
    finally:
        undo()


@NEEDS_FDS
def test_workers_with_fds_past_1023_meet_in_group_collectives_on_another_host(two_hosts):
    """Group 1's collectives (host "b") watch the peers' pidfds, opened in the first wait:
    after user code opened more than 1024 files, such a pidfd was past select's limit, and
    the wait raised ValueError."""
    sess = two_hosts()
    assert min(sess.run(hold_fds_on_worker, HIGH_FD)) >= HIGH_FD
    assert sess.run(barrier_after, 0.2, True) == [0, 1, 2, 3]
    assert sess.run(nap_then_rank, 0.1) == [0, 1, 2, 3]
    assert sess.run(release_fds_on_worker) == [1] * 4
    assert sess.run(barrier_after, 0.1, True) == [0, 1, 2, 3]


def test_with_torch_the_world_goes_through_torch_and_the_groups_stay_on_shared_memory(
        two_hosts):
    torch = pytest.importorskip("torch")
    sess = two_hosts(collectives="torch")
    assert sess.run(collective_backend, True) == ["ShmCollectives"] * 4
    assert sess.run(collective_backend, False) == ["ClusterCollectives"] * 4

    def both() -> tuple[Any, ...]:
        r = unison.rank()
        world = unison.allreduce(torch.ones(3) * (r + 1))
        everyone = unison.allgather(torch.tensor([r]))
        root = unison.broadcast(torch.arange(2) * (r + 1), src=3)
        if r == 0:
            unison.send({"to": 3}, 3)  # across hosts: torch's object send
        got = unison.recv(0) if r == 3 else None
        grouped = unison.allgather(Box(r), group=True)
        return world.tolist(), [int(t) for t in everyone], root.tolist(), got, \
            [b.rank for b in grouped]

    out = sess.run(both)
    assert [o[0] for o in out] == [[10.0] * 3] * 4
    assert [o[1] for o in out] == [[0, 1, 2, 3]] * 4
    assert [o[2] for o in out] == [[0, 4]] * 4
    assert out[3][3] == {"to": 3}
    assert [o[4] for o in out] == [[0, 1]] * 2 + [[2, 3]] * 2
    with pytest.raises(unison.WorkerError, match=r"different collectives|shapes"):
        sess.run(lambda: unison.allreduce(torch.ones(unison.rank() + 1)))
    # a CUDA tensor takes torch even in a group on shared memory: where the other ranks
    # pass None, they run the shared-memory broadcast or scatter, meet the source at the
    # same barrier, and every rank raises rather than waits
    for kind in ("broadcast", "scatter"):
        with pytest.raises(unison.WorkerError, match="another shape, dtype or device"):
            sess.run(cuda_from_the_first_of_each_group, kind)
    assert sess.run(lambda: unison.allreduce(torch.ones(2)).tolist()) == [[4.0, 4.0]] * 4


def cuda_from_the_first_of_each_group(kind: str) -> None:
    """Run on a worker: a group broadcast or scatter whose source passes (what claims to
    be) CUDA tensors and whose other ranks pass None. No GPU needed: the ranks part at the
    barrier, before any NCCL op."""
    import torch

    class Cuda(torch.Tensor):
        @property
        def is_cuda(self) -> bool:  # type: ignore[override]
            return True

    mine = unison.group_rank() == 0
    if kind == "broadcast":
        unison.broadcast(torch.ones(2).as_subclass(Cuda) if mine else None, group=True)
    else:
        unison.scatter([torch.ones(2).as_subclass(Cuda)] * 2 if mine else None, group=True)


def test_a_session_all_on_this_host_runs_every_collective_on_shared_memory():
    launcher = SpawnLauncher(local=[0, 1])
    sess = unison.Session(2, launcher=launcher, start_timeout=60)
    try:
        assert sess.run(collective_backend, False) == ["ShmCollectives"] * 2

        def world() -> tuple[list[int], Any]:
            boxes = unison.allgather(Box(unison.rank()))
            if unison.rank() == 0:
                unison.send(Box(7), 1)
            got = unison.recv(0).rank if unison.rank() == 1 else None
            return [b.rank for b in boxes], got

        assert sess.run(world) == [([0, 1], None), ([0, 1], 7)]
    finally:
        sess.close(timeout=3)
        launcher.stop(0)


@pytest.mark.parametrize("victim", [1, 3], ids=["this-host", "other-host"])
def test_a_worker_killed_in_a_group_collective_fails_its_peer_then_worker_died(
        two_hosts, tmp_path, victim):
    # death_s: the launcher takes a second to describe the death, so that the session does
    # not stop the peer before it can tell it gave up by itself (within 2 s)
    sess = two_hosts(death_s=1.0)
    pids = sess.run(os.getpid)
    peer = victim - 1
    mark = tmp_path / "gave-up"

    def wait_in_group(victim: int, mark: str) -> None:
        if unison.rank() == victim:
            time.sleep(60)
        try:
            unison.allreduce(np.ones(4), group=True)
        except unison.CollectiveError as exc:
            with open(mark, "w") as f:
                f.write(f"{time.time()} {exc}")
            raise

    ref = sess.call(wait_in_group, victim, str(mark))
    time.sleep(0.5)  # the peer waits in the collective
    killed = time.time()
    os.kill(pids[victim], signal.SIGKILL)
    with pytest.raises(WorkerDied) as info:
        ref.gather(timeout=30)
    assert info.value.worker == victim
    assert time.time() - killed < 3.0
    deadline = time.monotonic() + 3.0
    while not mark.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    when, text = mark.read_text().split(" ", 1)
    assert f"worker {victim} died" in text
    assert float(when) - killed < 2.0, f"worker {peer} gave up after {float(when) - killed} s"
    sess.close(timeout=1)
    assert wait_gone(pids, 5.0) == []
