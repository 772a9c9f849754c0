"""Every worker's Python stacks, even while its main thread holds the GIL in a C call.

    worker (at start, install())                 controller (collect())
    memfd "unison-stacks-<rank>-<main ident>"    finds it in /proc/<pid>/fd, opens it there
    (O_APPEND) <- faulthandler.register(SIGNAL,  truncates it, sends SIGNAL to the pid
                  all_threads=True)              polls: data, and SIGNAL neither pending nor
    the kernel runs faulthandler's C handler     blocked (= its handler is still running) in
    in some thread: it writes every thread's     any thread -> the dump is complete
    Python frames, without taking the GIL        bounded: a worker that does not answer in
                                                 time is named, with its process state

faulthandler writes from the signal handler in C, so the dump comes even when the main
thread is stuck in a regex, a long numpy call, a sleep or a collective. It shows Python frames
only (a C function shows as the Python line that called it). The signal is a real-time one
(SIGRTMIN+4; unison.cancel uses SIGRTMIN+3), whose default action would end a process: the
controller signals a pid only after finding this memfd among its fds, so a pid that is not a
unison worker of that rank on this host (a worker that joined over TCP from another host,
whose pid means nothing here) is never signalled; its stacks say why they are missing.
A signal cuts short what the worker's C code sleeps or polls in (EINTR: SA_RESTART does not
restart those), so only a user's ask and the report of a timeout or a hang signal; the hang
watchdog's samples read /proc alone.

Frames are listed innermost first (the most recent call first), as faulthandler prints them.
"""

from __future__ import annotations

import dataclasses
import dis
import faulthandler
import fcntl
import functools
import os
import re
import signal
import threading
import time
from collections.abc import Iterable, Sequence
from types import CodeType
from typing import NamedTuple

__all__ = ["SIGNAL", "Frame", "Stacks", "ThreadStack", "WorkerStacks", "collect", "install"]

SIGNAL = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR1
"""The signal that asks a worker for its stacks (unison.cancel's is SIGRTMIN+3)."""
_PREFIX = "unison-stacks-"
_POLL = 0.002  # seconds between looks at a dump being written
_STILL = 5  # looks in a row at a dump that stands still, for it to be done
_installed: list[int] = []


# -- the worker's side ---------------------------------------------------------------------------


def install(rank: int) -> None:
    """In a worker, once: dump every thread's stack to a memfd when SIGNAL arrives. The memfd
    is named after the rank and the main thread's id (so the controller can tell it and the
    main thread apart); it is close-on-exec, and appended to, so the controller can empty it
    before each request."""
    if _installed or not hasattr(os, "memfd_create"):
        return
    ident = threading.main_thread().ident or 0
    fd = os.memfd_create(f"{_PREFIX}{rank}-{ident:x}", os.MFD_CLOEXEC)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
    faulthandler.register(SIGNAL, file=fd, all_threads=True, chain=False)
    _installed.append(fd)


# -- what the controller gets --------------------------------------------------------------------


class Frame(NamedTuple):
    """One Python frame: the file, the line being run, the function."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{short_path(self.file)}:{self.line} in {self.function}()"


@dataclasses.dataclass(frozen=True)
class ThreadStack:
    """One thread's frames, innermost (most recent call) first."""

    ident: int
    """The thread's id, as ``threading.get_ident()`` gives it in the worker."""
    main: bool
    """Whether this is the worker's main thread (the one that runs the calls)."""
    frames: list[Frame]


@dataclasses.dataclass(frozen=True)
class WorkerStacks:
    """What one worker answered: faulthandler's own text, parsed into threads; or, where it
    did not answer, ``error`` says why (and ``text`` and ``threads`` are empty)."""

    rank: int
    pid: int
    text: str
    threads: list[ThreadStack]
    error: str = ""

    @property
    def main(self) -> ThreadStack | None:
        """The main thread's stack (the one running the worker's calls), if it answered."""
        return next((t for t in self.threads if t.main), None)

    def __str__(self) -> str:
        head = f"worker {self.rank} (pid {self.pid})"
        if self.error:
            return f"{head}: {self.error}"
        parts = [head + ":"]
        for t in self.threads:
            parts.append(f"  {'main thread' if t.main else 'thread'} 0x{t.ident:x} "
                         "(most recent call first):")
            parts.extend(f"    {f}" for f in t.frames)
            if not t.frames:
                parts.append("    <no Python frame>")
        return "\n".join(parts)


class Stacks(dict[int, WorkerStacks]):
    """``sess.stacks()``: each worker's WorkerStacks by rank; printing it prints them all."""

    def __str__(self) -> str:
        return "\n".join(str(s) for _, s in sorted(self.items()))


# -- the controller's side -----------------------------------------------------------------------


def collect(pids: dict[int, int], timeout: float = 2.0) -> Stacks:
    """Ask each worker (rank -> pid) for its stacks at once; wait up to ``timeout`` seconds in
    all. Never raises for a worker: one that cannot be asked, or does not answer in time, gets
    an ``error`` saying why."""
    deadline = time.monotonic() + timeout
    out = Stacks()
    asked: dict[int, _Ask] = {}
    try:
        for rank, pid in pids.items():
            ask, error = _ask(rank, pid, deadline)
            if ask is None:
                out[rank] = WorkerStacks(rank, pid, "", [], error)
            else:
                asked[rank] = ask
        looks = 0
        while asked:
            looks += 1
            for rank in list(asked):
                text = asked[rank].answer()
                if text is not None:
                    ask = asked.pop(rank)
                    ask.close()
                    out[rank] = WorkerStacks(rank, ask.pid, text, parse(text, ask.main))
                elif looks % 16 == 0 and _state(asked[rank].pid).startswith(("T", "t")):
                    ask = asked.pop(rank)  # stopped after it was asked: it cannot answer now
                    ask.close()
                    out[rank] = WorkerStacks(rank, ask.pid, "", [], _stopped(_state(ask.pid)))
            if not asked or time.monotonic() >= deadline:
                break
            time.sleep(_POLL)
        for rank, ask in asked.items():
            state = _state(ask.pid)
            why = f"did not answer within {timeout:g} s"
            if state:
                why += f" (its process state: {state})"
            out[rank] = WorkerStacks(rank, ask.pid, "", [], why)
    finally:
        for ask in asked.values():
            ask.close()
    return Stacks(sorted(out.items()))


class _Ask:
    """One request to one worker: its memfd, opened through /proc."""

    def __init__(self, pid: int, fd: int, main: int, tasks: dict[str, bool]) -> None:
        self.pid = pid
        self.fd = fd
        self.main = main
        self.blocked_before = {t for t, b in tasks.items() if b}
        """Threads that block SIGNAL anyway (they never run the handler): ignored."""

    def answer(self) -> str | None:
        """The dump once it is complete, else None."""
        if self.fd < 0 or os.fstat(self.fd).st_size == 0:
            return None
        # something is written, so the handler has started: it has ended once SIGNAL is
        # neither pending nor blocked in a thread (the kernel blocks it while its handler runs)
        pending, tasks = _signal_state(self.pid)
        if pending or any(b and t not in self.blocked_before for t, b in tasks.items()):
            return None
        data = os.pread(self.fd, os.fstat(self.fd).st_size, 0)
        return data.decode(errors="replace")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _ask(rank: int, pid: int, deadline: float) -> tuple[_Ask | None, str]:
    """Find worker ``rank``'s memfd under /proc/<pid>, empty it and signal the worker (a
    dump still being written is waited for, up to ``deadline``: the collect's)."""
    if pid == os.getpid():
        return None, ("runs inline in the controller (Session(inline_worker0=True)): its "
                      "stack is the controller's own (faulthandler.dump_traceback())")
    name, link = find(rank, pid)
    if not name:
        return None, link
    try:
        main = int(link[len(f"/memfd:{_PREFIX}{rank}-"):].split()[0], 16)
    except ValueError:
        main = 0
    fd_dir = f"/proc/{pid}/fd"
    state = _state(pid)
    if state.startswith(("T", "t")):  # the signal would wait until it continues
        return None, _stopped(state)
    try:
        fd = os.open(f"{fd_dir}/{name}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return None, f"not available: cannot open its stack file ({exc.strerror})"
    try:
        pending, tasks = _signal_state(pid)
        # An earlier request's signal still pending, or its handler still writing (it blocks
        # the signal meanwhile): let that dump finish before emptying the file, which would
        # else cut the head off a dump being written (one came back without its main thread).
        # A dump is being written while the file grows; a thread that blocks the signal
        # beside a file that stands still is one that always does (a C library's pool):
        # waiting out the 0.2 s for it made each worker's answer 0.2 s late.
        end = min(time.monotonic() + 0.2, deadline)
        size, still = -1, 0
        while time.monotonic() < end:
            if not pending:
                now = os.fstat(fd).st_size
                if not now or not any(tasks.values()):
                    break  # no dump begun, or no handler running
                still = still + 1 if now == size else 0
                if still == _STILL:
                    break
                size = now
            time.sleep(_POLL)
            pending, tasks = _signal_state(pid)
        os.ftruncate(fd, 0)
        if not pending:  # else a signal blocked all along is still to come: that one answers
            os.kill(pid, SIGNAL)
    except OSError as exc:
        os.close(fd)
        return None, f"not available: cannot signal its process ({exc.strerror})"
    return _Ask(pid, fd, main, tasks), ""


def find(rank: int, pid: int) -> tuple[str, str]:
    """Worker ``rank``'s memfd among the fds of process ``pid``: its fd's name under
    /proc/<pid>/fd and the link it reads as; ``("", why not)`` where ``pid`` is not a unison
    worker of that rank on this host (a worker that joined from another host or pid
    namespace reports a pid that means nothing here, or another process)."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except FileNotFoundError:
        return "", ("not available: no process with its pid on this host (a worker that "
                    "joined from another host, or one that has ended)")
    except OSError as exc:
        return "", f"not available: cannot look into its process ({exc.strerror})"
    want = f"/memfd:{_PREFIX}{rank}-"
    for name in names:
        try:
            link = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue
        if link.startswith(want):
            return name, link
    if _state(pid).startswith("Z"):  # a zombie has no fds left: it was a worker, maybe
        return "", ("not available: it has exited; its keeper has not reported it (is the "
                    "keeper stopped?)")
    return "", ("not available: its process on this host is not a unison worker of that "
                "rank (a worker on another host has no stacks to read from here)")


def _stopped(state: str) -> str:
    return (f"its process is stopped ({state}: SIGSTOP, Ctrl-Z or a debugger): no stack "
            "until it continues")


def _signal_state(pid: int) -> tuple[bool, dict[str, bool]]:
    """Whether SIGNAL is pending for the process (or any of its threads), and for each thread
    whether it blocks SIGNAL now."""
    bit = 1 << (int(SIGNAL) - 1)
    pending = False
    tasks: dict[str, bool] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False, tasks
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        fields = dict(_status_fields(status))
        if int(fields.get(b"SigPnd", b"0"), 16) & bit or int(fields.get(b"ShdPnd", b"0"), 16) & bit:
            pending = True
        tasks[tid] = bool(int(fields.get(b"SigBlk", b"0"), 16) & bit)
    return pending, tasks


def _status_fields(status: bytes) -> Iterable[tuple[bytes, bytes]]:
    for line in status.splitlines():
        key, _, value = line.partition(b":")
        if key in (b"SigPnd", b"ShdPnd", b"SigBlk"):
            yield key, value.strip()


def _state(pid: int) -> str:
    """The process's state as /proc says it ("S (sleeping)", "T (stopped)"), or ""."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"State:"):
                    return line[6:].decode().strip()
    except OSError:
        pass
    return ""


# -- parsing faulthandler's text -----------------------------------------------------------------

_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)|^Stack \(most recent")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+|\?\?\?) in (.*)$')


def parse(text: str, main: int = 0) -> list[ThreadStack]:
    """faulthandler's dump as threads of frames (innermost first); ``main`` is the id of the
    main thread."""
    threads: list[ThreadStack] = []
    frames: list[Frame] | None = None
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            ident = int(head.group(1), 16) if head.group(1) else 0
            frames = []
            threads.append(ThreadStack(ident, ident == main, frames))
            continue
        frame = _FRAME.match(line)
        if frame and frames is not None:
            lineno = frame.group(2)
            frames.append(Frame(frame.group(1), int(lineno) if lineno.isdigit() else 0,
                                frame.group(3)))
    return threads


# -- one line per worker, for error messages ------------------------------------------------------

_UNISON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_WORKER_FILE = _UNISON_DIR + "worker.py"
_CHANNEL_DIR = _UNISON_DIR + "channel" + os.sep
_RECEIVES = frozenset({"recv", "_recv"})
"""What a worker's loop calls to wait for the next command: a channel's ``recv``, or the
pure-Python shm ring's ``_recv``, bound in its place (one frame fewer on its hot path)."""


def is_unison(frame: Frame) -> bool:
    """Whether a frame is unison's own code."""
    return frame.file.startswith(_UNISON_DIR)


def where(stacks: WorkerStacks, depth: int = 3) -> str:
    """One line saying where a worker is: its main thread's innermost frame outside unison,
    then up to ``depth - 1`` callers ("<-": called from), and the unison function it is
    inside, if any: ``worker 1 is in unison's barrier(), at train.py:42 in step() <-
    train.py:60 in main()``."""
    if stacks.error:
        return f"worker {stacks.rank}: {stacks.error}"
    main = stacks.main
    if main is None and stacks.text.rstrip().endswith("\n..."):
        # (any other thread in its place would be named as where the call is)
        return (f"worker {stacks.rank}: its main thread, which runs the call, is not in its "
                f"stack dump: faulthandler writes {len(stacks.threads)} threads at most, the "
                "newest first, and this worker has more (sess.stacks() shows those)")
    if main is None:  # (its id unknown: the first thread with frames)
        main = next((t for t in stacks.threads if t.frames), None)
    if main is None or not main.frames:
        return f"worker {stacks.rank}: no Python frame in its main thread"
    frames = call_frames(main.frames)
    if not frames:  # the loop is the innermost Python frame: in a C function it called
        calls, receive = _loop_lines()
        loop = main.frames[0]
        if loop.line in calls:
            return (f"worker {stacks.rank} is inside the call's function, in C code (no "
                    "Python frame of its own: a builtin such as time.sleep)")
        if loop.line in receive:
            return f"worker {stacks.rank} is in its loop, between calls"
        return f"worker {stacks.rank} is in unison's own code, at {loop}"
    first = next((i for i, f in enumerate(frames) if not is_unison(f)), None)
    if first is None:
        entry = frames[-1]  # what the loop called: waiting for a command is being idle
        if entry.function in _RECEIVES and entry.file.startswith(_CHANNEL_DIR):
            return f"worker {stacks.rank} is idle (in its loop, between calls)"
        return f"worker {stacks.rank} is in unison's own code, at {frames[0]}"
    user: list[Frame] = []
    for f in frames[first:]:
        if is_unison(f) or len(user) == depth:
            break
        user.append(f)
    text = f"worker {stacks.rank} is "
    if first > 0:
        text += f"in unison's {frames[first - 1].function}(), "
    return text + "at " + " <- ".join(map(str, user))


def call_frames(frames: list[Frame]) -> list[Frame]:
    """Of a worker's main thread (innermost first), the frames inside the call it runs:
    those inside its loop (unison.worker's serve), without the loop and the bootstrap."""
    for i, f in enumerate(frames):
        if f.function == "serve" and f.file == _WORKER_FILE:
            return frames[:i]
    return frames


@functools.cache
def _loop_lines() -> tuple[frozenset[int], frozenset[int]]:
    """The lines of the worker's loop (serve) that call the call's function (``value =
    fn(...)``), and the one that waits for the next command (``got = recv()``): read once,
    in the controller, from the loop's code (the workers pay nothing for it)."""
    from unison import worker  # (it imports this module)

    code = worker.serve.__code__
    return _lines(code, "fn", "value"), _lines(code, "recv", "got")


def _lines(code: CodeType, load: str, store: str) -> frozenset[int]:
    """The lines of ``code`` that both read the local ``load`` and set the local ``store``."""
    line_of = {}
    for start, end, line in code.co_lines():
        for offset in range(start, end, 2):
            line_of[offset] = line
    loads, stores = set(), set()
    for ins in dis.get_instructions(code):
        names = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
        if "LOAD_FAST" in ins.opname and load in names:
            loads.add(line_of.get(ins.offset))
        if "STORE_FAST" in ins.opname and store in names:
            stores.add(line_of.get(ins.offset))
    return frozenset(line for line in loads & stores if line is not None)


def report(stacks: Stacks, ranks: Sequence[int]) -> str:
    """Where each of ``ranks`` is, one indented line each."""
    return "\n".join(f"  {where(stacks[r])}" for r in ranks if r in stacks)


def short_path(path: str) -> str:
    """A path as error messages show it: relative to the current directory where it is
    below it, from the library root for the standard library and site-packages."""
    try:
        cwd = os.getcwd() + os.sep
    except OSError:
        cwd = ""
    if cwd and path.startswith(cwd):
        return path[len(cwd):]
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    m = re.search(r"/lib/python\d+\.\d+/", path)
    if m:
        return path[m.end():]
    return path
