"""``mpi4py`` (only when ``mpi4py`` is importable): N processes from ``MPI.COMM_SELF.Spawn``;
commands by ``bcast`` over the intercommunicator, replies by ``gather``. Commands are pickled
with cloudpickle (mpi4py's documented way to send functions of the script), since the spawned
workers never run the controller's ``__main__``."""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.systems.base import STOP, CommandSystem, execute, worker_setup

_BENCHMARKS = str(Path(__file__).resolve().parents[2])
_BOOT = (f"import sys; sys.path.insert(0, {_BENCHMARKS!r}); "
         "from harness.systems.mpi import worker; worker()")
_PID = -1
"""A command only this baseline sends: reply the worker's pid."""

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}
"""What Open MPI needs here: these machines run as root, with fewer cores than ranks."""


def worker() -> None:
    worker_setup()
    mpi = importlib.import_module("mpi4py.MPI")
    parent = mpi.Comm.Get_parent()
    try:
        while True:
            op, obj, args = parent.bcast(None, root=0)
            if op == STOP:
                return
            reply = os.getpid() if op == _PID else execute(op, obj, args)
            parent.gather(reply, root=0)
            del reply
    finally:
        parent.Disconnect()


class MpiSystem(CommandSystem):
    name = "mpi4py"
    description = "N processes from MPI.COMM_SELF.Spawn; bcast commands, gather replies"

    def __init__(self) -> None:
        self._mpi: Any = None
        self._comm: Any = None
        self._pids: list[int] = []

    def start(self, n: int) -> None:
        os.environ.update(MPI_ENV)  # before MPI starts: root, and more ranks than cores
        self._mpi = importlib.import_module("mpi4py.MPI")
        cloudpickle = importlib.import_module("cloudpickle")
        self._mpi.pickle.__init__(cloudpickle.dumps, pickle.loads)
        self._comm = self._mpi.COMM_SELF.Spawn(sys.executable, args=["-c", _BOOT], maxprocs=n)
        self._pids = self.roundtrip(_PID)  # to kill them, should close be abrupt

    def roundtrip(self, op: int, obj: Any = None, args: Sequence[Any] = ()) -> list[Any]:
        root = self._mpi.ROOT
        self._comm.bcast((op, obj, args), root=root)
        return list(self._comm.gather(None, root=root))

    def worker_pids(self) -> list[int]:
        return list(self._pids)

    def close(self, graceful: bool = True) -> None:
        if self._comm is None:
            return
        if graceful:
            self._comm.bcast((STOP, None, ()), root=self._mpi.ROOT)
            self._comm.Disconnect()  # collective: only when the workers take part
        else:
            for pid in self._pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._comm, self._pids = None, []
