"""A pytest plugin that checks for leaks around every test, and once more when the run ends.

    setup of a test ......... snapshot: fds, threads, child processes
    the test, its teardown .. (function fixtures close their sessions)
    after teardown .......... gc, then wait a short grace for threads and processes to end;
                              what survived is frozen (gc.freeze), so collections stay cheap;
                              what is new since the snapshot is a leak of THIS test: its
                              teardown errors, and leaked processes are killed
    end of the run .......... no worker process of this run, no child of the test runner, no
                              /dev/shm entry named "unison" and no unison memfd held by a
                              process of this run may be left: else the run exits non-zero
                              (and what is left is swept)

What counts, in the spirit of dask's resource-leak plugin:
- file descriptors (each with what it points to, so a reused number counts as new), memfds
  among them ("memfd:unison-..." links, named as such in the report);
- Python threads;
- child processes of the test runner, and any worker process of this run (found by the
  ``UNISON_TEST_RUN`` marker in its environment, wherever it was reparented to).

Exempt: the module-scoped ``shared`` sessions (see ``support.SharedSessions``). Their
workers are skipped, and in a test that uses them, fds and threads the sessions may open
lazily are not blamed on the test: they are checked once the module's sessions are closed
(``module_check``), against the state before the module's first session. Likewise a test
module's own module-scoped fixtures named in MODULE_FIXTURES, and the process trees in
EXEMPT_TREES (test_ray.py's Ray cluster, which checks its own leaks).

Loaded by conftest.py (``pytest_plugins``); ``-p no:leaks`` turns the per-test checks off
(the end-of-run hygiene check stays: it lives in conftest.py).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import psutil
import pytest

from support import SharedSessions, kill_all, open_fds, stray_workers, wait_gone

GRACE = 3.0
"""Seconds a test's threads and processes get to end after its teardown."""

MODULE_FIXTURES = {"shared"}
"""Module-scoped fixtures whose fds and threads are not blamed on the tests that use them
(a module may add its own: test_ray.py adds its Ray cluster, whose driver opens them lazily)."""
EXEMPT_TREES: set[int] = set()
"""Processes that a module-scoped fixture keeps for its tests (a Ray cluster's daemons),
with everything below them: not blamed on a test (the fixture checks them itself)."""


@dataclass(frozen=True)
class Resources:
    """What this process holds at one moment."""

    fds: frozenset[tuple[str, str]] = frozenset()
    threads: frozenset[threading.Thread] = frozenset()
    children: frozenset[int] = frozenset()

    @classmethod
    def now(cls) -> Resources:
        return cls(frozenset(open_fds()), frozenset(threading.enumerate()), _children())

    def minus(self, before: Resources) -> Resources:
        return Resources(
            self.fds - before.fds, self.threads - before.threads, self.children - before.children
        )

    def __bool__(self) -> bool:
        return bool(self.fds or self.threads or self.children)


@dataclass
class Leaks:
    """The checks' state over a run."""

    fds: set[tuple[str, str]] = field(default_factory=set)
    threads: set[threading.Thread] = field(default_factory=set)
    """fds and threads already blamed on a test: not blamed again on the module."""

    def add(self, leaked: Resources) -> None:
        self.fds |= leaked.fds
        self.threads |= leaked.threads


_REPORTED = Leaks()


def _children() -> frozenset[int]:
    """Child processes of the test runner that still run code (zombies are gone)."""
    out = set()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.status() != psutil.STATUS_ZOMBIE:
                out.add(child.pid)
    return frozenset(out)


def new_since(
    before: Resources, exempt_pids: Iterable[int] = (), *, fds_and_threads: bool = True,
    children: bool = True,
) -> Resources:
    """What is open now and was not at ``before``, once threads and processes had up to
    ``GRACE`` seconds to end: only the kinds asked for, without what was reported already
    and the exempt pids."""
    exempt = set(exempt_pids)
    deadline = time.monotonic() + GRACE
    while True:
        gc.collect()  # a session dropped without close() is closed by now
        now = Resources.now().minus(before)
        skip = exempt | _trees() if EXEMPT_TREES else exempt
        new = Resources(
            frozenset(fd for fd in now.fds if fd not in _REPORTED.fds)
            if fds_and_threads else frozenset(),
            frozenset(t for t in now.threads if t.is_alive() and t not in _REPORTED.threads)
            if fds_and_threads else frozenset(),
            frozenset(p for p in now.children if p not in skip) if children else frozenset(),
        )
        if not new or time.monotonic() >= deadline:
            return new
        time.sleep(0.05)


def _trees() -> set[int]:
    """EXEMPT_TREES and every process below them, now."""
    out = set(EXEMPT_TREES)
    for root in processes(EXEMPT_TREES):
        with contextlib.suppress(psutil.NoSuchProcess):
            out.update(p.pid for p in root.children(recursive=True))
    return out


def describe(leaked: Resources) -> str:
    parts = []
    memfds = sorted(target for _, target in leaked.fds if target.startswith("memfd:"))
    others = sorted(f"{fd} -> {target}" for fd, target in leaked.fds
                    if not target.startswith("memfd:"))
    if memfds:
        parts.append(f"memfds {memfds}")
    if others:
        parts.append(f"file descriptors {others}")
    if leaked.threads:
        parts.append(f"threads {sorted(t.name for t in leaked.threads)}")
    if leaked.children:
        parts.append(f"child processes {sorted(leaked.children)}")
    return "; ".join(parts)


def _uses_shared(item: pytest.Item) -> bool:
    return bool(MODULE_FIXTURES.intersection(getattr(item, "fixturenames", ())))


_BEFORE = pytest.StashKey[Resources]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    item.stash[_BEFORE] = Resources.now()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """After the test's own teardown: blame what it left open on it (an error at teardown)."""
    try:
        result = yield
    except BaseException:
        _check(item)  # sweep what it left; its teardown has failed already
        raise
    problems = _check(item)
    if problems:
        pytest.fail(f"{item.nodeid} left open: {problems}", pytrace=False)
    return result


def _check(item: pytest.Item) -> str:
    """What ``item`` left open since its setup began, "" if nothing; processes are killed."""
    before = item.stash.get(_BEFORE, None)
    if before is None:  # setup never began
        return ""
    problems = []
    workers = [p.pid for p in stray_workers() if p.pid not in SharedSessions.alive]
    left_workers = wait_gone(workers, GRACE) if workers else []
    if left_workers:
        kill_all(p for p in stray_workers() if p.pid in left_workers)
        problems.append(f"worker processes {left_workers}")
    # A test of the shared sessions: their fds and threads (opened lazily, on first use) are
    # checked once they are closed, by module_check.
    leaked = new_since(before, SharedSessions.alive, fds_and_threads=not _uses_shared(item))
    kill_all(processes(leaked.children))
    _REPORTED.add(leaked)
    if leaked:
        problems.append(describe(leaked))
    # What survived the collection above (torch, ray, the serve app: ~500k objects once
    # imported) is moved out of the collector's sight, so the next test's collections walk
    # only what came since: a full collection of that heap took 0.3-0.6 s, once per test.
    # The end of the run unfreezes it for its last collection (conftest.py).
    gc.freeze()
    return "; ".join(problems)


def processes(pids: Iterable[int]) -> list[psutil.Process]:
    """The processes of ``pids`` that still exist."""
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            out.append(psutil.Process(pid))
    return out


def module_check(before: Resources) -> None:
    """Once a module's shared sessions are closed: nothing they or the tests that used them
    opened is still open (the shared sessions' resources are freed with them)."""
    leaked = new_since(before, children=False)  # processes: the per-test check's job
    _REPORTED.add(leaked)
    if leaked:
        pytest.fail(f"the module's shared sessions left open: {describe(leaked)}", pytrace=False)


def shm_entries() -> set[str]:
    """Entries of /dev/shm whose name says unison."""
    try:
        return {name for name in os.listdir("/dev/shm") if "unison" in name}
    except FileNotFoundError:
        return set()


MEMFD = "/memfd:unison-"
"""How a unison memfd shows in /proc/<pid>/fd links and /proc/<pid>/maps (every memfd unison
and these tests make is named "unison-...")."""


def memfds_of(pid: int) -> set[tuple[int, str]]:
    """The unison memfds process ``pid`` holds, as an fd or a mapping: (inode, name) pairs;
    empty if it is gone or not ours to read."""
    out = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                path = f"/proc/{pid}/fd/{fd}"
                if os.readlink(path).startswith(MEMFD):
                    out.add((os.stat(path).st_ino, os.readlink(path)))
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(MEMFD):
                out.add((int(fields[4]), fields[5].rstrip("\n")))
    return out


def memfd_holders(pids: Iterable[int]) -> dict[int, list[str]]:
    """Which of ``pids`` hold a unison memfd, and which."""
    held = {pid: sorted({name for _, name in memfds_of(pid)}) for pid in pids}
    return {pid: names for pid, names in held.items() if names}
