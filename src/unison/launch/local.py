"""Local worker processes: start, watch, relay their output, stop.

    controller                                   worker process (forked by unison.launch.zygote,
                                                 or a fresh interpreter: Popen of the bootstrap)
      init on stdin ---------------------------> reads its init (rank, channel spec, sys.path),
                                                 forks: it stays as the keeper, the child works
      stdin  (init, then held open) -----------> keeper's lifeline: EOF = the controller is gone
      stdout/stderr  <------------------------- "[worker r] line" relayed by one thread
      pidfd (readable once it exits)            own process group (not session), so a
                                                terminal's Ctrl-C reaches the controller alone

Workers are forked from one zygote per session (unison.launch.zygote: they share one
address-space layout), or start as interpreters of their own where ``env`` gives a rank a
variable an interpreter reads as it starts. Either way they never fork from the
controller and never import its ``__main__``: a plain script
without an ``if __name__ == "__main__":`` guard works. Nor do they import from the
controller's current directory (``python -c`` would put it first on sys.path): only the
controller's own sys.path is honoured. Each worker's keeper (see unison.worker) is a subreaper
that kills whatever the worker started when it ends; the launcher kills the whole tree, found
through /proc while it lives, when it stops a worker itself.

The relay never dies: a ``sys.stdout`` that is None, lacks ``flush()`` or raises loses the
output, never the thread, so workers never block on a full pipe. What is kept of a worker's
stderr for WorkerDied is bounded (_TAIL_CHARS), and so is a line without a newline. At
stop(), once the workers have ended, the relay hands over what they wrote before stop()
returns, within the rest of close's grace (at least _DRAIN_S); past that, what is left is
counted and dropped with one warning, and no handler of ours is called after stop().

The session sees only the Launcher interface (unison.launch): the pidfds are its watch_fds,
and death() turns a WorkerProcess into a DeathReport.
"""

from __future__ import annotations

import collections
import itertools
import os
import pickle
import selectors
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from unison import _native, _proctree
from unison._fdwait import readable
from unison.debug import logs as _logs
from unison.errors import note_warning
from unison.launch import DeathReport, Launcher, zygote
from unison.launch.zygote import Forked
from unison.pacing import pool_cores
from unison.spec import WorkerSpec

_BOOTSTRAP = zygote.BOOT + "from unison.worker import main; main({pid})"  # (BOOT: why)
_TAIL_CHARS = 64 * 1024
"""How much of a worker's stderr is kept, as its last whole lines, for WorkerDied.output."""
_LINE_CHARS = _logs.LINE_BYTES
"""A line longer than this (or output without a newline) is relayed in pieces this long;
from a record's mark on, it is held whole up to this (no record's line is longer)."""
_MARK = _logs.MARK.encode()
_DRAIN_S = 1.0
"""The least time stop() gives the relay, after the workers ended, for what they wrote (the
rest of close's grace where more is left): the controller's handlers may be slow."""
_CUT_S = 0.5
"""How long the relay then goes on reading, to count what it drops, before it lets go."""
_OWN_GROUP: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {}
"""Each worker leads a process group of its own, in the controller's session (its keeper,
which starts it, leaves the group to the worker: unison.worker._leave_group). A session of
its own (setsid) would also give it a scheduler autogroup of its own (Linux, where
autogroups are on), and a yield then hands the core over only within the worker's group:
the worker kept the core from the controller in a quarter of its turns, dispatch at N=2 ran
1.3-1.5x slower (issue 9, ninth pass). Python 3.10's Popen has no ``process_group`` (and a
``preexec_fn`` is unsafe beside threads): there the bootstraps' first line makes the group,
a few ms later (a kill in between reaches the process by pid, and its tree)."""
_LATE_REPORT = 5.0
"""Seconds past ``death``'s grace that the zygote's report of an ended keeper is waited for:
a zygote that was not scheduled for a while (a loaded machine, a CPU quota) reports late."""
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def interpreter() -> list[str]:
    """The command line of a worker's interpreter (and the zygote's): this Python with the
    controller's options, as multiprocessing's spawn starts its children. Without them the
    workers ran other code than the controller: asserts under -O, a warning under ``-W
    error``, the text encoding under ``-X utf8``. With -E or -I, the workers ignore the
    PYTHON* variables the controller ignored (they inherit its environment, as its own
    children do), so what unison sets for them does not rest on one: unison's folder goes
    on sys.path in the bootstraps, and -u stands for PYTHONUNBUFFERED. -s and -P reach them
    too: their sys.path is the controller's (unison.session.resources.sys_path). -S does
    not: the bootstrap imports unison.worker (numpy, cloudpickle) from site-packages before
    the controller's sys.path is applied, and a controller under -S found them by a path
    of its own making."""
    # -O, -B, -b, -S, -E, -I, -W, -X dev... (private, but what multiprocessing's spawn uses)
    args: list[str] = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
    args = [arg for arg in args if arg != "-S"]
    named = {arg.partition("=")[0] for flag, arg in itertools.pairwise(args) if flag == "-X"}
    for key, value in sys._xoptions.items():  # the -X options it leaves out (3.11's leaves
        if key not in named:  # int_max_str_digits, pycache_prefix, warn_default_encoding)
            args += ["-X", key if value is True else f"{key}={value}"]
    return [sys.executable, *args, "-u"]


def _ignored_env(rank_env: Mapping[int, Mapping[str, str]]) -> None:
    """Refuse a rank's PYTHON* variable where its interpreter would ignore it: the
    controller's -E or -I, which the workers start with too (``interpreter``)."""
    if not sys.flags.ignore_environment:
        return
    for rank, vars in rank_env.items():
        for name in vars:
            if name.startswith("PYTHON"):
                raise ValueError(
                    f"env[{rank}] sets {name}, which the worker would ignore: this "
                    "controller runs with -E or -I (sys.flags.ignore_environment), and its "
                    "workers start with the same options. Run the controller without them, "
                    "or give the setting as an option of its python (-O, -X, -W ...)")


def _thread_pools(env: Mapping[str, str], share: str,
                  own: Mapping[str, str] | None = None) -> dict[str, str]:
    """_THREAD_VARS for a worker whose environment is ``env`` (and a rank's ``own``, read
    first): ``share`` where the user set none of them, else what the user set, and for
    those left unset the first set (in _THREAD_VARS order, the rank's own first), so that
    every library's pool agrees. Forcing ``share`` on the unset ones had OpenBLAS, which
    reads OPENBLAS_NUM_THREADS before OMP_NUM_THREADS, ignore the user's OMP_NUM_THREADS."""
    own = own or {}
    chosen = next((got[var] for got in (own, env) for var in _THREAD_VARS if got.get(var)),
                  share)
    return {var: own.get(var) or env.get(var) or chosen for var in _THREAD_VARS}


class WorkerProcess:
    """One local worker: its process, pidfd, lifeline and the tail of what it printed."""

    def __init__(self, rank: int, popen: subprocess.Popen[bytes] | Forked) -> None:
        self.rank = rank
        self.popen = popen
        self.pid = popen.pid
        self.stderr_tail: collections.deque[str] = collections.deque()
        self._tail_chars = 0
        self.killed = False
        """True once the launcher killed it while it still ran (so the cause is known)."""
        self.lost = False
        """True once another in this process reaped it: its exit status is lost."""
        self.output_done = threading.Event()
        self._open_streams = 2
        try:  # a forked keeper's is Forked's (the zygote opened it before it could reap)
            self.pidfd: int | None = (popen.pidfd if isinstance(popen, Forked)
                                      else os.pidfd_open(popen.pid))
        except (AttributeError, OSError):
            self.pidfd = None

    def exitcode(self) -> int | None:
        """Its exit status once it has ended, else None. The zygote reaps a forked keeper;
        we reap one we started, and end its group first (``_reap``)."""
        popen = self.popen
        if self.lost:
            return zygote.UNKNOWN
        if isinstance(popen, Forked) or popen.returncode is not None:
            return popen.poll()
        return self._reap()

    def _reap(self) -> int | None:
        """Reap our own keeper once it has ended, killing what is left in its process group
        while its zombie still holds the number (zygote._end_group says why)."""
        try:
            if os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return None
        except ChildProcessError:  # reaped by another: the number may be another's, so
            self.lost = True  # its group is left alone; Popen would say 0 for its status
            return zygote.UNKNOWN
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return self.popen.poll()

    def has_ended(self) -> bool:
        """Whether it has ended, its exit status known or not (a forked keeper's comes from
        the zygote, which may say it late). Never blocks."""
        if isinstance(self.popen, Forked):
            return self.popen.ended()
        return self.exitcode() is not None

    def wait_exit(self, timeout: float) -> int | None:
        """``exitcode()`` within ``timeout`` seconds, else None."""
        deadline = time.monotonic() + timeout
        while True:
            code = self.exitcode()
            left = deadline - time.monotonic()
            if code is not None or left <= 0:
                return code
            if self.pidfd is None:  # no pidfd_open here: look again shortly
                time.sleep(min(left, 0.005))
            else:
                readable([self.pidfd], left)

    def kill(self) -> None:
        """SIGKILL the worker and every process below it (even those that left its process
        group), collected while it is alive, and its process group. Only while it has not
        ended: a reaped keeper's number may belong to another program's group by now, and
        its own group was ended before the reap (zygote._end_group, ``_reap``)."""
        if not self.has_ended():
            self.killed = True
            below = _proctree.descendants(self.pid)  # read while the tree is whole
            try:  # the keeper's own number while it runs: it is reaped only after its end,
                os.killpg(self.pid, signal.SIGKILL)  # and its reaper ends the group first
            except (ProcessLookupError, PermissionError):
                pass
            _proctree.kill_all(below)
        try:
            self.popen.kill()
        except OSError:
            pass

    def output(self) -> str:
        """The last lines it wrote to stderr, once its streams are drained (briefly waited for)."""
        self.output_done.wait(0.5)
        return "".join(self.stderr_tail)

    def death_reason(self) -> str:
        """Why it ended, where unison knows better than its exit status (for WorkerDied)."""
        if self.killed:
            return "unison stopped it (the session was closing, or it did not exit in time)"
        return ""

    def keep_tail(self, lines: list[str]) -> None:
        """Keep the last _TAIL_CHARS characters of stderr, as whole lines where they fit."""
        for line in lines:
            line = line[-_TAIL_CHARS:] + "\n"
            self.stderr_tail.append(line)
            self._tail_chars += len(line)
        while self._tail_chars > _TAIL_CHARS and len(self.stderr_tail) > 1:
            self._tail_chars -= len(self.stderr_tail.popleft())

    def release(self) -> None:
        if self.popen.stdin is not None:
            try:
                self.popen.stdin.close()
            except OSError:
                pass
        if isinstance(self.popen, Forked):
            self.popen.close()  # and with it our pidfd, the same fd
        elif self.pidfd is not None:
            os.close(self.pidfd)
        self.pidfd = None


class LocalLauncher(Launcher):
    """Starts local workers (forked from one zygote, or as interpreters of their own) and
    relays their output, prefixed by rank."""

    children = True

    def __init__(self) -> None:
        self.workers: list[WorkerProcess] = []
        self.stopped = False
        self._started = False
        self._watch: list[int] = []
        self._relay: threading.Thread | None = None
        self._wake: tuple[int, int] | None = None
        """The relay's wake pipe: stop() writes to it to end the relay's wait."""
        self._draining = False
        """Set by stop() once the workers ended: the relay ends when nothing is left to read."""
        self._cut_at: float | None = None
        """When stop() gave up on the relay: it drops (and counts) what is left from then."""
        self._dropped = [0, 0]  # logging records, bytes
        self._relay_lock = threading.Lock()
        self._relay_ended = False
        self._relay_closes = False
        """Whether the relay, stuck in a handler at stop(), closes the streams as it ends."""
        self._selector: selectors.BaseSelector | None = None
        """Made at start(), so a launcher that never starts holds no fd."""
        self._zygote: zygote.Zygote | None = None
        """The process that forked the workers (unison.launch.zygote), where one did."""

    def start(
        self,
        specs: Sequence[WorkerSpec],
        env: Mapping[int, Mapping[str, str]] | None = None,
    ) -> None:
        """Start one worker per spec; each inherits the fds its spec names."""
        if self._started or self.stopped:
            raise RuntimeError("a LocalLauncher starts its workers once: make a new one")
        _ignored_env(env or {})
        self._started = True
        selector = self._selector = selectors.DefaultSelector()
        base_env = dict(os.environ)
        base_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (zygote.ROOT, base_env.get("PYTHONPATH", "")) if p
        )
        base_env["PYTHONUNBUFFERED"] = "1"
        base_env.update(_native.warned_env())  # a stale build's warning, said once
        # N workers each running a BLAS or OpenMP pool as wide as the machine would fight
        # over the cores (and their spinning threads over our waits): share them out, as
        # loky and torchrun do, unless the user chose already.
        share = str(max(1, pool_cores() // max(1, len(specs))))
        base_env.update(_thread_pools(os.environ, share))
        base_env[_logs.ENV] = _logs.levels()  # workers' logging records come to ours
        rank_env = {rank: {str(k): str(v) for k, v in vars.items()}
                    for rank, vars in (env or {}).items()}
        for vars in rank_env.values():  # a rank's own choice, over the controller's
            if any(var in vars for var in _THREAD_VARS):
                vars.update(_thread_pools(os.environ, share, vars))
        try:
            # one layout for every worker (unison.launch.zygote); a lone worker has no one
            # to share it with, so a zygote would only be one more process to start
            if len(specs) > 1 and zygote.usable(env):
                self._zygote, forked = zygote.fork_workers(
                    interpreter(), [init.rank for init in specs],
                    {init.rank: init.fds for init in specs}, base_env, rank_env, _OWN_GROUP,
                    self.start_deadline)
                self.workers = [WorkerProcess(init.rank, proc)
                                for init, proc in zip(specs, forked)]
            else:
                for init in specs:  # each one kept at once: a failed start stops them
                    self.workers.append(WorkerProcess(init.rank, subprocess.Popen(
                        [*interpreter(), "-c",
                         _BOOTSTRAP.format(root=zygote.ROOT, pid=os.getpid())],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        pass_fds=init.fds,
                        env={**base_env, **rank_env.get(init.rank, {})},
                        **_OWN_GROUP,
                    )))
            for worker, init in zip(self.workers, specs):
                popen = worker.popen
                assert popen.stdin is not None
                zygote.write_init(popen.stdin, pickle.dumps(init, protocol=5),
                                  self.start_deadline, [init.rank])
                for stream, is_err in ((popen.stdout, False), (popen.stderr, True)):
                    assert stream is not None
                    os.set_blocking(stream.fileno(), False)
                    selector.register(stream, selectors.EVENT_READ, (worker, is_err, []))
            self._wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            selector.register(self._wake[0], selectors.EVENT_READ, None)
            # kept once started: a thread that could not start (a limit on processes counts
            # threads) is nothing to join, and the stop below closes what it would have read
            relay = threading.Thread(target=self._relay_output, args=(selector,),
                                     name="unison-output", daemon=True)
            relay.start()
            self._relay = relay
        except BaseException:
            self.stop(grace=0)
            raise
        self._watch = [w.pidfd for w in self.workers if w.pidfd is not None]

    def watch_fds(self) -> list[int]:
        """The workers' pidfds (none where the platform has no pidfd_open), until stop()."""
        return list(self._watch)

    def ended(self) -> int | None:
        return next((w.rank for w in self.workers if w.has_ended()), None)

    def death(self, rank: int, grace: float) -> DeathReport:
        worker = next(w for w in self.workers if w.rank == rank)  # (ranks may start past 0)
        code = worker.wait_exit(grace)
        ended = code is not None or worker.has_ended()
        if code is None and ended:  # a forked keeper: the zygote has not said how (yet)
            code = worker.wait_exit(_LATE_REPORT)
        reason = worker.death_reason()  # read before our own kill below
        if not ended:
            reason = "its channel broke while it still ran, so unison killed it"
        worker.kill()
        if code is None:
            code = worker.exitcode()
        if code is None and ended:
            code = zygote.UNKNOWN
            reason = reason or ("its exit status is unknown: the process that forked it "
                                "(unison.launch.zygote) still runs but had not said it "
                                f"{grace + _LATE_REPORT:g} s after it ended")
        if code == zygote.UNKNOWN and worker.lost:
            code = None
            reason = reason or ("its exit status is unknown: it was reaped by someone else in "
                                "this process (SIGCHLD set to SIG_IGN, or a waitpid(-1), such "
                                "as asyncio's FastChildWatcher)")
        if code == zygote.UNKNOWN:
            code = None
            reason = reason or ("its exit status is unknown: the process that forked it "
                                "(unison.launch.zygote) ended first")
        return DeathReport(rank, code, worker.output(), reason)

    def _relay_output(self, selector: selectors.BaseSelector) -> None:
        """Copy every worker's output to ours, line by line, each line prefixed by its rank."""
        try:
            while len(selector.get_map()) > 1 and self._relay_once(selector):  # (and the wake)
                if self._cut_at is not None and time.monotonic() > self._cut_at + _CUT_S:
                    break
        except (OSError, ValueError, RuntimeError, KeyError):
            pass  # a stream or the selector failed: nothing more can be relayed
        finally:
            with self._relay_lock:
                self._relay_ended = True
                if self._relay_closes:  # stop() returned while we were stuck in a handler
                    self._close_streams()

    def _relay_once(self, selector: selectors.BaseSelector) -> bool:
        """Relay what is there (waiting for it up to a second); False once stop() asked for
        the drain and nothing is left to read (the writers ended: their pipes are at EOF)."""
        draining = self._draining
        got = False
        for key, _ in selector.select(timeout=0.0 if draining else 1.0):
            if key.data is None:  # the wake pipe
                try:
                    while os.read(key.fd, 64):
                        pass
                except OSError:
                    pass
                continue
            got = True
            worker, is_err, partial = key.data
            stream: IO[bytes] = key.fileobj  # type: ignore[assignment]
            try:
                chunk = os.read(stream.fileno(), 65536)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if chunk:
                partial.append(chunk)
                if b"\n" not in chunk:
                    if sum(map(len, partial)) >= _LINE_CHARS:  # no newline in sight: bound it
                        data, rest = _piece(b"".join(partial)) if is_err else (
                            b"".join(partial), b"")
                        if not rest:  # a character cut in two by the read waits for its end
                            cut = _whole(data)
                            data, rest = data[:cut], data[cut:]
                        partial[:] = [rest] if rest else []
                        if data:
                            self._emit(worker, is_err, [data.decode(errors="replace")])
                    continue
                data = b"".join(partial)
                head, _, rest = data.rpartition(b"\n")
                partial[:] = [rest] if rest else []
                self._emit(worker, is_err, head.decode(errors="replace").split("\n"))
                continue
            if partial:
                self._emit(worker, is_err,
                           b"".join(partial).decode(errors="replace").split("\n"))
            selector.unregister(stream)
            worker._open_streams -= 1
            if worker._open_streams == 0:
                worker.output_done.set()
        return got or not draining

    def _emit(self, worker: WorkerProcess, is_err: bool, lines: list[str]) -> None:
        """``_emit``, or once stop() gave up on the relay, count the lines as dropped."""
        if self._cut_at is None:
            lines = _emit(worker, is_err, lines, self._cutting)
        if lines:
            self._dropped[0] += sum(_logs.MARK in line for line in lines) if is_err else 0
            self._dropped[1] += sum(len(line.encode()) + 1 for line in lines)

    def _cutting(self) -> bool:
        return self._cut_at is not None

    def stop(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for the workers to exit, then kill what is left.
        Idempotent; only the first call does anything."""
        if self.stopped:
            return
        self.stopped = True
        self._watch = []
        deadline = time.monotonic() + max(grace, 0.0)
        interrupted: BaseException | None = None
        try:
            for w in self.workers:
                if w.wait_exit(max(deadline - time.monotonic(), 0.0)) is None:
                    w.kill()
        except BaseException as exc:  # Ctrl-C in the grace wait: this stop is the only one,
            interrupted = exc  # so it kills and lets go of everything before it re-raises
        for w in self.workers:
            w.kill()  # also reaps anything the worker left behind in its process group
            w.popen.wait()
        try:
            now = time.monotonic()  # (after a Ctrl-C, no drain: it is said what was left)
            self._end_relay(now if interrupted else max(deadline, now + _DRAIN_S))
        except BaseException as exc:  # Ctrl-C in the relay's drain: it let go already
            if interrupted is None:
                interrupted = exc
            elif isinstance(exc, Warning):  # -W error: the first Ctrl-C goes on, this as
                note_warning(interrupted, exc)  # its note
        for w in self.workers:
            w.release()
        if self._zygote is not None:  # it leaves once its keepers have ended: they have
            self._zygote.end()
        if interrupted is not None:
            raise interrupted

    def _end_relay(self, until: float) -> None:
        """The workers have ended (the keepers killed what they started, so the pipes are at
        EOF): let the relay hand over what they wrote until ``until``, then have it drop the
        rest, said in one warning; close the streams once it is done with them."""
        relay = self._relay
        interrupted: BaseException | None = None
        if relay is not None:
            self._draining = True
            self._wake_relay()
            try:
                # (where a handler of ours closed the session, the relay drains on return)
                if relay is not threading.current_thread() and not _join(
                        relay, until - time.monotonic()):
                    self._cut_at = time.monotonic()
                    self._wake_relay()
                    _join(relay, _CUT_S + 0.1)
            except BaseException as exc:  # Ctrl-C: let go at once, and say what was dropped
                self._cut_at = time.monotonic()
                interrupted = exc
        with self._relay_lock:
            stuck = relay is not None and not self._relay_ended
            if stuck:
                self._relay_closes = True  # it reads them still: closing them is its own
            else:
                self._close_streams()
        records, size = self._dropped
        if self._cut_at is not None and (records or size or stuck):
            what = f"{records} logging record(s) and {size} bytes of their output"
            what = (f"the relay is still inside a handler (sys.stderr's write or a logging "
                    f"handler) that did not return, and what comes after it is dropped "
                    f"({what} counted so far)" if stuck else f"{what} were dropped")
            try:
                warnings.warn(
                    f"the workers' output was not all handed over within close's grace (at "
                    f"least {_DRAIN_S:g} s after they ended): {what}; make the controller's "
                    "handlers faster, or give close() a longer timeout", RuntimeWarning,
                    stacklevel=6)
            except Warning as warning:  # -W error: a Ctrl-C goes on, this as its note
                if interrupted is None:
                    raise
                note_warning(interrupted, warning)
        if interrupted is not None:
            raise interrupted

    def _wake_relay(self) -> None:
        if self._wake is not None:
            try:
                os.write(self._wake[1], b"w")
            except OSError:  # full: it is awake already
                pass

    def _close_streams(self) -> None:
        selector = self._selector
        for w in self.workers:
            for stream in (w.popen.stdout, w.popen.stderr):
                if stream is not None:
                    if selector is not None:
                        try:
                            selector.unregister(stream)
                        except (KeyError, ValueError):
                            pass
                    stream.close()
        if selector is not None:
            selector.close()
        if self._wake is not None:
            for fd in self._wake:
                os.close(fd)
            self._wake = None


def _join(thread: threading.Thread, timeout: float) -> bool:
    """Whether ``thread`` ended within ``timeout`` seconds."""
    thread.join(max(timeout, 0.0))
    return not thread.is_alive()


def _piece(data: bytes) -> tuple[bytes, bytes]:
    """A stretch of stderr this long without a newline (a progress bar redrawn in place): what
    to relay of it now, and what to hold for the line's end, that is a record from its mark
    on (the relay reads it whole) or a mark's start, cut in two by the read."""
    at = data.rfind(_MARK)
    if at > 0:
        return data[:at], data[at:]
    if at < 0:
        at = data.rfind(_MARK[:1], max(0, len(data) - len(_MARK) + 1))
        if at > 0 and _MARK.startswith(data[at:]):
            return data[:at], data[at:]
    return data, b""  # (a mark at its start: longer than any record, so plain output)


def _whole(data: bytes) -> int:
    """Where ``data``'s last whole UTF-8 character ends: before a sequence its last bytes
    begin but do not end (decoded apart, each half became U+FFFD)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return len(data)
        if byte >= 0xC0:  # a sequence's first byte: 2, 3 or 4 long
            length = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) - back if length > back else len(data)
    return len(data)  # no sequence's start in sight: not UTF-8, replaced as it is


def _emit(worker: WorkerProcess, is_err: bool, lines: list[str],
          cut: Callable[[], bool]) -> list[str]:
    """Keep stderr's tail, and write the lines to whatever sys.stdout/sys.stderr is now.
    Whatever the user put there (None, no flush(), a write that raises), the relay goes on:
    if it stopped, a worker that fills its pipe would block for ever. The lines left undone
    where ``cut()`` turns true on the way (stop() gave up on the relay)."""
    if is_err:
        if any(_logs.MARK in line for line in lines):
            lines, tail, left = _relay_records(worker.rank, lines, cut)  # to our logging
            worker.keep_tail(tail)
            if left:
                return lines + left
        else:
            worker.keep_tail(lines)
        if not lines:
            return []
    out = sys.stderr if is_err else sys.stdout
    if out is None:
        return []
    if cut():
        return lines
    text = "".join(f"[worker {worker.rank}] {line}\n" for line in lines)
    try:
        try:
            out.write(text)
        except UnicodeEncodeError:  # a character our stream cannot take (an ASCII console):
            # escaped, as Python's own stderr does, so the lines read with it are not lost
            enc = getattr(out, "encoding", None) or "ascii"
            out.write(text.encode(enc, "backslashreplace").decode(enc))
        flush = getattr(out, "flush", None)
        if flush is not None:
            flush()
    except Exception:  # a user's stream may raise anything: keep relaying
        pass
    return []


def _relay_records(rank: int, lines: list[str],
                   cut: Callable[[], bool]) -> tuple[list[str], list[str], list[str]]:
    """Hand the workers' logging records among ``lines`` to our logging (unison.debug.logs).
    The lines still to print (the others), and those to keep in the tail for WorkerDied
    (each record as "LEVEL:name:message"). A record's mark may come after text on its line:
    a partial line the worker left before it logged (a progress bar's "\\r 33%|###"), which is
    plain output (a record's JSON never holds the mark: json escapes control characters).
    Last, the lines not looked at, where ``cut()`` turned true."""
    plain: list[str] = []
    tail: list[str] = []
    for i, line in enumerate(lines):
        at = line.rfind(_logs.MARK)
        if at >= 0:
            if cut():
                return plain, tail, lines[i:]
            try:
                kept = _logs.relay(rank, line[at:])
            except Exception:  # a user's handler may raise anything: keep relaying
                kept = line[at + len(_logs.MARK):]
            if kept is not None:
                if at:
                    plain.append(line[:at])
                    tail.append(line[:at])
                tail.extend(kept.split("\n"))
                continue
        plain.append(line)
        tail.append(line)
    return plain, tail, []
