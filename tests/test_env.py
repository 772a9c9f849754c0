"""Per-worker environment variables and CPU affinity."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

from unison import _proctree, cgroup, pacing, placement
from unison.launch import local
from unison.pacing import crowd
from unison.session import checks

VAR = "UNISON_TEST_ONLY_ON_ONE"


def read_var(name):
    return os.environ.get(name)


def affinity():
    return sorted(os.sched_getaffinity(0))


def test_env_reaches_only_the_worker_it_names(make_session):
    assert VAR not in os.environ
    sess = make_session(2, env={1: {VAR: "bar"}})
    assert sess.run(read_var, VAR) == [None, "bar"]
    assert VAR not in os.environ  # the controller's environment is untouched


def test_env_for_several_workers(make_session):
    sess = make_session(3, env={0: {VAR: "zero"}, 2: {VAR: "two"}})
    assert sess.run(read_var, VAR) == ["zero", None, "two"]


def test_workers_inherit_the_controllers_environment(make_session, monkeypatch):
    monkeypatch.setenv("UNISON_TEST_INHERITED", "yes")
    sess = make_session(2)
    assert sess.run(read_var, "UNISON_TEST_INHERITED") == ["yes", "yes"]


needs_two_cpus = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin two workers apart"
)


@needs_two_cpus
def test_cpu_affinity_pins_each_worker_to_its_cpus(make_session):
    cpus = sorted(os.sched_getaffinity(0))[:2]
    sess = make_session(2, cpu_affinity={0: [cpus[0]], 1: [cpus[1]]})
    assert sess.run(affinity) == [[cpus[0]], [cpus[1]]]
    assert sorted(os.sched_getaffinity(0)) != [cpus[0]]  # the controller is not pinned


def test_cpu_affinity_for_some_workers_leaves_the_others_alone(make_session):
    mine = sorted(os.sched_getaffinity(0))
    sess = make_session(2, cpu_affinity={1: [mine[0]]})
    assert sess.run(affinity) == [mine, [mine[0]]]


def test_cpu_affinity_true_pins_workers_within_the_allowed_cpus(make_session):
    allowed = set(os.sched_getaffinity(0))
    sess = make_session(2, cpu_affinity=True)
    for cpus in sess.run(affinity):
        assert cpus, "a worker with no CPU"
        assert set(cpus) <= allowed



def test_cpu_affinity_true_with_inline_worker_0_pins_the_others(make_session):
    """True named worker 0 too, which runs in the controller: the session was refused
    ("cpu_affinity for rank 0 cannot be given"), though the user named no rank."""
    mine = affinity()
    sess = make_session(3, cpu_affinity=True, inline_worker0=True)
    got = sess.run(affinity)
    assert got[0] == mine and affinity() == mine  # the controller: untouched
    assert all(len(cpus) == 1 and set(cpus) <= set(mine) for cpus in got[1:]), got

def _threads_env() -> tuple[str | None, str | None]:
    return os.environ.get("OMP_NUM_THREADS"), os.environ.get("OPENBLAS_NUM_THREADS")


def test_workers_share_the_cores_among_their_thread_pools(make_session, monkeypatch):
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    sess = make_session(2, env={1: {"OMP_NUM_THREADS": "7"}})
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert sess.run(_threads_env) == [(share, share), ("7", "7")]


def test_the_thread_pools_share_a_cpu_quota_not_the_cpus(make_session, monkeypatch):
    """Under a container's CPU limit the pools share the quota's CPUs, rounded up
    (pacing.pool_cores): threads past it only spend it sooner."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a quota of one CPU is all of one CPU")
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(pacing, "_quota", lambda: cgroup.Quota(1.0, "/nowhere"))
    sess = make_session(1)
    assert sess.run(_threads_env) == [("1", "1")]


def test_a_thread_setting_of_the_user_wins(make_session, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    sess = make_session(2)
    assert [omp for omp, _ in sess.run(_threads_env)] == ["3", "3"]


def _pools() -> tuple[list[str], list[int] | None]:
    """In a worker: its _THREAD_VARS, and its OpenBLAS pools' sizes where threadpoolctl is
    there to read them (None where not)."""
    env = [os.environ.get(var, "") for var in local._THREAD_VARS]
    try:
        import numpy  # noqa: F401  (loads its OpenBLAS)
        import threadpoolctl
    except ImportError:
        return env, None
    return env, [pool["num_threads"] for pool in threadpoolctl.threadpool_info()
                 if pool["internal_api"] == "openblas"]


def test_a_thread_setting_of_the_user_reaches_every_library(make_session, monkeypatch):
    """README: the pools get cores / N "unless you set OMP_NUM_THREADS and friends". The
    others were still set to the share, and OpenBLAS reads OPENBLAS_NUM_THREADS first: numpy
    in the workers ran the share's threads, not the user's. Now the unset ones get the
    user's value."""
    share = max(1, pacing.pool_cores() // 2)
    mine = "1" if share > 1 else "2"
    for var in local._THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", mine)
    sess = make_session(2, cpu_affinity=False)  # (a pinned worker's OpenBLAS takes 1 CPU)
    for env, openblas in sess.run(_pools):
        assert env == [mine] * len(local._THREAD_VARS)
        if openblas and len(os.sched_getaffinity(0)) >= 2:
            assert openblas == [int(mine)] * len(openblas)


def test_a_ranks_own_thread_setting_is_read_before_the_controllers(make_session, monkeypatch):
    """A rank's ``env`` that sets OPENBLAS_NUM_THREADS, under a controller with
    OMP_NUM_THREADS: the rank's value fills the variables neither set (MKL's, numexpr's),
    where the controller's was taken first (the first set in the variables' order); the
    controller's own OMP_NUM_THREADS stands."""
    for var in local._THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    sess = make_session(2, env={1: {"OPENBLAS_NUM_THREADS": "2"}}, cpu_affinity=False)
    (env0, _), (env1, _) = sess.run(_pools)
    assert env0 == ["3"] * len(local._THREAD_VARS)
    assert env1 == ["3", "2"] + ["2"] * (len(local._THREAD_VARS) - 2)


@pytest.fixture
def two_cpus() -> Iterator[list[int]]:
    """This process (the controller) held to two CPUs for the test: three processes of a
    session of two then outnumber them."""
    mine = os.sched_getaffinity(0)
    two = sorted(mine)[:2]
    os.sched_setaffinity(0, two)
    try:
        yield two
    finally:
        os.sched_setaffinity(0, mine)


@pytest.fixture
def own_verdicts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The controller's looks judge nothing here, so only the test's own verdicts count: a
    busy CI host may really be crowded, and a lone worker then follows the controller."""
    monkeypatch.setattr(pacing._Crowd, "_judge",
                        lambda self, now: setattr(self, "next_look", now + pacing.LOOK))
    crowd.forget()
    yield
    crowd.forget()


def _verdict_here() -> tuple[list[int], list[int], list[int]]:
    """In a worker: its CPUs and a thread's, then the same after this process's verdict
    that the machine is crowded (pacing.crowd), which lets go of spread pins."""
    started = threading.Event()
    stop = threading.Event()

    def idle() -> None:
        started.set()
        stop.wait(10)

    thread = threading.Thread(target=idle, daemon=True)
    thread.start()
    started.wait(10)
    tid = thread.native_id
    assert tid is not None
    before = affinity()
    assert sorted(os.sched_getaffinity(tid)) == before  # a thread inherits the pin
    # the start is over here, as after this worker's first wait for a command; on a busy
    # host a worker may not have waited yet (each command was in before it looked), and
    # until then a verdict is the workers' start, not a crowd (CI, 2026-12-04)
    crowd.forget()
    crowd._crowded(time.perf_counter(), "a verdict the test gives")
    crowd.forget()  # waits go on spinning: only the pins were the point
    try:
        return before, affinity(), sorted(os.sched_getaffinity(tid))
    finally:
        stop.set()


@needs_two_cpus
def test_workers_that_outnumber_the_cpus_are_spread_one_to_a_cpu_until_a_crowd(
        make_session, two_cpus):
    """cpu_affinity=None (the default): three processes on two CPUs, so each worker is held
    to one, round robin, the controller to none; a crowded verdict in a worker lets every
    thread of it use both again (unison.placement)."""
    a, b = two_cpus
    sess = make_session(2)
    assert sess.run(affinity) == [[a], [b]]
    assert affinity() == two_cpus  # the controller is not pinned
    got = sess[1].run(_verdict_here)[0]
    assert got == ([b], two_cpus, two_cpus)
    assert sess.run(affinity) == [[a], two_cpus]  # worker 0 still held


@needs_two_cpus
def test_the_controllers_crowded_verdict_lets_go_of_every_spread_worker(
        make_session, two_cpus):
    sess = make_session(3)
    a, b = two_cpus
    assert sess.run(affinity) == [[a], [b], [a]]
    crowd._crowded(time.perf_counter(), "a verdict the test gives")
    crowd.forget()
    assert sess.run(affinity) == [two_cpus] * 3
    sess.close()
    assert sess._placed is None


@needs_two_cpus
def test_a_closed_sessions_workers_are_no_longer_let_go(make_session, two_cpus):
    before = list(crowd._on_crowd)
    sess = make_session(3)
    (let_go,) = [fn for fn in crowd._on_crowd if fn not in before]
    sess.close()
    assert let_go not in crowd._on_crowd  # its pids may be another process's by now


def pin_to(cpus: list[int]) -> list[int]:
    os.sched_setaffinity(0, cpus)
    return affinity()


@needs_two_cpus
def test_a_workers_own_cpus_stay_when_placement_lets_go(make_session, two_cpus,
                                                         own_verdicts):
    """A worker's own os.sched_setaffinity was overwritten at the crowded verdict (every
    worker let go onto every CPU), and a lone worker's by its following the controller: the
    user's choice was lost without a word. Placement now moves only what is still where it
    put it."""
    a, b = two_cpus
    sess = make_session(3)
    assert sess.run(affinity) == [[a], [b], [a]]
    assert sess[2].run(pin_to, [b]) == [[b]]
    crowd._crowded(time.perf_counter(), "a verdict the test gives")
    crowd.forget()
    assert sess.run(affinity) == [two_cpus, two_cpus, [b]]
    sess.close()

    lone = make_session(1)
    assert lone.run(pin_to, [b]) == [[b]]
    try:
        crowd._crowded(time.perf_counter(), "a verdict the test gives")
        os.sched_setaffinity(0, [a])  # the controller on a: the worker followed it there
        crowd.look(time.perf_counter())
        assert lone.run(affinity) == [[b]]
    finally:
        os.sched_setaffinity(0, two_cpus)
        crowd.forget()
    crowd.look(time.perf_counter())
    assert lone.run(affinity) == [[b]]


@needs_two_cpus
def test_a_pid_that_changed_hands_keeps_its_cpus(two_cpus):
    """placement changes a worker's CPUs by pid, while its session is open, and a worker
    may have died unseen meanwhile: its pid may be another program's. A pid is changed only
    while it is the process that started then (_proctree.started)."""
    a, _ = two_cpus
    other = subprocess.Popen(["sleep", "60"])
    try:
        start = _proctree.started(other.pid)
        assert start is not None
        placement._set(other.pid, start + 1, [a], expect=two_cpus)  # as if another
        assert sorted(os.sched_getaffinity(other.pid)) == two_cpus  # process had its pid
        placement._set(other.pid, start, [a], expect=two_cpus)
        assert sorted(os.sched_getaffinity(other.pid)) == [a]
    finally:
        other.kill()
        other.wait()
    assert _proctree.started(other.pid) is None  # reaped: no process of that pid


@needs_two_cpus
def test_no_spread_where_each_process_has_a_cpu_or_when_asked_not_to(make_session, two_cpus,
                                                                     own_verdicts):
    assert make_session(1).run(affinity) == [two_cpus]
    assert make_session(3, cpu_affinity=False).run(affinity) == [two_cpus] * 3


@needs_two_cpus
def test_a_lone_worker_follows_the_controller_while_the_machine_is_crowded(
        make_session, two_cpus, own_verdicts):
    """N=1: while crowded, each look holds the worker on the CPU the controller's thread
    last ran on (unison.placement.together_when_crowded); the first calm look lets go."""
    before = crowd._on_look
    sess = make_session(1)
    (follow,) = [fn for fn in crowd._on_look if fn not in before]
    assert sess.run(affinity) == [two_cpus]
    try:
        crowd._crowded(time.perf_counter(), "a verdict the test gives")
        for cpu in (*two_cpus, two_cpus[0]):  # the controller moves; the worker follows
            os.sched_setaffinity(0, [cpu])
            crowd.look(time.perf_counter())
            assert sess.run(affinity) == [[cpu]]
    finally:
        os.sched_setaffinity(0, two_cpus)
        crowd.forget()
    crowd.look(time.perf_counter())  # calm: let go
    assert sess.run(affinity) == [two_cpus]
    sess.close()
    assert follow not in crowd._on_look  # its pid may be another process's by now


@needs_two_cpus
def test_no_following_with_more_workers_or_pins(make_session, two_cpus):
    before = crowd._on_look
    make_session(2)  # they run side by side: spread instead
    make_session(1, cpu_affinity=False)
    make_session(1, inline_worker0=True)  # the worker is the controller
    assert crowd._on_look == before


def test_the_spread_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Who is held where: local workers (``children``) only, only where the session's
    processes (the controller too, unless it runs worker 0 inline) outnumber the CPUs."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5})
    plan = checks.cpu_plan
    assert plan(3, None, children=True) == {0: [3], 1: [5], 2: [3]}
    assert plan(2, None, children=True) == {0: [3], 1: [5]}
    assert plan(1, None, children=True) == {}  # two processes, two CPUs
    assert plan(2, None, children=True, inline=True) == {}
    assert plan(3, None, children=True, inline=True) == {1: [5], 2: [3]}  # rank 0 is us
    assert plan(3, None) == {}  # workers elsewhere (Ray, hand-started): not ours to place
    assert plan(3, False, children=True) == {}
    assert plan(3, True) == {0: [3], 1: [5], 2: [3]}


def test_a_removed_current_folder_is_named_when_the_workers_would_import_from_it(tmp_path):
    """sys.path's '' (python -c, a notebook) is the current folder, which the workers get; a
    removed one failed with a bare FileNotFoundError that named no path."""
    gone = tmp_path / "gone"
    gone.mkdir()
    code = textwrap.dedent(f"""
        import os, sys
        import unison
        sys.path.insert(0, "")
        os.chdir({str(gone)!r})
        os.rmdir({str(gone)!r})
        try:
            unison.Session(1)
        except FileNotFoundError as exc:
            print("refused:", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert "refused: the current folder was removed" in out.stdout, out.stderr
