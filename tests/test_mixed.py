"""One session, shared memory for the workers on the controller's host and TCP for the others
(issue 12). A small launcher starts every worker as the Ray launcher's actors do, with
``connect_command`` under a parent process of its own, and says which ranks are local; so
this runs without Ray (test_ray.py runs it across Ray nodes)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import pytest

import unison
from support import channel_kind, wait_gone, warm_torch_store
from unison import WorkerDied
from unison.launch import DeathReport, Launcher, Network, connect_command
from unison.spec import WorkerSpec

pytestmark = pytest.mark.timeout(120)

warm_torch_store()


class SpawnLauncher(Launcher):
    """Starts each worker with ``connect_command`` (as a Ray actor would); ``local`` ranks
    are said to run on the controller's host."""

    def __init__(self, local: Sequence[int]) -> None:
        self.local = frozenset(local)
        self.procs: list[subprocess.Popen[bytes]] = []

    def network(self) -> Network:
        return Network(bind="127.0.0.1", advertise="127.0.0.1", secret=os.urandom(32))

    def local_ranks(self, num_workers: int, num_groups: int) -> frozenset[int]:
        return self.local

    def start(self, specs: Sequence[WorkerSpec], env: Mapping[int, Mapping[str, str]]) -> None:
        for spec in specs:
            argv, extra = connect_command(spec)
            self.procs.append(subprocess.Popen(argv, env={**os.environ, **extra}))

    def watch_fds(self) -> list[int]:
        return []

    def ended(self) -> int | None:
        return None

    def death(self, rank: int, grace: float) -> DeathReport:
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


def test_a_mixed_session_refuses_shared_arrays_rather_than_copy_them(mixed):
    with pytest.raises(RuntimeError, match="join over TCP"):
        mixed.empty(10)


@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_worker_local_or_not_gives_worker_died_within_2_s(mixed, victim):
    pids = mixed.run(os.getpid)
    ref = mixed.call(time.sleep, 30)
    start = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    with pytest.raises(WorkerDied) as info:
        ref.gather()
    assert time.monotonic() - start < 2.0
    assert info.value.worker == victim
    mixed.close(timeout=1)
    assert wait_gone(pids, 5.0) == []


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
