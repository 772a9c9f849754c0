"""Fixtures: sessions that are always closed, controller scripts that are always reaped,
and a leak check around every test.

Everything here uses real worker processes; nothing is mocked.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import unison
from support import (
    MARKER,
    SharedSessions,
    kill_all,
    spawn_controller,
    stop,
    stray_workers,
    wait_gone,
)

# Tag every process this run starts (workers inherit the controller's environment), so the
# leak checks see this run's workers and never those of another run on the same machine.
os.environ.setdefault(MARKER, secrets.token_hex(8))


def _shm_entries() -> set[str]:
    try:
        return {name for name in os.listdir("/dev/shm") if "unison" in name}
    except FileNotFoundError:
        return set()


@pytest.fixture(scope="session", autouse=True)
def leak_baseline() -> Iterator[dict[str, Any]]:
    """Session-wide check helper: records what existed before the run (shared-memory names)
    and, once the run is over, sweeps whatever a failing test may have left behind, so one
    broken test cannot poison the next run. test_zz_hygiene.py asserts on this state."""
    baseline = {"shm": _shm_entries()}
    yield baseline
    kill_all(stray_workers())


@pytest.fixture(autouse=True)
def no_stray_workers(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test (and after its sessions are closed), none of this run's workers may
    still run, but those of a module's ``shared`` sessions (checked once the module ends): a
    leak is blamed on the test that caused it, then swept."""
    yield
    left = [p for p in stray_workers() if p.pid not in SharedSessions.alive]
    if left:
        left_pids = wait_gone([p.pid for p in left], 3.0)
        if left_pids:
            kill_all(p for p in left if p.pid in left_pids)
            pytest.fail(f"{request.node.nodeid} left worker processes running: {left_pids}")


@pytest.fixture(scope="module")
def shared(request: pytest.FixtureRequest) -> SharedSessions:
    """``shared(n, num_groups=1, **kw)``: one session per configuration for the whole module
    (starting one costs a good part of a second), closed when the module ends."""
    sessions = SharedSessions()
    request.addfinalizer(sessions.close)
    return sessions


@pytest.fixture
def channel() -> str | None:
    """The channel sessions of ``make_session`` use: None, the default. A test module that
    must hold for every channel overrides this fixture with a parametrized one."""
    return None


@pytest.fixture
def make_session(channel: str | None) -> Iterator[Callable[..., unison.Session]]:
    """``make_session(n, **kw)`` opens a Session that is closed when the test ends, passed
    or failed."""
    sessions: list[unison.Session] = []

    def make(num_workers: int = 2, *args: Any, **kw: Any) -> unison.Session:
        if channel is not None:
            kw.setdefault("channel", channel)
        sess = unison.Session(num_workers, *args, **kw)
        sessions.append(sess)
        return sess

    yield make
    errors = []
    for sess in reversed(sessions):
        try:
            sess.close(timeout=0)
        except Exception as exc:  # close every session before reporting
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture
def sess(make_session: Callable[..., unison.Session]) -> unison.Session:
    """A session of two workers, closed when the test ends."""
    return make_session(2)


@pytest.fixture
def controller() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """``controller(code, **popen_kw)`` runs ``code`` as a controller script in a fresh
    interpreter; it is killed and reaped when the test ends."""
    procs: list[subprocess.Popen[str]] = []

    def start(code: str, **popen_kw: Any) -> subprocess.Popen[str]:
        proc = spawn_controller(code, **popen_kw)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        stop(proc)
