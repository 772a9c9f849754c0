"""The systems the benchmark (``unison.bench``) runs side by side, each behind one interface.

Each system starts N local worker processes and offers the benchmark's four operations:

    dispatch()        every worker runs ``noop()``; wait until all have
    gather_small()    every worker runs ``small_value()``; return the N small ints, rank order
    put(array)        every worker receives ``array`` and keeps it; wait until all have it
    worker_pids()     the workers' process ids (for the idle CPU measurement)

The baselines are the plain ways to build this with the standard library, written the way
a careful user would write them, with no tricks that would favour or handicap them:

    pipe      one ``multiprocessing.Pipe`` per worker. The controller pickles each command
              once and writes the bytes to every worker's pipe; each worker runs it and
              writes its reply back; the controller reads the N replies.
    mpqueue   one ``multiprocessing.Queue`` of commands per worker, one shared Queue of
              ``(rank, reply)`` results (``Queue.put`` pickles on its feeder thread, once
              per queue: that is how the class works).
    manager   a mailbox in a ``multiprocessing.Manager`` server, in the style of
              optimum-tpu's root/agent mailbox: the command lives in a ``manager.list``;
              each worker has a "bell" and a "ready" ``manager.Event``; replies go into a
              shared ``manager.list`` (one slot per worker). Every access is a round trip to
              the manager process.
    ray       (only when ``ray`` is importable) one actor per worker; ``ray.get`` on N
              method calls; ``put`` passes one ``ray.put`` object to every actor.
    mpi4py    (only when ``mpi4py`` is importable) N processes from ``MPI.COMM_SELF.Spawn``;
              commands by ``bcast`` over the intercommunicator, replies by ``gather``.

Ray and mpi4py are not installed on the machine this was written on, so those two adapters
have not been run there; the benchmark records an error for a system that fails and goes on.

All multiprocessing workers start with the ``spawn`` method, ignore Ctrl-C (the controller
handles it and stops them) and leave when the controller goes away. ``close()`` stops
everything it started, gracefully when asked, else at once (terminate, then kill).
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import importlib.util
import multiprocessing
import os
import pickle
import queue
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

__all__ = [
    "BASELINES",
    "ManagerSystem",
    "MpQueueSystem",
    "PipeSystem",
    "System",
    "available",
    "noop",
    "small_value",
]

# -- the tasks every system's workers run (module functions: every system pickles them by name)


def noop() -> None:
    """The trivial call of the dispatch workload."""


def small_value() -> int:
    """The small result of the gather_small workload: an int that differs per worker."""
    return os.getpid()


# -- the interface ---------------------------------------------------------------------------


class System(abc.ABC):
    """N workers driven by one controller, as the benchmark sees them."""

    name: str = ""
    description: str = ""

    @abc.abstractmethod
    def start(self, n: int) -> None:
        """Start ``n`` workers; returns once they can take commands (they may still boot)."""

    @abc.abstractmethod
    def dispatch(self) -> None:
        """Every worker runs ``noop()``; return when all have."""

    @abc.abstractmethod
    def gather_small(self) -> list[int]:
        """Every worker runs ``small_value()``; return the results in rank order."""

    @abc.abstractmethod
    def put(self, value: Any) -> None:
        """Every worker receives ``value`` and keeps it (dropping the previous one); return
        when all hold it."""

    @abc.abstractmethod
    def worker_pids(self) -> list[int]:
        """The process id of each worker, in rank order."""

    @abc.abstractmethod
    def close(self, graceful: bool = True) -> None:
        """Stop everything ``start`` started. ``graceful=False``: at once, after an error or
        Ctrl-C. Idempotent."""


# -- worker side, shared by the multiprocessing baselines -------------------------------------

_CALL, _RUN, _PUT, _STOP = range(4)
"""Command kinds: run fn and ack / run fn and reply its result / keep a value and ack / leave."""

_held: list[Any] = [None]  # a worker's put value, kept until the next put


def _execute(op: int, obj: Any) -> Any:
    """Run one command on a worker; return the reply (None for an ack)."""
    if op == _CALL:
        obj()
        return None
    if op == _RUN:
        return obj()
    if op == _PUT:
        _held[0] = obj
        return None
    raise ValueError(f"unknown command {op}")


def _worker_setup() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _spawn() -> Any:
    return multiprocessing.get_context("spawn")


def _stop_processes(procs: list[Any], graceful: bool) -> None:
    """Join the processes (briefly, when graceful), then terminate and kill what is left."""
    for p in procs:
        if graceful:
            p.join(3.0)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _died(procs: list[Any]) -> RuntimeError | None:
    for rank, p in enumerate(procs):
        if p.exitcode is not None:
            return RuntimeError(f"worker {rank} (pid {p.pid}) exited with code {p.exitcode}")
    return None


# -- pipe --------------------------------------------------------------------------------------


def _pipe_worker(conn: Connection) -> None:
    _worker_setup()
    try:
        while True:
            try:
                data = conn.recv_bytes()
            except EOFError:  # the controller is gone
                return
            op, obj = pickle.loads(data)
            del data
            if op == _STOP:
                return
            conn.send_bytes(pickle.dumps(_execute(op, obj), protocol=5))
    finally:
        conn.close()


class _CommandSystem(System):
    """A baseline that sends one command to every worker and collects one reply from each:
    the workloads differ only in the command."""

    _procs: list[Any]

    @abc.abstractmethod
    def _roundtrip(self, op: int, obj: Any) -> list[Any] | None:
        """Send (op, obj) to every worker; return their replies (for _RUN) in rank order."""

    def dispatch(self) -> None:
        self._roundtrip(_CALL, noop)

    def gather_small(self) -> list[int]:
        out = self._roundtrip(_RUN, small_value)
        assert out is not None
        return out

    def put(self, value: Any) -> None:
        self._roundtrip(_PUT, value)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]


class PipeSystem(_CommandSystem):
    name = "pipe"
    description = "one multiprocessing.Pipe per worker; each command pickled once"

    def __init__(self) -> None:
        self._procs: list[Any] = []
        self._conns: list[Connection] = []

    def start(self, n: int) -> None:
        ctx = _spawn()
        for rank in range(n):
            mine, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_pipe_worker, args=(theirs,), daemon=True,
                               name=f"bench-pipe-{rank}")
            self._procs.append(proc)
            self._conns.append(mine)
            proc.start()
            theirs.close()

    def _roundtrip(self, op: int, obj: Any) -> list[Any]:
        data = pickle.dumps((op, obj), protocol=5)
        for conn in self._conns:
            conn.send_bytes(data)
        del data
        out = []
        for conn in self._conns:
            try:
                out.append(pickle.loads(conn.recv_bytes()))
            except EOFError:
                raise _died(self._procs) or RuntimeError("a worker closed its pipe") from None
        return out

    def close(self, graceful: bool = True) -> None:
        if graceful:
            stop = pickle.dumps((_STOP, None))
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(stop)
        _stop_processes(self._procs, graceful)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []


# -- mpqueue -----------------------------------------------------------------------------------


def _queue_worker(rank: int, commands: Any, results: Any) -> None:
    _worker_setup()
    parent = multiprocessing.parent_process()
    while True:
        try:
            op, obj = commands.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return
            continue
        if op == _STOP:
            return
        results.put((rank, _execute(op, obj)))


class MpQueueSystem(_CommandSystem):
    name = "mpqueue"
    description = "a multiprocessing.Queue of commands per worker, one shared Queue of results"

    def __init__(self) -> None:
        self._procs: list[Any] = []
        self._commands: list[Any] = []
        self._results: Any = None

    def start(self, n: int) -> None:
        ctx = _spawn()
        self._results = ctx.Queue()
        for rank in range(n):
            commands = ctx.Queue()
            proc = ctx.Process(target=_queue_worker, args=(rank, commands, self._results),
                               daemon=True, name=f"bench-mpqueue-{rank}")
            self._procs.append(proc)
            self._commands.append(commands)
            proc.start()

    def _roundtrip(self, op: int, obj: Any) -> list[Any]:
        for commands in self._commands:
            commands.put((op, obj))
        out: list[Any] = [None] * len(self._procs)
        for _ in self._procs:
            while True:
                try:
                    rank, reply = self._results.get(timeout=5.0)
                    break
                except queue.Empty:
                    dead = _died(self._procs)
                    if dead is not None:
                        raise dead from None
            out[rank] = reply
        return out

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for commands in self._commands:
                commands.put((_STOP, None))
        _stop_processes(self._procs, graceful)
        # The workers are gone: whatever a feeder thread still holds is of no use.
        for q in [*self._commands, *([self._results] if self._results is not None else [])]:
            q.cancel_join_thread()
            q.close()
        self._procs, self._commands, self._results = [], [], None


# -- manager mailbox ---------------------------------------------------------------------------


def _manager_worker(rank: int, bell: Any, ready: Any, command: Any, outputs: Any) -> None:
    _worker_setup()
    try:
        while True:
            bell.wait()
            bell.clear()
            op, obj = command[:]  # one round trip: a copy of the whole command
            if op == _STOP:
                return
            reply = _execute(op, obj)
            del obj
            if op == _RUN:
                outputs[rank] = reply
            ready.set()
    except (EOFError, ConnectionError):  # the manager (and so the controller) is gone
        return


class ManagerSystem(_CommandSystem):
    name = "manager"
    description = "a Manager mailbox (manager.Event bells + manager.list), like optimum-tpu's"

    def __init__(self) -> None:
        self._manager: Any = None
        self._procs: list[Any] = []
        self._bells: list[Any] = []
        self._ready: list[Any] = []
        self._command: Any = None
        self._outputs: Any = None

    def start(self, n: int) -> None:
        ctx = _spawn()
        self._manager = ctx.Manager()
        self._command = self._manager.list([_CALL, None])
        self._outputs = self._manager.list([None] * n)
        for rank in range(n):
            bell, ready = self._manager.Event(), self._manager.Event()
            proc = ctx.Process(
                target=_manager_worker, args=(rank, bell, ready, self._command, self._outputs),
                daemon=True, name=f"bench-manager-{rank}",
            )
            self._bells.append(bell)
            self._ready.append(ready)
            self._procs.append(proc)
            proc.start()

    def _roundtrip(self, op: int, obj: Any) -> list[Any] | None:
        self._command[:] = [op, obj]
        for bell in self._bells:
            bell.set()
        for ready in self._ready:
            while not ready.wait(5.0):
                dead = _died(self._procs)
                if dead is not None:
                    raise dead
            ready.clear()
        return list(self._outputs[:]) if op == _RUN else None

    def close(self, graceful: bool = True) -> None:
        if graceful and self._manager is not None:
            try:
                self._command[:] = [_STOP, None]
                for bell in self._bells:
                    bell.set()
            except (OSError, EOFError):
                pass
        _stop_processes(self._procs, graceful)
        self._bells, self._ready, self._command, self._outputs = [], [], None, None
        if self._manager is not None:
            self._manager.shutdown()
            self._manager = None
        self._procs = []


# -- ray (optional) ----------------------------------------------------------------------------


class _RayWorker:
    """The actor class behind the ray baseline."""

    def __init__(self) -> None:
        self._held: Any = None

    def call(self, fn: Callable[[], Any]) -> None:
        fn()

    def run(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def hold(self, value: Any) -> None:
        self._held = value

    def pid(self) -> int:
        return os.getpid()


class RaySystem(System):
    name = "ray"
    description = "one Ray actor per worker, ray.get on N method calls (local ray.init)"

    def __init__(self) -> None:
        self._ray: Any = None
        self._actors: list[Any] = []

    def start(self, n: int) -> None:
        ray = importlib.import_module("ray")
        self._ray = ray
        ray.init(num_cpus=max(n, os.cpu_count() or 1), include_dashboard=False,
                 log_to_driver=False)
        actor = ray.remote(num_cpus=0)(_RayWorker)
        self._actors = [actor.remote() for _ in range(n)]

    def dispatch(self) -> None:
        self._ray.get([a.call.remote(noop) for a in self._actors])

    def gather_small(self) -> list[int]:
        return list(self._ray.get([a.run.remote(small_value) for a in self._actors]))

    def put(self, value: Any) -> None:
        obj = self._ray.put(value)
        self._ray.get([a.hold.remote(obj) for a in self._actors])

    def worker_pids(self) -> list[int]:
        return list(self._ray.get([a.pid.remote() for a in self._actors]))

    def close(self, graceful: bool = True) -> None:
        if self._ray is not None:
            self._actors = []
            self._ray.shutdown()
            self._ray = None


# -- mpi4py (optional) -------------------------------------------------------------------------

_MPI_BOOT = "from unison._baselines import _mpi_worker; _mpi_worker()"


def _mpi_worker() -> None:
    _worker_setup()
    mpi = importlib.import_module("mpi4py.MPI")
    parent = mpi.Comm.Get_parent()
    try:
        while True:
            op, obj = parent.bcast(None, root=0)
            if op == _STOP:
                return
            reply = os.getpid() if op == -1 else _execute(op, obj)
            parent.gather(reply, root=0)
    finally:
        parent.Disconnect()


MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
"""What Open MPI needs here: these machines run as root, with fewer cores than ranks."""


class MpiSystem(_CommandSystem):
    name = "mpi4py"
    description = "N processes from MPI.COMM_SELF.Spawn; bcast commands, gather replies"

    def __init__(self) -> None:
        self._mpi: Any = None
        self._comm: Any = None
        self._pids: list[int] = []

    def start(self, n: int) -> None:
        os.environ.update(MPI_ENV)  # before MPI starts: root, and more ranks than cores
        self._mpi = importlib.import_module("mpi4py.MPI")
        self._comm = self._mpi.COMM_SELF.Spawn(sys.executable, args=["-c", _MPI_BOOT],
                                               maxprocs=n)
        self._pids = self._roundtrip(-1, None)  # to kill them, should close be abrupt

    def _roundtrip(self, op: int, obj: Any) -> list[Any]:
        root = self._mpi.ROOT
        self._comm.bcast((op, obj), root=root)
        return list(self._comm.gather(None, root=root))

    def worker_pids(self) -> list[int]:
        return list(self._pids)

    def close(self, graceful: bool = True) -> None:
        if self._comm is None:
            return
        if graceful:
            self._comm.bcast((_STOP, None), root=self._mpi.ROOT)
            self._comm.Disconnect()  # collective: only when the workers take part
        else:
            for pid in self._pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._comm, self._pids = None, []


# -- the catalogue -----------------------------------------------------------------------------

BASELINES: dict[str, type[System]] = {
    "pipe": PipeSystem,
    "mpqueue": MpQueueSystem,
    "manager": ManagerSystem,
    "ray": RaySystem,
    "mpi4py": MpiSystem,
}
"""Every baseline, in the order the benchmark shows them."""

_NEEDS = {"ray": "ray", "mpi4py": "mpi4py"}


def available(name: str) -> bool:
    """Whether the baseline ``name`` can run here (its optional package is importable)."""
    module = _NEEDS.get(name)
    return module is None or importlib.util.find_spec(module) is not None
