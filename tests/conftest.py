"""Fixtures: sessions that are always closed, controller scripts that are always reaped,
the contract tests run once per channel, a leak check around every test (leaks.py) and a
hygiene check when the run ends.

Everything here uses real worker processes; nothing is mocked.
"""

from __future__ import annotations

import contextlib
import gc
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

import unison

# leaks.py is also this suite's plugin (pytest_plugins below): let pytest rewrite it first.
pytest.register_assert_rewrite("leaks")

from leaks import Resources, memfd_holders, module_check, processes, shm_entries  # noqa: E402
from support import (  # noqa: E402
    MARKER,
    SharedSessions,
    kill_all,
    spawn_controller,
    stop,
    stray_workers,
    wait_gone,
)

pytest_plugins = ["leaks"]

# Tag every process this run starts (workers inherit the controller's environment), so the
# leak checks see this run's workers and never those of another run on the same machine.
os.environ.setdefault(MARKER, secrets.token_hex(8))

CHANNELS = tuple(os.environ.get("UNISON_TEST_CHANNELS", "shm,pipe").split(","))
"""The channels every contract test runs against, as CPython runs each executor test once
per start method (``UNISON_TEST_CHANNELS=shm`` for one: test_pure_ring's child run, where
the pipe channel, which has no C code, would run as it does in the main run)."""
assert set(CHANNELS) <= {"shm", "pipe"}, f"UNISON_TEST_CHANNELS={CHANNELS}: shm, pipe or both"

CONTRACT_MODULES = frozenset({
    "test_api", "test_views", "test_errors", "test_free", "test_close", "test_timeout",
    "test_threads", "test_functions", "test_bad_input", "test_death",
})
"""Modules whose tests taking the ``channel`` fixture (``sess``, ``make_session``) run once
per channel; a module outside this list opts in with ``pytestmark = pytest.mark.channels``."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise the ``channel`` fixture over CHANNELS in the contract modules, unless a
    test names its channels itself (``@pytest.mark.parametrize("channel", [...])``)."""
    if "channel" not in metafunc.fixturenames or _parametrizes_channel(metafunc):
        return
    module = metafunc.module.__name__.rpartition(".")[2]
    if module in CONTRACT_MODULES or metafunc.definition.get_closest_marker("channels"):
        metafunc.parametrize("channel", CHANNELS, indirect=True)


def _parametrizes_channel(metafunc: pytest.Metafunc) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if "channel" in names:
            return True
    return False


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The hygiene check once every test and fixture is done: no worker process of this run,
    no child process of the test runner, no "unison" entry in /dev/shm (whoever left it:
    unison makes none, its segments are memfds) and no process of this run holding a unison
    memfd. What is left is reported, swept (so one broken run cannot poison the next) and
    fails the run."""
    gc.unfreeze()  # what the per-test checks froze (leaks.py) is collectable again
    for name in ("last_exc", "last_type", "last_value", "last_traceback"):
        # pytest keeps the last failure here (for pdb): its frames may hold a closed
        # session's views of its memfds, which the check below would blame on unison
        sys.__dict__.pop(name, None)
    gc.collect()  # sessions dropped without close() are closed by now
    problems = []
    workers = wait_gone([p.pid for p in stray_workers()], 3.0)
    if workers:
        problems.append(f"worker processes outlived the tests: {workers}")
    children = wait_gone(_running_children(), 3.0)
    if children:
        problems.append(f"child processes of the test runner outlived the tests: {children}")
    shm = sorted(shm_entries())
    if shm:
        problems.append(f"entries in /dev/shm named unison (removed now): {shm}")
    ours = [os.getpid(), *children, *(p.pid for p in stray_workers())]
    held = memfd_holders(ours)
    if held:
        problems.append(f"processes of this run hold unison memfds: {held}")
    if not problems:
        return
    kill_all(p for p in stray_workers() if p.pid in workers)
    kill_all(processes(children))
    for name in shm:
        with contextlib.suppress(OSError):  # another run's sweep, or another user's entry
            os.unlink(os.path.join("/dev/shm", name))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", "hygiene check failed", red=True, bold=True)
    for line in problems:
        if reporter is not None:
            reporter.write_line(line, red=True)
        else:
            print(f"hygiene check failed: {line}", file=sys.stderr)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _running_children() -> list[int]:
    """Child processes of the test runner; zombies are reaped (they run no code)."""
    running = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(child.pid, os.WNOHANG)
                continue
            running.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return running


@pytest.fixture(scope="module")
def shared(request: pytest.FixtureRequest) -> Iterator[SharedSessions]:
    """``shared(n, num_groups=1, **kw)``: one session per configuration for the whole module
    (starting one costs a good part of a second), closed when the module ends; then nothing
    they opened may be left (the per-test leak check leaves their fds and threads to this)."""
    before = Resources.now()
    sessions = SharedSessions()
    yield sessions
    sessions.close()
    module_check(before)


@pytest.fixture
def channel(request: pytest.FixtureRequest) -> str | None:
    """The channel sessions of ``make_session`` use: one of CHANNELS in the contract modules
    (see pytest_generate_tests), else None, the default."""
    return getattr(request, "param", None)


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
