"""The Launcher seam, specified through LocalLauncher and the interface alone: real workers
started from hand-made WorkerSpecs over a pipe channel, no Session in between (but the last
test, which checks that a Session takes a Launcher instance)."""

from __future__ import annotations

import dataclasses
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import psutil
import pytest

import unison
from support import autogroup, stranger_at, wait_dead
from unison import channel as channels
from unison.launch import DeathReport, Launcher, create, zygote
from unison.launch.local import LocalLauncher
from unison.spec import WorkerSpec

RANK_VAR = "UNISON_TEST_LAUNCH_RANK"


def _specs(chan: channels.Channel, n: int) -> list[WorkerSpec]:
    specs = []
    for rank in range(n):
        chan_spec, fds = chan.endpoint(rank)
        specs.append(WorkerSpec(rank=rank, world_size=n, num_groups=1, channel=chan_spec,
                                sys_path=list(sys.path), fds=tuple(fds)))
    return specs


def _wait_ready(chan: channels.Channel, n: int, timeout: float = 60.0) -> None:
    """Each worker's first reply is its hello: once all n came, every worker is up."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"only workers {sorted(seen)} started"
        for rank, data in chan.recv(left):
            assert data is not None, f"worker {rank} ended before saying hello"
            seen.add(rank)


def _keeper(launcher: Launcher, rank: int) -> psutil.Process:
    """The process the launcher holds for ``rank`` (its keeper, whose child is the worker)."""
    assert isinstance(launcher, LocalLauncher)
    return psutil.Process(launcher.workers[rank].pid)


def _wait_ended(launcher: Launcher, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while (rank := launcher.ended()) is None:
        assert time.monotonic() < deadline, "no worker was seen to end"
        time.sleep(0.01)
    return rank


@pytest.fixture
def launched(request: pytest.FixtureRequest,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Launcher, channels.Channel]]:
    """Two workers started by a LocalLauncher, up and waiting for commands: forked from a
    zygote, as it starts them, or (parametrized "apart") each an interpreter of its own."""
    if getattr(request, "param", "forked") == "apart":
        monkeypatch.setattr(zygote, "usable", lambda env: False)
    chan = channels.create("pipe", 2, "unison-test-launch")
    launcher = create("local")
    try:
        launcher.start(_specs(chan, 2), {r: {RANK_VAR: str(r)} for r in range(2)})
        chan.started(launcher.watch_fds())
        _wait_ready(chan, 2)
        yield launcher, chan
    finally:
        launcher.stop(0.5)
        chan.close()


def test_create_takes_a_name_or_an_instance() -> None:
    made = create("local")
    assert isinstance(made, LocalLauncher) and isinstance(made, Launcher)
    assert create("local") is not made  # a name makes a new launcher each time
    assert create(made) is made  # an instance is used as it is
    with pytest.raises(ValueError, match="'local'"):
        create("no-such-launcher")
    with pytest.raises(TypeError, match="Launcher"):
        create(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Launcher()  # type: ignore[abstract]


def test_started_workers_run_until_stopped(
        launched: tuple[Launcher, channels.Channel]) -> None:
    launcher, _ = launched
    assert launcher.ended() is None
    if sys.platform == "linux":
        assert len(launcher.watch_fds()) == 2  # one pidfd per worker
    ready, _, _ = select.select(launcher.watch_fds(), [], [], 0)
    assert ready == []  # nobody has ended
    launcher.stop(0.5)
    launcher.stop(0.5)  # idempotent
    assert launcher.watch_fds() == []  # released with the workers


@pytest.mark.parametrize("launched", ["forked", "apart"], indirect=True)
def test_workers_lead_their_own_process_groups_in_the_controllers_session(
        launched: tuple[Launcher, channels.Channel]) -> None:
    """Not our process group: a terminal's Ctrl-C reaches the controller alone. Our
    session: a session of its own would put a worker in a scheduler autogroup of its own
    (Linux), where its yields hand the core over to nobody outside it (issue 9). The
    group is the worker's alone, numbered by its keeper's pid: the keeper is in its
    parent's (the zygote's, or ours for a worker started apart, where it ignores the
    terminal's signals), so a signal that stops the worker's group never stops the keeper,
    which must report the worker's death."""
    launcher, _ = launched
    for rank in range(2):
        keeper = _keeper(launcher, rank)
        worker = keeper.children()[0]
        assert os.getpgid(worker.pid) == keeper.pid != os.getpgid(0)
        assert os.getpgid(keeper.pid) == os.getpgid(keeper.ppid()) != keeper.pid
        with open(f"/proc/{keeper.pid}/status") as f:
            ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
        for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP, signal.SIGHUP):
            assert ignored >> (sig - 1) & 1, sig
        for pid in (keeper.pid, worker.pid):
            assert os.getsid(pid) == os.getsid(0)
            assert autogroup(pid) == autogroup()


def _sigint_of_a_started_program() -> tuple[str, int]:
    """Worker code: SIGINT's handling in a Python the worker starts, and the exit status
    of a ``sleep`` it starts and then sends SIGINT."""
    python = subprocess.run(
        [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT))"],
        capture_output=True, text=True, check=True).stdout.strip()
    sleeper = subprocess.Popen(["sleep", "30"])
    time.sleep(0.1)
    sleeper.send_signal(signal.SIGINT)
    return python, sleeper.wait(timeout=10)


@pytest.mark.parametrize("n", [1, 2])  # a worker started apart, and forked by the zygote
def test_programs_a_worker_starts_take_sigint_as_usual(make_session, n):
    """A worker ignores SIGINT (a KeyboardInterrupt in it is its code's own), but the
    programs its code starts do not inherit that. Before (issue 9, forty-ninth pass; an
    audit of what worker code does), they inherited SIG_IGN: a SIGINT could not stop them,
    and a Python one never raised KeyboardInterrupt."""
    sess = make_session(n)
    assert sess.run(_sigint_of_a_started_program) == [
        ("<built-in function default_int_handler>", -signal.SIGINT)] * n
    assert sess.run(signal.raise_signal, signal.SIGINT) == [None] * n  # still nothing


def test_a_killed_worker_is_seen_and_described(
        launched: tuple[Launcher, channels.Channel]) -> None:
    launcher, _ = launched
    watch = launcher.watch_fds()
    _keeper(launcher, 1).send_signal(signal.SIGKILL)
    if watch:
        ready, _, _ = select.select(watch, [], [], 10.0)
        assert len(ready) == 1  # the dead worker's pidfd, and only it
    assert _wait_ended(launcher) == 1
    report = launcher.death(1, grace=5.0)
    assert report == DeathReport(rank=1, exitcode=-9, output=report.output, reason="")
    assert isinstance(report.output, str)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.rank = 0  # type: ignore[misc]


def test_death_kills_a_worker_that_still_runs(
        launched: tuple[Launcher, channels.Channel]) -> None:
    launcher, _ = launched
    report = launcher.death(0, grace=0.05)
    assert report.rank == 0
    assert report.exitcode in (None, -9)  # killed just now: maybe not reaped yet
    assert "still ran, so unison killed it" in report.reason
    assert _wait_ended(launcher) == 0


def test_a_failed_start_stops_what_it_started() -> None:
    chan = channels.create("pipe", 2, "unison-test-launch")
    launcher = create("local")
    try:
        specs = _specs(chan, 2)
        broken = dataclasses.replace(specs[1], fds=(*specs[1].fds, 999_999))  # no such fd
        with pytest.raises((OSError, ValueError)):
            launcher.start([specs[0], broken], {})
        assert launcher.watch_fds() == []
        launcher.stop(0)  # still fine after a failed start
    finally:
        chan.close()
    # the conftest's leak check asserts that worker 0 was not left running


class _CountingLauncher(LocalLauncher):
    """A LocalLauncher that counts its starts: proof that the session used this one."""

    starts = 0

    def start(self, specs: Sequence[WorkerSpec],
              env: Mapping[int, Mapping[str, str]] | None = None) -> None:
        _CountingLauncher.starts += 1
        super().start(specs, env)


def test_a_session_takes_a_launcher_instance() -> None:
    launcher: Any = _CountingLauncher()  # Any: until Session's signature takes a Launcher
    with unison.Session(2, launcher=launcher) as sess:
        assert sess.run(unison.rank) == [0, 1]
    assert _CountingLauncher.starts == 1


@pytest.mark.parametrize("launched", ["forked", "apart"], indirect=True)
def test_an_ended_workers_number_given_to_another_program_is_left_alone(
        launched: tuple[Launcher, channels.Channel]) -> None:
    """A worker's keeper leads a process group of its number. Once it is reaped, and its
    group empty, the number is free, and the kernel gives it out again (pid_max is 32,768
    on many machines: a busy one comes round in minutes). The launcher killed that number's
    group on every death() and stop(), so it SIGKILLed another program's group when the
    death came to be read after the number was given out. Now only the reaper ends the
    group, before its reap."""
    launcher, _ = launched
    keeper = _keeper(launcher, 1)
    below = keeper.children()
    keeper.children()[0].kill()  # the worker: its keeper then ends
    assert _wait_ended(launcher) == 1  # seen to end: reaped (by us or by the zygote)
    for proc in [keeper, *below]:
        wait_dead(proc.pid)
    stranger = stranger_at(keeper.pid)
    try:
        report = launcher.death(1, grace=1.0)
        assert report.exitcode == -9
        launcher.stop(0.5)
        time.sleep(0.1)
        assert stranger.poll() is None, "unison killed another program's process group"
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.parametrize("launched", ["forked", "apart"], indirect=True)
def test_a_keeper_killed_outright_takes_its_workers_children_along(
        launched: tuple[Launcher, channels.Channel]) -> None:
    """The other side of the test above: a keeper killed with SIGKILL cannot kill what lies
    below it, and its worker's children stay in its group. The reaper ends that group before
    the reap: the zygote, or the launcher's exitcode()."""
    launcher, _ = launched
    keeper = _keeper(launcher, 1)
    worker = keeper.children()[0]
    # stands in for what the worker started: in its group, but not below the keeper
    child = subprocess.Popen(["sleep", "60"], process_group=keeper.pid)
    try:
        keeper.kill()
        assert _wait_ended(launcher) == 1
        assert child.wait(10) == -signal.SIGKILL
        wait_dead(worker.pid)  # (with its keeper: PR_SET_PDEATHSIG)
    finally:
        child.kill()
        child.wait()


def exit_with(code: int) -> None:
    os._exit(code)


@pytest.mark.parametrize("n", [1, 2], ids=["apart", "forked"])
def test_a_controller_ignoring_sigchld_never_shows_a_death_as_a_clean_exit(make_session,
                                                                            n: int) -> None:
    """A controller with SIGCHLD set to SIG_IGN (or a waitpid(-1) of its own): the kernel
    reaps a worker it started before we can, and Popen took that for exit code 0. Now its
    status is unknown, and the error says why; the zygote sets SIGCHLD back to SIG_DFL, so
    forked workers' statuses come through as ever."""
    before = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        sess = make_session(n)
        with pytest.raises(unison.WorkerDied) as info:
            sess[n - 1].run(exit_with, 3)
    finally:
        signal.signal(signal.SIGCHLD, before)
    if n == 1:
        assert info.value.exitcode is None, str(info.value)
        assert "reaped by someone else" in info.value.reason
    else:
        assert info.value.exitcode == 3, str(info.value)


def signal_state() -> tuple[list[int], bool]:
    return sorted(signal.pthread_sigmask(signal.SIG_BLOCK, ())), (
        signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL)


@pytest.mark.parametrize("n", [1, 2], ids=["apart", "forked"])
def test_workers_start_with_no_signal_blocked(make_session, n: int) -> None:
    """A session opened from a thread that blocks signals: the mask passes through fork
    and exec, and Ref.cancel()'s signal (and sess.stacks()') would never arrive."""
    import threading

    box: list[Any] = []

    def open_it() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        box.append(make_session(n))

    thread = threading.Thread(target=open_it)
    thread.start()
    thread.join()
    assert box[0].run(signal_state) == [([], True)] * n


@pytest.mark.parametrize("n", [1, 2], ids=["apart", "forked"])
def test_a_start_past_start_timeout_raises_timeout_error_then(monkeypatch, n: int) -> None:
    """Workers that never start (here: a bootstrap that only sleeps) fail the start at
    start_timeout with the same error, forked or apart. The zygote's wait was its own 60 s
    (_FORKING, 10 here to fail fast), and a start's error spoke of a Ref to wait on."""
    from unison.launch import local

    monkeypatch.setattr(zygote, "_FORKING", 10.0)
    monkeypatch.setattr(zygote, "_BOOTSTRAP", "import time; time.sleep(60)  # {path} {pid}")
    monkeypatch.setattr(local, "_BOOTSTRAP", "import time; time.sleep(60)  # {pid}")
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        unison.Session(n, start_timeout=1.0)
    assert time.monotonic() - start < 4
    text = str(info.value)
    assert text.startswith(f"starting timed out: {n} worker(s) {list(range(n))}"), text
    assert "start_timeout" in text and "session is closed" in text
    assert "Ref" not in text



def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_an_interrupt_as_a_proc_file_opens_leaves_no_fd() -> None:
    """A Ctrl-C (any exception a signal handler raises) as the open of a /proc file
    returns, before the fd is held (pacing's looks at the scheduler, in every wait):
    the bare fd was lost; a file object is closed as it is dropped. A profile function
    raises at that very point."""
    from unison import pacing

    def interrupt(frame: Any, event: str, arg: Any) -> None:
        if event == "c_return" and arg in (open, os.open):
            sys.setprofile(None)
            raise KeyboardInterrupt

    before = _fds()
    sys.setprofile(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            pacing._read("/proc/loadavg")
    finally:
        sys.setprofile(None)
    assert _fds() == before


def test_an_arena_that_cannot_map_its_file_closes_it(monkeypatch) -> None:
    from unison.channel import arena

    def no_map(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt  # (or an OSError: no memory, a limit on mappings)

    before = _fds()
    monkeypatch.setattr(arena.mmap, "mmap", no_map)
    with pytest.raises(KeyboardInterrupt):
        arena.Arena("unison-test-arena", 2)
    assert _fds() == before


def module_file(name: str) -> str:
    import importlib

    return str(importlib.import_module(name).__file__)


@pytest.mark.parametrize("n", [1, 2], ids=["own-interpreter", "forked"])
def test_the_workers_sys_path_keeps_the_controllers_order(make_session, tmp_path,
                                                           monkeypatch, n) -> None:
    """A folder the controller appended (behind the stdlib) went in front of the stdlib on
    the workers: a module of a stdlib name in it was another file there."""
    (tmp_path / "colorsys.py").write_text("SHADOW = True\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])
    sess = make_session(n)
    assert sess.run(module_file, "colorsys") == [module_file("colorsys")] * n
    assert not module_file("colorsys").startswith(str(tmp_path))


@pytest.mark.parametrize("n", [1, 2])
def test_a_relay_thread_that_cannot_start_fails_the_start_cleanly(monkeypatch, n) -> None:
    """Threads count against a limit on processes: where the output relay's could not
    start, the start raised "cannot join thread before it is started" (the real error its
    context), warned of a relay stuck in a handler, and left the workers' pipes, the wake
    pipe and the selector open. (The leak check after each test counts them.)"""
    import threading

    start = threading.Thread.start

    def refused(self: threading.Thread) -> None:
        if self.name == "unison-output":
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", refused)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        unison.Session(n)


def test_a_spec_past_the_pipes_size_to_a_slow_starting_worker_keeps_the_start_deadline(
        monkeypatch) -> None:
    """A worker's spec went to its stdin in one blocking write: past the pipe's 64 KiB (here
    thousands of sys.path entries), to a worker whose interpreter start is slow (here 20 s,
    a sitecustomize's sleep), it held the controller until the worker read, past
    start_timeout (an audit of the local launcher, issue 9, forty-sixth pass). The write
    now waits no later than the start deadline, and the start fails with TimeoutError."""
    from unison.launch import local

    monkeypatch.setattr(local, "_BOOTSTRAP", "import time; time.sleep(20)\n" + local._BOOTSTRAP)
    monkeypatch.setattr(sys, "path", [*sys.path, *(f"/nonexistent/{i:05}" for i in range(8000))])
    before = set(psutil.Process().children(recursive=True))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="start_timeout"):
        unison.Session(1, start_timeout=2)
    assert time.monotonic() - start < 8
    left = set(psutil.Process().children(recursive=True)) - before
    assert not [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_spec_written_under_a_far_deadline_goes_whole() -> None:
    """A start_timeout of a month (finite) made the write's poll raise OverflowError: its
    milliseconds overflowed a C int (a review, issue 9, forty-eighth pass)."""
    import threading

    r, w = os.pipe()
    blob = os.urandom(300_000)  # past the pipe's 64 KiB: the write waits for the reader
    got = bytearray()

    def read() -> None:
        time.sleep(0.3)
        with os.fdopen(r, "rb") as stream:
            got.extend(stream.read())

    reader = threading.Thread(target=read)
    reader.start()
    with os.fdopen(w, "wb") as stream:
        zygote.write_init(stream, blob, time.monotonic() + 3e6, [0])
    reader.join(10)
    assert bytes(got) == len(blob).to_bytes(8, "little") + blob
