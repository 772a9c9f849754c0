"""Per-worker environment variables and CPU affinity."""

from __future__ import annotations

import os

import pytest

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


def _threads_env() -> tuple[str | None, str | None]:
    return os.environ.get("OMP_NUM_THREADS"), os.environ.get("OPENBLAS_NUM_THREADS")


def test_workers_share_the_cores_among_their_thread_pools(make_session, monkeypatch):
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    sess = make_session(2, env={1: {"OMP_NUM_THREADS": "7"}})
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert sess.run(_threads_env) == [(share, share), ("7", share)]


def test_a_thread_setting_of_the_user_wins(make_session, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    sess = make_session(2)
    assert [omp for omp, _ in sess.run(_threads_env)] == ["3", "3"]
