"""Session(launcher=RayLauncher(...)) on a real multi-node Ray cluster on this machine.

One ``ray.cluster_utils.Cluster`` for the whole module (starting one costs ~10 s): a head and
two more nodes, each a raylet of its own, so the workers are Ray actors on different nodes
that join the controller over TCP. Node "n1" has two (logical) GPUs, so Ray's GPU assignment
is checked without any hardware. Tests that remove a node add their own.

The cluster's daemons and Ray's workers are children of the test runner: they are exempt from
the per-test leak check (leaks.EXEMPT_TREES), and the driver's fds and threads, which Ray
opens lazily, are not blamed on a test (leaks.MODULE_FIXTURES). What unison must clean up is
checked here instead: no unison worker process, no live actor, no placement group left.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import psutil
import pytest

ray = pytest.importorskip("ray")

import leaks  # noqa: E402
import unison  # noqa: E402
from support import MARKER, Box, channel_kind, collective_backend, wait_gone  # noqa: E402
from unison.launch.ray import RayLauncher  # noqa: E402

pytestmark = pytest.mark.timeout(120)

leaks.MODULE_FIXTURES.add("ray_cluster")


class RayCluster:
    """The module's cluster: its nodes by name ("head", "n1", "n2", and those tests add)."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        before = _children()
        self.cluster = Cluster(
            initialize_head=True,
            connect=True,
            head_node_args={"num_cpus": 2, "resources": {"head": 8}, "include_dashboard": False},
        )
        try:
            self.nodes = {"head": self.cluster.head_node}
            self.nodes["n1"] = self.cluster.add_node(num_cpus=4, num_gpus=2,
                                                     resources={"n1": 8})
            self.nodes["n2"] = self.cluster.add_node(num_cpus=4, resources={"n2": 8})
            self.cluster.wait_for_nodes()
        except BaseException:
            self.shutdown()
            raise
        finally:
            self.exempt(before)
        self.address: str = self.cluster.address

    @staticmethod
    def exempt(before: set[int]) -> None:
        """What Ray started since ``before`` (and what it starts below it) is not the tests'
        leak."""
        leaks.EXEMPT_TREES.update(_children() - before)

    def node_id(self, name: str) -> str:
        return str(self.nodes[name].node_id)

    def add_node(self, name: str, **kw: Any) -> Any:
        before = _children()
        try:
            node = self.cluster.add_node(**kw)
            self.nodes[name] = node
            self.cluster.wait_for_nodes()
        finally:
            self.exempt(before)
        return node

    def remove_node(self, name: str) -> None:
        node = self.nodes.pop(name, None)
        if node is not None:
            self.cluster.remove_node(node, allow_graceful=False)

    def shutdown(self) -> None:
        try:
            ray.shutdown()
        finally:
            self.cluster.shutdown()
            leaks.EXEMPT_TREES.clear()


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children()}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    if ray.is_initialized():
        pytest.skip("Ray is initialised in this process already (another cluster)")
    cluster = RayCluster()
    try:
        yield cluster
    finally:
        cluster.shutdown()  # "ray_cluster" stays in MODULE_FIXTURES: Ray's driver keeps
        # a few fds (its logs, eventfds) after ray.shutdown(), and this runs inside the last
        # test's teardown, before its leak check


def connect_workers() -> list[psutil.Process]:
    """This run's ``unison worker --connect`` processes (keepers and workers) still running."""
    token = os.environ.get(MARKER)
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or ())
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if "unison" not in cmd or "--connect" not in cmd:
                continue
            if token is not None and proc.environ().get(MARKER) != token:
                continue
            found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def live_actors(job: str | None = None) -> list[str]:
    """Actors that are not DEAD (of one job, hex id, where given)."""
    out = []
    for actor_id, info in ray._private.state.actors().items():
        if info.get("State") in ("DEAD", 4):
            continue
        if job is not None and str(info.get("JobID", "")) != job:
            continue
        out.append(actor_id)
    return out


def live_groups() -> list[str]:
    return [pg for pg, info in ray.util.placement_group_table().items()
            if info.get("state") != "REMOVED"]


def wait_for(check: Callable[[], Any], timeout: float) -> Any:
    """Poll ``check`` until it returns something falsy; return its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if not value or time.monotonic() >= deadline:
            return value
        time.sleep(0.1)


@pytest.fixture
def ray_session(ray_cluster: RayCluster) -> Iterator[Callable[..., unison.Session]]:
    """``ray_session(n, launcher=RayLauncher(...), **kw)``: closed when the test ends, and then
    nothing of it may be left: no worker process, actor or placement group."""
    sessions: list[unison.Session] = []
    actors_before = set(live_actors())

    def make(n: int, *args: Any, **kw: Any) -> unison.Session:
        kw.setdefault("launcher", RayLauncher(placement_timeout=30))
        sess = unison.Session(n, *args, **kw)
        sessions.append(sess)
        return sess

    yield make
    for sess in sessions:
        with contextlib.suppress(Exception):
            sess.close(timeout=0)
    left = wait_for(connect_workers, 5.0)
    for proc in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    actors = wait_for(lambda: set(live_actors()) - actors_before, 5.0)
    groups = wait_for(live_groups, 5.0)
    assert not left, f"unison workers outlived their session: {left}"
    assert not actors, f"Ray actors outlived their session: {actors}"
    assert not groups, f"placement groups outlived their session: {groups}"


def node_of(sess: unison.Session, rank: int) -> str:
    launcher = sess._res.launcher
    assert isinstance(launcher, RayLauncher)
    return launcher.where[rank][1]


def test_create_by_name() -> None:
    assert isinstance(unison.launch.create("ray"), RayLauncher)


def test_calls_refs_put_gather_across_nodes(
    ray_cluster: RayCluster, ray_session: Callable[..., unison.Session]
) -> None:
    # 3 workers of 2 CPUs: no node holds them all, so PACK spreads them over two nodes
    sess = ray_session(3, launcher=RayLauncher(num_cpus=2, placement_timeout=30))
    nodes = {node_of(sess, r) for r in range(3)}
    assert len(nodes) >= 2, nodes
    assert sess.run(unison.rank) == [0, 1, 2]
    assert sess.run(unison.world_size) == [3, 3, 3]
    big = sess.put(np.arange(100_000, dtype=np.float64))
    ref = sess.call(lambda a, k: float(a.sum()) * k + unison.rank(), big, 2)
    expected = float(np.arange(100_000).sum()) * 2
    assert ref.gather() == [expected, expected + 1, expected + 2]
    assert ref.get(worker=1) == expected + 1
    parts = sess.scatter([np.full(4, r) for r in range(3)])
    sums = sess.call(lambda x: x * 10, parts).gather()
    assert [int(s[0]) for s in sums] == [0, 10, 20]
    assert sess[1].run(lambda: unison.rank()) == [1]
    with pytest.raises(unison.WorkerError) as err:
        sess.run(lambda: 1 / 0)
    assert isinstance(err.value.__cause__, ZeroDivisionError)
    # the session stays usable after a worker raised
    assert sess.run(lambda: "ok") == ["ok"] * 3
    # a worker is a child of its actor, which Ray placed: each sees the other's pid
    pids = sess.run(os.getpid)
    assert len(set(pids)) == 3


def niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)


def test_workers_run_at_the_drivers_niceness_not_rays(
    ray_cluster: RayCluster, ray_session: Callable[..., unison.Session]
) -> None:
    """Ray runs actors at niceness 15; the workers its actors start run at the driver's
    (as a local session's would), or at the niceness asked for."""
    def in_a_ray_worker() -> int:  # nested: cloudpickle sends it by value
        return os.getpriority(os.PRIO_PROCESS, 0)

    actor_nice = ray.get(ray.remote(in_a_ray_worker).remote())
    assert actor_nice > niceness()  # Ray's worker_niceness, or the premise is gone
    sess = ray_session(2, launcher=RayLauncher(placement_timeout=30))
    assert sess.run(niceness) == [niceness()] * 2
    sess.close()
    sess = ray_session(2, launcher=RayLauncher(placement_timeout=30, nice=7))
    assert sess.run(niceness) == [7, 7]


def test_workers_beside_the_driver_use_shared_memory_the_others_tcp(
    ray_cluster: RayCluster, ray_session: Callable[..., unison.Session]
) -> None:
    # 5 workers of 2 CPUs fill every node: one on the head (the driver's node), 2 + 2 on the
    # others
    sess = ray_session(5, launcher=RayLauncher(num_cpus=2, placement_timeout=30))
    head = ray.get_runtime_context().get_node_id()
    here = [node_of(sess, r) == head for r in range(5)]
    kinds = sess.run(channel_kind)
    assert sum(here) == 1, here
    assert kinds == ["ShmWorkerChannel" if h else "TcpWorkerChannel" for h in here]
    data = np.arange(200_000, dtype=np.float64)
    assert sess.run(lambda a: float(a.sum()), sess.put(data)) == [float(data.sum())] * 5


def test_groups_each_on_one_node(
    ray_cluster: RayCluster, ray_session: Callable[..., unison.Session]
) -> None:
    # 2 groups of 2 workers of 2 CPUs: a group fills n1 or n2 (4 CPUs), the head holds none
    sess = ray_session(4, 2, launcher=RayLauncher(num_cpus=2, placement_timeout=30))
    where = [node_of(sess, r) for r in range(4)]
    assert where[0] == where[1] and where[2] == where[3], where
    assert where[0] != where[2], where
    assert set(where) == {ray_cluster.node_id("n1"), ray_cluster.node_id("n2")}
    assert sess.run(unison.group) == [0, 0, 1, 1]


def test_gpus_assigned_by_ray(
    ray_cluster: RayCluster, ray_session: Callable[..., unison.Session]
) -> None:
    sess = ray_session(2, launcher=RayLauncher(num_gpus=1, placement_timeout=30))
    seen = sess.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
    assert sorted(seen) == ["0", "1"], seen  # n1's two (logical) GPUs, one each
    assert {node_of(sess, r) for r in range(2)} == {ray_cluster.node_id("n1")}


def test_placement_that_cannot_fit_times_out(
    ray_cluster: RayCluster, ray_session: Callable[..., unison.Session]
) -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="could not place"):
        ray_session(2, launcher=RayLauncher(num_cpus=100, placement_timeout=2))
    assert time.monotonic() - start < 20
    assert wait_for(live_groups, 5.0) == []


def test_a_start_timeout_bounds_the_placement(
    ray_cluster: RayCluster, ray_session: Callable[..., unison.Session]
) -> None:
    """The launcher placed the workers before the session's start deadline was set, and
    waited its own placement_timeout: start_timeout=3 raised after 60 s."""
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="starting timed out"):
        ray_session(2, launcher=RayLauncher(num_cpus=100, placement_timeout=60),
                    start_timeout=3)
    assert time.monotonic() - start < 15
    assert wait_for(live_groups, 5.0) == []


def test_a_launcher_whose_session_failed_to_open_places_nothing_more(
    ray_cluster: RayCluster, ray_session: Callable[..., unison.Session]
) -> None:
    """Given again after its session failed to open, it placed a group before refusing to
    start, and that group (its CPUs) stayed for the driver's life."""
    launcher = RayLauncher(num_cpus=100, placement_timeout=1)
    with pytest.raises(TimeoutError, match="could not place"):
        ray_session(2, launcher=launcher)
    launcher.num_cpus = 1
    with pytest.raises(RuntimeError, match="starts its workers once"):
        ray_session(2, launcher=launcher)
    assert wait_for(live_groups, 5.0) == []


@pytest.mark.parametrize("bad", [{"num_cpus": -1}, {"num_gpus": math.nan},
                                 {"num_cpus": math.inf}, {"resources": {"n1": -1}},
                                 {"resources": {"n1": "1"}}])
def test_a_negative_or_infinite_resource_is_refused_before_ray_sees_it(bad: dict[str, Any]
                                                                      ) -> None:
    """Ray took a negative resource into a placement group; removing it then aborted the
    node's raylet (a failed check), and the node was lost with all it ran."""
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        RayLauncher(**bad)


@pytest.mark.parametrize(("bad", "error"), [(math.nan, ValueError), (-1, ValueError),
                                            ("5", TypeError), (None, TypeError)])
def test_a_placement_timeout_that_is_no_number_of_seconds_is_refused_when_made(
        bad: Any, error: type) -> None:
    """placement_timeout was never checked: nan, -1, "5" and None reached ray.wait (or a
    bare comparison against the start deadline), whose errors named no parameter (an
    audit of timeouts, issue 9, forty-eighth pass). inf is for ever, as in every timeout."""
    with pytest.raises(error, match="placement_timeout must be a number of seconds"):
        RayLauncher(placement_timeout=bad)
    assert RayLauncher(placement_timeout=10**400).placement_timeout == math.inf
    assert RayLauncher(placement_timeout=math.inf)._limit(math.inf) == (None, False)


def test_numpy_amounts_are_taken_as_numbers() -> None:
    launcher = RayLauncher(num_cpus=np.int64(2), num_gpus=np.float32(0.5),
                           resources={"n1": np.int32(1)})
    assert (launcher.num_cpus, launcher.num_gpus, launcher.resources) == (2.0, 0.5, {"n1": 1.0})


def test_a_stop_with_the_cluster_gone_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the cluster's GCS gone, removing a placement group waits for good: a close (and
    the WorkerDied of a death, which closes) hung until Ray's driver ended itself. The
    removal is a Ray call; here it never returns, as it did then."""
    import unison.launch.ray as ray_launch

    never = threading.Event()
    monkeypatch.setattr(ray_launch, "remove_placement_group", lambda pg: never.wait())
    monkeypatch.setattr(ray_launch, "_LET_GO_S", 0.5)
    launcher = RayLauncher()
    launcher.groups = [object()]
    start = time.monotonic()
    launcher.stop(grace=0)
    assert time.monotonic() - start < 2.0
    never.set()


def test_a_killed_actor_process_is_not_said_to_be_a_lost_node(
    ray_cluster: RayCluster, ray_session: Callable[..., unison.Session]
) -> None:
    """Ray's text for an actor whose process died speaks of "the OOMing node": read as a
    node's death, the WorkerDied said "its node died or was removed" of a node alive."""
    sess = ray_session(2, launcher=RayLauncher(resources={"n2": 1}, placement_timeout=30))
    launcher = sess._res.launcher
    assert isinstance(launcher, RayLauncher)
    os.kill(psutil.Process(launcher.where[1][2]).ppid(), signal.SIGKILL)
    with pytest.raises(unison.WorkerDied) as err:
        sess.run(noop, timeout=20)
    assert "its node died" not in str(err.value), str(err.value)
    assert err.value.worker == 1


def test_worker_exit_reports_status_and_node(
    ray_cluster: RayCluster, ray_session: Callable[..., unison.Session]
) -> None:
    sess = ray_session(2, launcher=RayLauncher(resources={"n2": 1}, placement_timeout=30))

    def die() -> None:
        if unison.rank() == 1:
            import sys

            print("about to go", file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(30)

    start = time.monotonic()
    with pytest.raises(unison.WorkerDied) as err:
        sess.run(die, timeout=20)
    took = time.monotonic() - start
    assert err.value.worker == 1
    assert err.value.exitcode == 3, str(err.value)
    assert ray_cluster.node_id("n2")[:12] in str(err.value), str(err.value)
    assert took < 5, took
    with pytest.raises(unison.SessionClosed):
        sess.run(noop)


def noop() -> None:
    return None


def test_node_removed_mid_call(
    ray_cluster: RayCluster, ray_session: Callable[..., unison.Session]
) -> None:
    ray_cluster.add_node("victim", num_cpus=2, resources={"victim": 4})
    try:
        sess = ray_session(2, launcher=RayLauncher(resources={"victim": 1},
                                                   placement_timeout=30))
        victim = ray_cluster.node_id("victim")
        assert {node_of(sess, r) for r in range(2)} == {victim}
        launcher = sess._res.launcher
        assert isinstance(launcher, RayLauncher)
        death, spent = launcher.death, []

        def timed_death(rank: int, grace: float) -> Any:
            t0 = time.monotonic()
            try:
                return death(rank, grace)
            finally:
                spent.append((t0, time.monotonic() - t0))

        launcher.death = timed_death  # type: ignore[method-assign]
        ref = sess.call(time.sleep, 60)
        removed_at: list[float] = []

        def remove() -> None:
            time.sleep(1.0)
            removed_at.append(time.monotonic())
            ray_cluster.remove_node("victim")

        remover = threading.Thread(target=remove)
        remover.start()
        try:
            with pytest.raises(unison.WorkerDied) as err:
                ref.gather(timeout=30)
            noticed = time.monotonic()
        finally:
            remover.join()
        took = noticed - removed_at[0]
        timing = (f"WorkerDied {took:.2f} s after the node was removed; "
                  + "; ".join(f"death() began at +{t0 - removed_at[0]:.2f} s and took {d:.2f} s"
                              for t0, d in spent))
        print(f"node removed -> {timing}: {err.value}")
        assert took < 2.0, timing
        assert err.value.worker in (0, 1)
        assert f"worker {err.value.worker}" in str(err.value)
    finally:
        ray_cluster.remove_node("victim")


def test_actor_killed_mid_call(
    ray_cluster: RayCluster, ray_session: Callable[..., unison.Session]
) -> None:
    sess = ray_session(2, launcher=RayLauncher(resources={"n2": 1}, placement_timeout=30))
    launcher = sess._res.launcher
    assert isinstance(launcher, RayLauncher)
    ref = sess.call(time.sleep, 60)
    time.sleep(0.5)
    killed_at = time.monotonic()
    ray.kill(launcher.actors[1])
    with pytest.raises(unison.WorkerDied) as err:
        ref.gather(timeout=30)
    took = time.monotonic() - killed_at
    print(f"actor killed -> WorkerDied in {took:.2f} s: {err.value}")
    assert took < 2.0, f"WorkerDied came {took:.2f} s after the actor was killed"
    assert err.value.worker == 1
    assert "actor" in str(err.value) and ray_cluster.node_id("n2")[:12] in str(err.value)


def test_close_leaves_nothing(
    ray_cluster: RayCluster, ray_session: Callable[..., unison.Session]
) -> None:
    before = set(live_actors())
    sess = ray_session(2)
    launcher = sess._res.launcher
    assert isinstance(launcher, RayLauncher)
    assert len(set(live_actors()) - before) == 2
    assert live_groups()
    workers = connect_workers()
    assert len(workers) >= 2  # each worker and its keeper
    start = time.monotonic()
    sess.close()
    took = time.monotonic() - start
    assert not wait_gone([p.pid for p in workers], 3.0)
    assert not wait_for(lambda: set(live_actors()) - before, 5.0)
    assert not wait_for(live_groups, 5.0)
    assert took < 10, took
    sess.close()  # idempotent
    launcher.stop(0)


CONTROLLER = """
    import os, sys, time
    import psutil, ray
    import unison
    from unison.launch.ray import RayLauncher
    ray.init(address={address!r}, log_to_driver=False)
    sess = unison.Session(2, launcher=RayLauncher(placement_timeout=30))
    pids = sess.run(os.getpid)
    pids += [psutil.Process(p).ppid() for p in pids]  # their keepers
    print("PIDS", ray.get_runtime_context().get_job_id(), *pids, flush=True)
    time.sleep(600)
"""


def test_controller_killed_leaves_nothing(
    ray_cluster: RayCluster, controller: Callable[..., Any]
) -> None:
    proc = controller(CONTROLLER.format(address=ray_cluster.address))
    first = _read_line(proc)
    job, *rest = first.split()[1:]
    pids = [int(p) for p in rest]
    assert len(pids) == 4
    assert len(live_actors(job)) == 2
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed = time.monotonic()
    left = wait_gone(pids, 10.0)
    gone_in = time.monotonic() - killed
    actors = wait_for(lambda: live_actors(job), 15.0)
    groups = wait_for(live_groups, 15.0)
    for p in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    assert not left, f"workers outlived their killed controller: {left}"
    assert not actors, f"actors of the killed controller's job survive: {actors}"
    assert not groups, f"placement groups survive: {groups}"
    print(f"controller killed -> its workers gone in {gone_in:.2f} s")


def _read_line(proc: Any, timeout: float = 60.0) -> str:
    """The line of a controller script that says "PIDS", its job id, then pids (Ray may
    print other lines before it)."""
    import select

    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    line = b""
    while not line.startswith(b"PIDS ") or not line.endswith(b"\n"):
        if line.endswith(b"\n"):
            line = b""
        left = deadline - time.monotonic()
        ready = select.select([fd], [], [], max(left, 0))[0] if left > 0 else []
        chunk = os.read(fd, 1) if ready else b""
        if not chunk:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(
                f"the controller printed no pids (got {line!r}, then {out!r}):\n{err}")
        line += chunk
    return line.decode()


def test_collectives_across_nodes(
    ray_cluster: RayCluster, ray_session: Callable[..., unison.Session]
) -> None:
    # one worker on n1, one on n2 (each group of one fills 3 of a node's 4 CPUs)
    sess = ray_session(2, 2, launcher=RayLauncher(num_cpus=3, placement_timeout=30),
                       collectives="torch")
    assert node_of(sess, 0) != node_of(sess, 1)
    out = sess.run(lambda: unison.allreduce(np.ones(3) * (unison.rank() + 1)))
    for x in out:
        np.testing.assert_allclose(x, [3.0, 3.0, 3.0])
    got = sess.run(lambda: unison.allgather(np.array([unison.rank()])))
    assert [list(np.concatenate(g)) if isinstance(g, list) else list(g) for g in got] \
        == [[0, 1], [0, 1]]



def test_each_group_on_its_node_runs_group_collectives_on_shared_memory(
    ray_cluster: RayCluster, ray_session: Callable[..., unison.Session]
) -> None:
    torch = pytest.importorskip("torch")
    # 2 groups of 2 workers of 2 CPUs: one group on n1, one on n2 (STRICT_PACK); in each,
    # the first worker makes the node's segment and hands it to the other
    sess = ray_session(4, 2, launcher=RayLauncher(num_cpus=2, placement_timeout=30),
                       collectives="torch")
    where = [node_of(sess, r) for r in range(4)]
    assert where[0] == where[1] != where[2] == where[3], where
    assert sess.run(collective_backend, True) == ["ShmCollectives"] * 4
    assert sess.run(collective_backend, False) == ["ClusterCollectives"] * 4

    def both() -> tuple[Any, ...]:
        r = unison.rank()
        grouped = unison.allgather(Box(r), group=True)
        total = unison.allreduce(np.full(200_000, float(r)), group=True)
        root = unison.broadcast({"from": r} if unison.group_rank() == 0 else None, src=0,
                                group=True)
        world = unison.allreduce(torch.ones(2) * (r + 1))
        got = None
        if unison.group() == 0:
            unison.send_to_next_group(r)  # across nodes: torch's object send
        else:
            got = unison.recv_from_prev_group()
        return [b.rank for b in grouped], float(total[0]), root, world.tolist(), got

    out = sess.run(both)
    assert [o[0] for o in out] == [[0, 1]] * 2 + [[2, 3]] * 2
    assert [o[1] for o in out] == [1.0] * 2 + [5.0] * 2
    assert [o[2] for o in out] == [{"from": 0}] * 2 + [{"from": 2}] * 2
    assert [o[3] for o in out] == [[10.0, 10.0]] * 4
    assert [o[4] for o in out] == [None, None, 0, 1]


def test_workers_all_beside_the_driver_run_every_collective_on_shared_memory(
    ray_cluster: RayCluster, ray_session: Callable[..., unison.Session]
) -> None:
    # both on the head, the driver's node: the session's segment comes with their fds
    sess = ray_session(2, launcher=RayLauncher(resources={"head": 1}, placement_timeout=30))
    assert sess.run(channel_kind) == ["ShmWorkerChannel"] * 2
    assert sess.run(collective_backend, False) == ["ShmCollectives"] * 2
    got = sess.run(lambda: [b.rank for b in unison.allgather(Box(unison.rank()))])
    assert got == [[0, 1]] * 2


def test_a_worker_killed_in_a_group_collective_on_another_node(
    ray_cluster: RayCluster, ray_session: Callable[..., unison.Session]
) -> None:
    sess = ray_session(4, 2, launcher=RayLauncher(num_cpus=2, placement_timeout=30))
    pids = sess.run(os.getpid)

    def wait_in_group() -> None:
        if unison.rank() == 3:
            time.sleep(60)
        unison.allreduce(np.ones(4), group=True)

    ref = sess.call(wait_in_group)
    time.sleep(0.5)  # rank 2 waits for rank 3 in the collective
    killed = time.monotonic()
    os.kill(pids[3], signal.SIGKILL)
    with pytest.raises(unison.WorkerDied) as err:
        ref.gather(timeout=30)
    took = time.monotonic() - killed
    assert err.value.worker == 3
    assert took < 2.0, took
    sess.close(timeout=1)
    assert wait_gone(pids, 5.0) == []


def test_chaos_on_the_ray_launcher(
    ray_cluster: RayCluster, ray_session: Callable[..., unison.Session]
) -> None:
    """tests/chaos.py's loop with Ray's actors: all on another node (TCP, their segment made
    by their first worker) or all beside the driver (shared memory through the Unix
    socket). Every round right or the right error in its bound, nothing left behind."""
    from chaos import Chaos

    def make(n: int, where: str) -> unison.Session:
        return ray_session(n, launcher=RayLauncher(num_cpus=0.5, resources={where: 1},
                                                   placement_timeout=30))

    for where in ("n2", "head"):  # what Ray's driver opens lazily, opened before the count
        make(1, where).close()
    tally = Chaos(7, channels=("n2", "head"), max_workers=2, make_session=make,
                  controller_kills=False, can_cancel=False,
                  exempt=leaks._trees).run(40)
    assert sum(tally.steps.values()) == 40
    assert tally.sessions > 1
