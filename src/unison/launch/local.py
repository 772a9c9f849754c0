"""Local worker processes: start, watch, relay their output, stop.

    controller                                   worker process (fresh interpreter)
    Popen([python, -c, bootstrap]) ------------> reads its init (rank, channel spec, sys.path)
      stdin  (init, then held open) -----------> lifeline: EOF means the controller is gone
      stdout/stderr  <------------------------- "[worker r] line" relayed by one thread
      pidfd (readable once it exits)            own process group, so a terminal's Ctrl-C
                                                reaches the controller alone

Workers never fork from the controller and never import its ``__main__``: a plain script
without an ``if __name__ == "__main__":`` guard works. Each worker leads a process group of
its own, so stopping it also stops whatever it started.
"""

from __future__ import annotations

import collections
import os
import pickle
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

import unison

_BOOTSTRAP = "from unison.worker import main; main()"
_TAIL_LINES = 20
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


class WorkerProcess:
    """One local worker: its process, pidfd, lifeline and the tail of what it printed."""

    def __init__(self, rank: int, popen: subprocess.Popen[bytes]) -> None:
        self.rank = rank
        self.popen = popen
        self.pid = popen.pid
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.output_done = threading.Event()
        self._open_streams = 2
        try:
            self.pidfd: int | None = os.pidfd_open(popen.pid)
        except (AttributeError, OSError):
            self.pidfd = None

    def exitcode(self) -> int | None:
        return self.popen.poll()

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the worker and everything in its process group."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.kill()
        except OSError:
            pass

    def output(self) -> str:
        """The last lines it wrote to stderr, once its streams are drained (briefly waited for)."""
        self.output_done.wait(0.5)
        return "".join(self.stderr_tail)

    def release(self) -> None:
        if self.popen.stdin is not None:
            try:
                self.popen.stdin.close()
            except OSError:
                pass
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class LocalLauncher:
    """Starts workers as fresh local interpreters and relays their output, prefixed by rank."""

    def __init__(self) -> None:
        self.workers: list[WorkerProcess] = []
        self.stopped = False
        self._relay: threading.Thread | None = None
        self._selector = selectors.DefaultSelector()

    def start(
        self,
        inits: Sequence[dict[str, Any]],
        fds: Sequence[Sequence[int]],
        env: Mapping[int, Mapping[str, str]] | None = None,
    ) -> list[WorkerProcess]:
        """Start one worker per init dict; ``fds[r]`` are inherited by worker ``r``."""
        base_env = dict(os.environ)
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(unison.__file__)))
        base_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (pkg_root, base_env.get("PYTHONPATH", "")) if p
        )
        base_env["PYTHONUNBUFFERED"] = "1"
        # N workers each running a BLAS or OpenMP pool as wide as the machine would fight
        # over the cores (and their spinning threads over our waits): share them out, as
        # loky and torchrun do, unless the user chose already.
        share = str(max(1, len(os.sched_getaffinity(0)) // max(1, len(inits))))
        for var in _THREAD_VARS:
            base_env.setdefault(var, share)
        try:
            for rank, init in enumerate(inits):
                worker_env = dict(base_env)
                if env and rank in env:
                    worker_env.update({str(k): str(v) for k, v in env[rank].items()})
                popen = subprocess.Popen(
                    [sys.executable, "-c", _BOOTSTRAP],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=tuple(fds[rank]),
                    env=worker_env,
                    start_new_session=True,
                )
                worker = WorkerProcess(rank, popen)
                self.workers.append(worker)
                blob = pickle.dumps(init, protocol=5)
                assert popen.stdin is not None
                popen.stdin.write(len(blob).to_bytes(8, "little") + blob)
                popen.stdin.flush()
                for stream, is_err in ((popen.stdout, False), (popen.stderr, True)):
                    assert stream is not None
                    os.set_blocking(stream.fileno(), False)
                    self._selector.register(stream, selectors.EVENT_READ, (worker, is_err, []))
        except BaseException:
            self.stop(grace=0)
            raise
        self._relay = threading.Thread(target=self._relay_output, name="unison-output", daemon=True)
        self._relay.start()
        return self.workers

    def _relay_output(self) -> None:
        """Copy every worker's output to ours, line by line, each line prefixed by its rank."""
        try:
            while self._selector.get_map():
                self._relay_once()
        except (OSError, ValueError, RuntimeError):
            pass  # the selector was closed under us at stop(): nothing is left to relay

    def _relay_once(self) -> None:
        for key, _ in self._selector.select(timeout=1.0):
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
                    continue
                data = b"".join(partial)
                head, _, rest = data.rpartition(b"\n")
                partial[:] = [rest] if rest else []
                _emit(worker, is_err, head.decode(errors="replace").split("\n"))
                continue
            if partial:
                _emit(worker, is_err, b"".join(partial).decode(errors="replace").split("\n"))
            self._selector.unregister(stream)
            worker._open_streams -= 1
            if worker._open_streams == 0:
                worker.output_done.set()

    def stop(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for the workers to exit, then kill what is left.
        Idempotent; only the first call does anything."""
        if self.stopped:
            return
        self.stopped = True
        deadline = time.monotonic() + max(grace, 0.0)
        for w in self.workers:
            if w.wait_exit(max(deadline - time.monotonic(), 0.0)) is None:
                w.kill()
        for w in self.workers:
            w.kill()  # also reaps anything the worker left behind in its process group
            w.popen.wait()
        if self._relay is not None and self._relay is not threading.current_thread():
            self._relay.join(timeout=2.0)
        for w in self.workers:
            w.release()
            for stream in (w.popen.stdout, w.popen.stderr):
                if stream is not None:
                    try:
                        self._selector.unregister(stream)
                    except (KeyError, ValueError):
                        pass
                    stream.close()
        self._selector.close()


def _emit(worker: WorkerProcess, is_err: bool, lines: list[str]) -> None:
    if is_err:
        worker.stderr_tail.extend(line + "\n" for line in lines)
    out = sys.stderr if is_err else sys.stdout
    if out is None:
        return
    text = "".join(f"[worker {worker.rank}] {line}\n" for line in lines)
    try:
        out.write(text)
        out.flush()
    except (OSError, ValueError):
        pass
