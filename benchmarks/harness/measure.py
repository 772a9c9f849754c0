"""The measurements: every system runs the same workloads, one system at a time, for every
number of workers N.

    dispatch      a trivial call to all N workers, then wait until all have run it
                  (unison: ``sess.call(noop); sess.sync()``; ``noop`` is a module function).
                  Median and p99 latency of one such round, in microseconds.
    dispatch_script_fn
                  the same with a function of the user's script called with two small
                  arguments (unison: ``sess.call(script_fn, 7, 0.5); sess.sync()``), measured
                  right after ``dispatch`` in the same session. unison and Ray send it by
                  value (cloudpickle); the stdlib baselines by name, which works because their
                  ``spawn`` workers re-import the script.
    gather_small  every worker runs a function whose small result (an int) comes back to the
                  controller (unison: ``sess.run(small_value)``). Median and p99, in µs.
    put           a 1 MiB and a 64 MiB float32 numpy array sent to every worker, waiting until
                  all of them hold it and have read one byte of each of its 4 KiB pages
                  (``tasks.touch``; unison: ``ref = sess.put(a); sess.call(touch, ref);
                  sess.sync(); ref.free()``: one copy in shared memory that each worker maps,
                  its page faults paid by the touch; the pipe, mpqueue and manager workers
                  unpickle a copy of their own, Ray's actors map the object store's copy, and
                  MPI's ranks ``Bcast`` into a fresh array, each touching it before its ack).
                  GB/s per worker: the array's bytes / the median time of one put.
    fetch         every worker holds a 64 MiB float64 array (made there, untimed); the
                  controller fetches all N of them and reads one byte of each 4 KiB page of
                  every array it got (``fetched``; unison: ``ref.gather()``, whose arrays map
                  the workers' shared memory and fault on that first read; the baselines send
                  the array back as their replies, copied into the controller's memory, where
                  the read costs next to nothing). GB/s per worker (bytes / the median
                  time of one fetch), that median time in ms, and the controller's peak extra
                  resident memory during one fetch, as a multiple of the N arrays' bytes (the
                  result itself is 1.0; the fetched arrays are read in full before the peak is
                  taken, so memory that is mapped but never touched still counts).
    start         a fresh session: construct it and complete one dispatch round trip, in ms
                  (median over a few sessions); "close" is the time to close it again.
    idle          the CPU time each worker process uses over 3 s in which nothing is sent,
                  after 1 s of rest (all its threads, from /proc/PID/task/*/schedstat in ns;
                  psutil's cpu_times, in 10 ms ticks, where /proc lacks it); in % of one
                  core, the mean over the workers (the JSON also has the busiest worker).
    dispatch_hogs the dispatch workload on a busy machine: HOGS CPU-bound processes (each
                  ``while True: pass``) run beside the benchmark, started before the warm-up
                  and killed after the timed loop, always (issue 9: unison must never be
                  slower than the Pipe there). Median and p99, in µs.
    allreduce     between the workers, timed inside them: benchmarks/collectives.py.

A system measures only the workloads it offers (``System.workloads``): the ``floor`` system
carries small commands only, so put and fetch are "-" for it. A system whose controller
cannot be this process (``mpi4py``: the controller is rank 0 of an mpiexec job) is measured
by this same ``bench_system`` inside a job of its own (``systems.launcher``), and its cells
join the run's table.

How it times: ``time.perf_counter_ns`` around each round, after warm-up rounds, with the
garbage collector paused during the timed loop. A loop runs at least ``min`` and at most
``max`` rounds and stops early once its time budget is spent, so slow systems get fewer
(never too few) samples. ``--quick`` shrinks every loop and window (numbers for a smoke
test, not for comparison). Systems run one after another, never at once; for each N every
system is measured before the next N, so slow drift in the machine hits them alike.

p99 is the nearest-rank percentile (``percentile``), the one definition every table uses.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import importlib
import math
import os
import random
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.systems import System, launcher, make_system, supports
from harness.tasks import check_block, touch

__all__ = ["FULL", "QUICK", "WORKLOADS", "Cell", "Loop", "Plan", "ScriptCall", "fetched",
           "percentile", "put_arrays", "run_benchmark"]

WORKLOADS = ("dispatch", "dispatch_script_fn", "gather_small", "put", "fetch", "start", "idle",
             "dispatch_hogs", "allreduce")
"""What ``--only`` chooses from."""

PUT_SIZES = {"put_1MiB": 1 << 20, "put_64MiB": 64 << 20}

METRICS_OF = {
    "dispatch": ("dispatch",),
    "dispatch_script_fn": ("dispatch_script_fn",),
    "gather_small": ("gather_small",),
    "put": tuple(PUT_SIZES),
    "fetch": ("fetch", "fetch_time", "fetch_memory"),
    "start": ("start", "close"),
    "idle": ("idle",),
    "dispatch_hogs": ("dispatch_hogs",),
}
"""The metrics (rows of the table) each per-system workload produces."""

ScriptCall = tuple[Callable[..., object], tuple[Any, ...]]
"""The script-defined function of ``dispatch_script_fn`` and its arguments."""


# -- plans -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Loop:
    """How long one timed loop runs: ``warmup`` untimed rounds, then between ``min_iters``
    and ``max_iters`` timed ones, stopping once ``budget_s`` has passed."""

    warmup: int
    min_iters: int
    max_iters: int
    budget_s: float


@dataclass(frozen=True)
class Plan:
    latency: Loop
    put_small: Loop
    put_large: Loop
    start_reps: int
    idle_settle_s: float
    idle_window_s: float


FULL = Plan(
    latency=Loop(warmup=100, min_iters=200, max_iters=5000, budget_s=0.6),
    put_small=Loop(warmup=3, min_iters=10, max_iters=200, budget_s=0.3),
    put_large=Loop(warmup=1, min_iters=3, max_iters=20, budget_s=0.8),
    start_reps=3,
    idle_settle_s=1.0,
    idle_window_s=3.0,
)
QUICK = Plan(
    latency=Loop(warmup=10, min_iters=30, max_iters=300, budget_s=0.1),
    put_small=Loop(warmup=1, min_iters=2, max_iters=20, budget_s=0.05),
    put_large=Loop(warmup=0, min_iters=1, max_iters=2, budget_s=0.05),
    start_reps=1,
    idle_settle_s=0.2,
    idle_window_s=0.5,
)


def _bulk_loop(plan: Plan, nbytes: int) -> Loop:
    """The loop for moving ``nbytes`` (put and fetch alike)."""
    return plan.put_large if nbytes > (8 << 20) else plan.put_small


# -- results -----------------------------------------------------------------------------------


@dataclass
class Cell:
    """One number of the table: a metric of one system at one N."""

    system: str
    metric: str
    n: int
    unit: str
    value: float | None = None
    """The headline: median µs, GB/s per worker, median ms, a ratio or mean % of a core."""
    p99: float | None = None
    samples: int = 0
    error: str | None = None
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and self.value is not None


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ascending values, by the nearest-rank method: the
    smallest value with at least q% of the values at or below it."""
    if not sorted_values:
        raise ValueError("no values")
    k = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(k, len(sorted_values)) - 1]


def interval(mine: list[float], theirs: list[float], draws: int = 2000,
             level: float = 0.9) -> tuple[float, float]:
    """A percentile bootstrap interval of median(mine) / median(theirs), the two lists'
    entries drawn in their pairs (block i of each, measured in the same turn, though not
    always next to each other; a fixed seed: the same entries give the same interval)."""
    pick = random.Random(0).choices
    pairs = range(len(mine))
    ratios = []
    for _ in range(draws):
        drawn = pick(pairs, k=len(mine))
        ratios.append(statistics.median([mine[i] for i in drawn])
                      / statistics.median([theirs[i] for i in drawn]))
    ratios.sort()
    cut = round(draws * (1 - level) / 2)  # int() cut 99.99999999999997 to 99
    return ratios[cut], ratios[draws - 1 - cut]


def tail(rounds: list[int]) -> tuple[float, float]:
    """p99 over the median, and the % of rounds at 3x the median or slower (issue 9's p99
    target is 3x at N=2; the floor's own share says how much of that the host makes)."""
    rounds = sorted(rounds)
    mid = rounds[len(rounds) // 2]
    slow = len(rounds) - bisect.bisect_left(rounds, 3 * mid)
    return percentile(rounds, 99) / mid, 100 * slow / len(rounds)


def latency_cell(system: str, metric: str, n: int, samples_ns: list[int]) -> Cell:
    us = sorted(s / 1e3 for s in samples_ns)
    return Cell(system, metric, n, "us", value=statistics.median(us), p99=percentile(us, 99),
                samples=len(us), extra={"min": us[0], "mean": statistics.fmean(us)})


# -- measuring -----------------------------------------------------------------------------------


def time_loop(op: Callable[[], object], loop: Loop) -> list[int]:
    """Nanoseconds of each timed round of ``op``, per ``loop``."""
    for _ in range(loop.warmup):
        op()
    clock = time.perf_counter_ns
    samples: list[int] = []
    gc.collect()
    gc.disable()
    try:
        deadline = clock() + int(loop.budget_s * 1e9)
        for i in range(loop.max_iters):
            t0 = clock()
            op()
            t1 = clock()
            samples.append(t1 - t0)
            if i + 1 >= loop.min_iters and t1 >= deadline:
                break
    finally:
        gc.enable()
    return samples


def block_medians(ops: Mapping[str, Callable[[], object]], blocks: int,
                  seconds: float) -> dict[str, list[float]]:
    """Each op's median µs a round in ``blocks`` blocks of ``seconds`` each, the ops taking
    turns (their order reversed every other block), after a short block each to warm up:
    the machine's modes then hit every op alike (benchmarks/class_call.py, mixed_sync.py and
    result_shapes.py)."""
    def median_us(op: Callable[[], object], budget: float) -> float:
        rounds = time_loop(op, Loop(warmup=20, min_iters=1, max_iters=10**7, budget_s=budget))
        return statistics.median(rounds) / 1000

    for op in ops.values():
        median_us(op, 0.05)
    medians: dict[str, list[float]] = {name: [] for name in ops}
    turn = list(ops.items())
    for i in range(blocks):
        for name, op in turn if i % 2 == 0 else reversed(turn):
            medians[name].append(median_us(op, seconds))
    return medians


def time_pair(op_a: Callable[[], object], op_b: Callable[[], object], loop: Loop,
              block: int = 50) -> tuple[list[int], list[int]]:
    """Like time_loop for two ops whose ratio is the point: they alternate in blocks of
    ``block`` rounds, so a burst of machine noise hits both alike (each gets the budget)."""
    for _ in range(loop.warmup):
        op_a()
        op_b()
    clock = time.perf_counter_ns
    a: list[int] = []
    b: list[int] = []
    gc.collect()
    gc.disable()
    try:
        deadline = clock() + int(2 * loop.budget_s * 1e9)
        while len(a) < loop.max_iters:
            for op, out in ((op_a, a), (op_b, b)):
                for _ in range(block):
                    t0 = clock()
                    op()
                    out.append(clock() - t0)
            if len(a) >= loop.min_iters and clock() >= deadline:
                break
    finally:
        gc.enable()
    return a, b


def schedstat_tasks(pid: int) -> dict[int, tuple[int, int]]:
    """Per thread of ``pid``: (ns on a CPU, times it was run), from
    /proc/PID/task/*/schedstat."""
    out = {}
    tasks = f"/proc/{pid}/task"
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/schedstat") as f:
                ns, _, runs = map(int, f.read().split()[:3])
        except FileNotFoundError:  # a thread that just ended
            continue
        out[int(tid)] = (ns, runs)
    return out


def _schedstat_cpu(pid: int) -> float:
    """Seconds on a CPU of every thread of ``pid``."""
    return sum(ns for ns, _ in schedstat_tasks(pid).values()) / 1e9


def measure_idle(system: System, plan: Plan) -> Cell:
    """CPU % of one core used by each worker while nothing is sent.

    psutil's cpu_times (user + system) count in clock ticks of 10 ms, so over 3 s they cannot
    tell 0.01% from 0. Where the kernel offers it, the per-thread schedstat (nanoseconds) is
    read instead; psutil otherwise."""
    cell = Cell(system.name, "idle", 0, "%")
    pids = system.worker_pids()
    cpu: Callable[[int], float]
    if os.path.exists(f"/proc/{pids[0]}/task"):
        cpu = _schedstat_cpu
        cell.extra["schedstat"] = 1.0
    else:
        try:
            psutil = importlib.import_module("psutil")
        except ImportError:
            cell.error = "psutil is not installed"
            return cell

        def cpu(pid: int) -> float:
            t = psutil.Process(pid).cpu_times()
            return float(t.user + t.system)

    time.sleep(plan.idle_settle_s)
    t0 = time.perf_counter()
    before = [cpu(pid) for pid in pids]
    time.sleep(plan.idle_window_s)
    after = [cpu(pid) for pid in pids]
    elapsed = time.perf_counter() - t0
    pct = [100 * (a - b) / elapsed for a, b in zip(after, before, strict=True)]
    cell.value = statistics.fmean(pct)
    cell.samples = len(pct)
    cell.extra.update({"max": max(pct), "window_s": elapsed})
    return cell


HOGS = 2
"""CPU-bound processes running beside the ``dispatch_hogs`` workload."""

_HOG = ("import ctypes, os, signal, sys\n"
        "try:\n"
        "    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG: die with us\n"
        "except (OSError, AttributeError):\n"
        "    pass\n"
        "if os.getppid() != int(sys.argv[1]):\n"
        "    sys.exit()\n"
        "while True: pass\n")
"""A hog: ``while True: pass``, which also dies with the benchmark should that be killed."""


@contextlib.contextmanager
def hogs(count: int = HOGS) -> Iterator[list[int]]:
    """``count`` CPU-bound processes running for the block (started, then 0.1 s to reach
    their loop); they are killed after it, always. Gives their pids."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-c", _HOG, str(os.getpid())],
                                          stdin=subprocess.DEVNULL))
        if procs:
            time.sleep(0.1)  # let them start and reach their loop
        yield [proc.pid for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def with_hogs(op: Callable[[], list[int]], count: int = HOGS) -> list[int]:
    """``op()`` with ``count`` CPU-bound processes running (``hogs``)."""
    with hogs(count):
        return op()


def _status_bytes(field_name: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field_name}")


def peak_extra_memory(op: Callable[[], list[Any]], nbytes: int) -> int | None:
    """How far the controller's resident memory rose above its level before ``op()`` (a
    fetch), at its peak while ``op`` ran and its result was read in full (and checked).
    Linux only: the peak is reset through /proc/self/clear_refs; None elsewhere. Meaningful
    for blocks above malloc's mmap threshold (at most 32 MiB), which go back to the system
    when freed; smaller ones may reuse memory the allocator kept, and show less."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base = _status_bytes("VmRSS")
    except OSError:
        return None
    result = op()
    for block in result:
        check_block(block, nbytes)
        float(block.sum())  # touch every page, as a user of the result would
    peak = _status_bytes("VmHWM")
    del result
    return max(0, peak - base)


def _check_small(values: list[int], n: int) -> None:
    if len(values) != n or len(set(values)) != n or not all(isinstance(v, int) for v in values):
        raise RuntimeError(f"gather_small returned {values!r}: expected {n} distinct ints")


def fetched(system: System) -> list[Any]:
    """The fetch workload's timed op: ``system.fetch()``, then one byte of every page of each
    array read (``touch``), so that a system whose arrays map memory lazily (unison's) pays
    its page faults inside the timing, as the others pay their copies."""
    arrays = system.fetch()
    touch(arrays)
    return arrays


def _fetch_cells(system: System, n: int, nbytes: int, plan: Plan) -> list[Cell]:
    """fetch (GB/s per worker), fetch_time (ms) and fetch_memory (x the result)."""
    system.hold(nbytes)
    got = system.fetch()
    if len(got) != n:
        raise RuntimeError(f"fetch returned {len(got)} arrays from {n} workers")
    for block in got:
        check_block(block, nbytes)
    del got
    samples = time_loop(functools.partial(fetched, system), _bulk_loop(plan, nbytes))
    median_ns = statistics.median(samples)
    ms = sorted(s / 1e6 for s in samples)
    common = {"bytes": float(nbytes), "median_ms": median_ns / 1e6, "max_ms": ms[-1]}
    cells = [
        Cell(system.name, "fetch", n, "GB/s", value=nbytes / median_ns, samples=len(samples),
             extra=dict(common)),
        Cell(system.name, "fetch_time", n, "ms", value=median_ns / 1e6, p99=percentile(ms, 99),
             samples=len(samples), extra=dict(common)),
    ]
    extra = peak_extra_memory(system.fetch, nbytes)
    memory = Cell(system.name, "fetch_memory", n, "x", samples=1 if extra is not None else 0)
    if extra is None:
        memory.error = "needs Linux's /proc/self/clear_refs"
    else:
        memory.value = extra / (n * nbytes)
        memory.extra = {"peak_extra_MiB": extra / (1 << 20), "result_MiB": n * nbytes / (1 << 20)}
    return [*cells, memory]


def bench_system(
    name: str, n: int, workloads: Sequence[str], plan: Plan, arrays: dict[str, Any],
    cells: list[Cell], script: ScriptCall | None = None, fetch_bytes: int = 64 << 20,
) -> None:
    """Measure one system at one N, appending a Cell per metric to ``cells`` as it goes."""
    workloads = [w for w in workloads if supports(name, w)]
    if not workloads:
        return
    clock = time.perf_counter_ns
    starts: list[int] = []
    closes: list[int] = []

    def add(cell: Cell) -> None:
        cell.system, cell.n = name, n
        cells.append(cell)

    def session(body: Callable[[System], None] | None) -> None:
        system = make_system(name)
        graceful = False
        try:
            t0 = clock()
            system.start(n)
            system.dispatch()
            starts.append(clock() - t0)
            if body is not None:
                body(system)
            graceful = True
        finally:
            t0 = clock()
            system.close(graceful)
            if graceful:
                closes.append(clock() - t0)

    def workloads_on(system: System) -> None:
        if "dispatch_script_fn" in workloads and script is None:
            raise ValueError("dispatch_script_fn needs the script's function")
        script_op = functools.partial(system.call, *script) if script is not None else None
        if "dispatch" in workloads and "dispatch_script_fn" in workloads:
            assert script_op is not None  # their ratio is the target: measured interleaved
            module, by_script = time_pair(system.dispatch, script_op, plan.latency)
            add(latency_cell(name, "dispatch", n, module))
            add(latency_cell(name, "dispatch_script_fn", n, by_script))
        elif "dispatch" in workloads:
            add(latency_cell(name, "dispatch", n, time_loop(system.dispatch, plan.latency)))
        elif script_op is not None and "dispatch_script_fn" in workloads:
            add(latency_cell(name, "dispatch_script_fn", n, time_loop(script_op, plan.latency)))
        if "gather_small" in workloads:
            _check_small(system.gather_small(), n)
            add(latency_cell(name, "gather_small", n,
                             time_loop(system.gather_small, plan.latency)))
        if "put" in workloads:
            for metric, arr in arrays.items():
                samples = time_loop(functools.partial(system.put, arr),
                                    _bulk_loop(plan, arr.nbytes))
                median_ns = statistics.median(samples)
                add(Cell(name, metric, n, "GB/s", value=arr.nbytes / median_ns,
                         samples=len(samples),
                         extra={"median_ms": median_ns / 1e6, "max_ms": max(samples) / 1e6}))
            system.put(None)  # let the workers drop the last array
        if "fetch" in workloads:
            for cell in _fetch_cells(system, n, fetch_bytes, plan):
                add(cell)
        if "idle" in workloads:
            add(measure_idle(system, plan))
        if "dispatch_hogs" in workloads:
            add(latency_cell(name, "dispatch_hogs", n,
                             with_hogs(lambda: time_loop(system.dispatch, plan.latency))))

    session(workloads_on)
    if "start" in workloads:
        for _ in range(plan.start_reps - 1):
            session(None)
        ms = sorted(s / 1e6 for s in starts)
        add(Cell(name, "start", n, "ms", value=statistics.median(ms), samples=len(ms),
                 extra={"min": ms[0], "max": ms[-1]}))
        ms = sorted(s / 1e6 for s in closes)
        add(Cell(name, "close", n, "ms", value=statistics.median(ms), samples=len(ms),
                 extra={"min": ms[0], "max": ms[-1]}))


def put_arrays(workloads: Sequence[str]) -> dict[str, Any]:
    """The arrays of the put workload, by metric ({} when put is not run)."""
    if "put" not in workloads:
        return {}
    import numpy as np

    return {m: np.ones(size // 4, dtype=np.float32) for m, size in PUT_SIZES.items()}


def run_benchmark(
    systems: Sequence[str], workers: Sequence[int], workloads: Sequence[str], plan: Plan,
    log: Callable[[str], None] = lambda s: None, script: ScriptCall | None = None,
    fetch_bytes: int = 64 << 20,
) -> list[Cell]:
    """Every system on every N (N outer, systems inner); a failing system gets error cells
    and the run goes on. Ctrl-C stops the run after cleaning up."""
    arrays = put_arrays(workloads)
    cells: list[Cell] = []
    for n in workers:
        for name in systems:
            t0 = time.perf_counter()
            try:
                bench = launcher(name) or bench_system
                bench(name, n, workloads, plan, arrays, cells, script, fetch_bytes)
            except Exception as exc:
                done = {c.metric for c in cells if c.system == name and c.n == n}
                msg = f"{type(exc).__name__}: {exc}"
                log(f"[bench] {name} N={n} failed: {msg}\n{traceback.format_exc()}")
                cells.extend(Cell(name, m, n, "", error=msg) for w in workloads
                             if w in METRICS_OF and supports(name, w)
                             for m in METRICS_OF[w] if m not in done)
            log(f"[bench] {name:<12} N={n}  {time.perf_counter() - t0:5.1f} s  "
                + _summary(cells, name, n))
    return cells


def _summary(cells: list[Cell], system: str, n: int) -> str:
    parts = []
    for c in cells:
        if c.system != system or c.n != n or not c.ok:
            continue
        if c.unit == "us":
            parts.append(f"{c.metric} {c.value:.1f} us")
        elif c.metric == "fetch":
            parts.append(f"fetch {c.value:.2f} GB/s")
    return ", ".join(parts)
