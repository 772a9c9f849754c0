"""The unison benchmark: unison against the usual ways to drive N local worker processes.

Run it as ``python benchmarks/run.py``, ``unison bench`` or ``python -m unison.bench``
(``--help`` lists the flags). Every system runs the same workloads, one system at a time,
for every number of workers N:

    dispatch      a trivial call to all N workers, then wait until all have run it
                  (unison: ``sess.call(noop); sess.sync()``).
                  Median and p99 latency of one such round, in microseconds.
    gather_small  every worker runs a function whose small result (an int) comes back to the
                  controller (unison: ``sess.run(small_value)``). Median and p99, in µs.
    put           a 1 MiB and a 64 MiB float32 numpy array sent to every worker, waiting until
                  all of them hold it (unison: ``ref = sess.put(a); sess.sync(); ref.free()``).
                  GB/s per worker: the array's bytes / the median time of one put, so the N
                  workers together received N times that.
    start         a fresh session: construct it and complete one dispatch round trip, in ms
                  (median over a few sessions); "close" is the time to close it again.
    idle          the CPU time each worker process uses over 3 s in which nothing is sent,
                  after 1 s of rest (all its threads, from /proc/PID/task/*/schedstat in ns;
                  psutil's cpu_times, in 10 ms ticks, where /proc lacks it); in % of one
                  core, the mean over the workers (the JSON also has the busiest worker).

How it times: ``time.perf_counter_ns`` around each round, after warm-up rounds, with the
garbage collector paused during the timed loop. A loop runs at least ``min`` and at most
``max`` rounds and stops early once its time budget is spent, so slow systems get fewer
(never too few) samples. ``--quick`` shrinks every loop and window (numbers for a smoke
test, not for comparison). Systems run one after another, never at once; for each N every
system is measured before the next N, so slow drift in the machine hits them alike.

The systems: ``unison`` is ``Session(N)`` with its default channel, ``unison-pipe`` is
``Session(N, channel="pipe")``; the baselines (``pipe``, ``mpqueue``, ``manager``, and
``ray``/``mpi4py`` when importable) are described in ``unison._baselines``.

Output: a table on stdout (rows: workload and N, columns: systems) with the ratio of the pipe
baseline's median latency to unison's; ``--out FILE`` rewrites the part of FILE between
``<!-- bench:start -->`` and ``<!-- bench:end -->`` (creating the file if needed),
``--json FILE`` writes every number, ``--plot FILE`` draws latency against N (matplotlib).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import importlib
import inspect
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from unison._baselines import BASELINES, System, available, noop, small_value

__all__ = ["Cell", "Loop", "Plan", "main", "run_benchmark", "update_section"]

START_MARK = "<!-- bench:start -->"
END_MARK = "<!-- bench:end -->"

WORKLOADS = ("dispatch", "gather_small", "put", "start", "idle", "allreduce")
"""What ``--only`` chooses from."""

PUT_SIZES = {"put_1MiB": 1 << 20, "put_64MiB": 64 << 20}

ROWS: dict[str, tuple[str, str]] = {
    "dispatch": ("dispatch", "µs, median / p99"),
    "gather_small": ("gather_small", "µs, median / p99"),
    "put_1MiB": ("put 1 MiB", "GB/s per worker"),
    "put_64MiB": ("put 64 MiB", "GB/s per worker"),
    "start": ("start", "ms"),
    "close": ("close", "ms"),
    "idle": ("idle", "% of a core per worker"),
}
"""Every row of the table, in order: metric -> (label, unit)."""

_METRICS_OF = {
    "dispatch": ("dispatch",),
    "gather_small": ("gather_small",),
    "put": tuple(PUT_SIZES),
    "start": ("start", "close"),
    "idle": ("idle",),
}

SYSTEMS = ("unison", "unison-pipe", *BASELINES)
"""Every system the benchmark knows, in the order of the table's columns."""


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


# -- results -----------------------------------------------------------------------------------


@dataclass
class Cell:
    """One number of the table: a metric of one system at one N."""

    system: str
    metric: str
    n: int
    unit: str
    value: float | None = None
    """The headline: median µs, GB/s per worker, median ms, or mean % of a core."""
    p99: float | None = None
    samples: int = 0
    error: str | None = None
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and self.value is not None


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ascending values, by the nearest-rank method."""
    if not sorted_values:
        raise ValueError("no values")
    k = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(k, len(sorted_values)) - 1]


def latency_cell(system: str, metric: str, n: int, samples_ns: list[int]) -> Cell:
    us = sorted(s / 1e3 for s in samples_ns)
    return Cell(system, metric, n, "us", value=statistics.median(us), p99=percentile(us, 99),
                samples=len(us), extra={"min": us[0], "mean": statistics.fmean(us)})


# -- the unison systems ------------------------------------------------------------------------


class UnisonSystem(System):
    """unison behind the benchmark's interface; ``channel=None`` takes Session's default."""

    def __init__(self, name: str, channel: str | None) -> None:
        self.name = name
        self.channel = channel
        self.description = (
            f'Session(N, channel="{channel}")' if channel
            else f"Session(N), default channel ({default_channel()})"
        )
        self._sess: Any = None

    def start(self, n: int) -> None:
        import unison

        if self.channel is None:
            self._sess = unison.Session(n)
        else:
            self._sess = unison.Session(n, channel=self.channel)

    def dispatch(self) -> None:
        self._sess.call(noop)
        self._sess.sync()

    def gather_small(self) -> list[int]:
        return list(self._sess.run(small_value))

    def put(self, value: Any) -> None:
        ref = self._sess.put(value)
        self._sess.sync()
        ref.free()

    def worker_pids(self) -> list[int]:
        return list(self._sess.run(os.getpid))

    def close(self, graceful: bool = True) -> None:
        if self._sess is not None:
            self._sess.close(timeout=3.0 if graceful else 0)
            self._sess = None


def default_channel() -> str:
    """The channel ``unison.Session(N)`` uses when none is named."""
    import unison

    default = inspect.signature(unison.Session).parameters["channel"].default
    return str(default)


def make_system(name: str) -> System:
    if name == "unison":
        return UnisonSystem("unison", None)
    if name == "unison-pipe":
        return UnisonSystem("unison-pipe", "pipe")
    return BASELINES[name]()


def describe(name: str) -> str:
    return make_system(name).description


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


def _schedstat_cpu(pid: int) -> float:
    """Seconds on a CPU of every thread of ``pid``, from /proc/PID/task/*/schedstat (ns)."""
    total = 0
    tasks = f"/proc/{pid}/task"
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # a thread that just ended
            pass
    return total / 1e9


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


def _check_small(values: list[int], n: int) -> None:
    if len(values) != n or len(set(values)) != n or not all(isinstance(v, int) for v in values):
        raise RuntimeError(f"gather_small returned {values!r}: expected {n} distinct ints")


def bench_system(
    name: str, n: int, workloads: Sequence[str], plan: Plan, arrays: dict[str, Any],
    cells: list[Cell],
) -> None:
    """Measure one system at one N, appending a Cell per metric to ``cells`` as it goes."""
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
        if "dispatch" in workloads:
            add(latency_cell(name, "dispatch", n, time_loop(system.dispatch, plan.latency)))
        if "gather_small" in workloads:
            _check_small(system.gather_small(), n)
            add(latency_cell(name, "gather_small", n,
                             time_loop(system.gather_small, plan.latency)))
        if "put" in workloads:
            for metric, arr in arrays.items():
                loop = plan.put_large if arr.nbytes > (8 << 20) else plan.put_small
                samples = time_loop(functools.partial(system.put, arr), loop)
                median_ns = statistics.median(samples)
                add(Cell(name, metric, n, "GB/s", value=arr.nbytes / median_ns,
                         samples=len(samples),
                         extra={"median_ms": median_ns / 1e6, "max_ms": max(samples) / 1e6}))
        if "idle" in workloads:
            add(measure_idle(system, plan))

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


def run_benchmark(
    systems: Sequence[str], workers: Sequence[int], workloads: Sequence[str], plan: Plan,
    log: Callable[[str], None] = lambda s: None,
) -> list[Cell]:
    """Every system on every N (N outer, systems inner); a failing system gets error cells
    and the run goes on. Ctrl-C stops the run after cleaning up."""
    arrays: dict[str, Any] = {}
    if "put" in workloads:
        import numpy as np

        arrays = {m: np.ones(size // 4, dtype=np.float32) for m, size in PUT_SIZES.items()}
    metrics = [m for w in workloads if w in _METRICS_OF for m in _METRICS_OF[w]]
    cells: list[Cell] = []
    for n in workers:
        for name in systems:
            t0 = time.perf_counter()
            try:
                bench_system(name, n, workloads, plan, arrays, cells)
            except Exception as exc:
                done = {c.metric for c in cells if c.system == name and c.n == n}
                msg = f"{type(exc).__name__}: {exc}"
                log(f"[bench] {name} N={n} failed: {msg}\n{traceback.format_exc()}")
                cells.extend(Cell(name, m, n, "", error=msg) for m in metrics if m not in done)
            log(f"[bench] {name:<12} N={n}  {time.perf_counter() - t0:5.1f} s  "
                + _summary(cells, name, n))
    return cells


def _summary(cells: list[Cell], system: str, n: int) -> str:
    parts = []
    for c in cells:
        if c.system == system and c.n == n and c.ok and c.metric in ("dispatch", "gather_small"):
            parts.append(f"{c.metric} {_num(c.value)} us")
    return ", ".join(parts)


# -- reporting ---------------------------------------------------------------------------------


def _num(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    a = abs(x)
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 0.1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def _show(cell: Cell | None) -> str:
    if cell is None:
        return "-"
    if cell.error is not None:
        return "error"
    if cell.p99 is not None:
        return f"{_num(cell.value)} / {_num(cell.p99)}"
    return _num(cell.value)


def _index(cells: Sequence[Cell]) -> dict[tuple[str, str, int], Cell]:
    return {(c.system, c.metric, c.n): c for c in cells}


def render_table(cells: Sequence[Cell], systems: Sequence[str], workers: Sequence[int]) -> str:
    """The results as a markdown table: rows are workload and N, columns the systems."""
    at = _index(cells)
    metrics = [m for m in ROWS if any(c.metric == m for c in cells)]
    lines = [
        "| workload | N | " + " | ".join(systems) + " |",
        "|---|--:|" + "--:|" * len(systems),
    ]
    for metric in metrics:
        label, unit = ROWS[metric]
        for n in workers:
            row = [f"{label} ({unit})", str(n)]
            row += [_show(at.get((s, metric, n))) for s in systems]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def ratios(cells: Sequence[Cell], systems: Sequence[str], workers: Sequence[int]
           ) -> dict[tuple[str, str, int], float]:
    """(unison system, metric, N) -> the pipe baseline's median / that system's median."""
    at = _index(cells)
    out = {}
    for s in (s for s in systems if s.startswith("unison")):
        for metric in ("dispatch", "gather_small"):
            for n in workers:
                mine, base = at.get((s, metric, n)), at.get(("pipe", metric, n))
                if mine and base and mine.ok and base.ok and mine.value:
                    assert base.value is not None
                    out[(s, metric, n)] = base.value / mine.value
    return out


def render_ratios(cells: Sequence[Cell], systems: Sequence[str], workers: Sequence[int]) -> str:
    """Markdown: how many times faster than the pipe baseline each unison system is."""
    r = ratios(cells, systems, workers)
    cols = sorted({(s, m) for s, m, _ in r}, key=lambda k: (k[1] != "dispatch", k[0]))
    if not cols:
        return ""
    lines = [
        "| N | " + " | ".join(f"{m}: {s}" for s, m in cols) + " |",
        "|--:|" + "--:|" * len(cols),
    ]
    for n in workers:
        row = [f"{r[(s, m, n)]:.2f}x" if (s, m, n) in r else "-" for s, m in cols]
        lines.append(f"| {n} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def host_busy(seconds: float = 0.5) -> float | None:
    """How busy the host's CPUs are right now: % of all CPU time not idle over ``seconds``
    (from /proc/stat), or None where that is unavailable. Unlike the load average, it does not
    remember what ran minutes ago."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return 100 * (total - (idle1 - idle0)) / total if total > 0 else None


def machine_info() -> dict[str, str]:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = str(len(os.sched_getaffinity(0)))
    except AttributeError:
        usable = str(os.cpu_count())
    busy = host_busy()
    return {
        "busy_before": "unknown" if busy is None else f"{busy:.0f}%",
        "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "revision": source_revision(),
        "nproc": usable,
        "cpu": model,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "os": f"{platform.system()} {platform.release()}",
    }


def source_revision() -> str:
    """The git commit of the unison being measured (with "-dirty" for local changes)."""
    import unison

    where = Path(unison.__file__).resolve().parent
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=where,
                             capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return f"unison {unison.__version__}"
    return f"unison {unison.__version__}, git {out.stdout.strip()}"


def command_line(argv: Sequence[str]) -> str:
    """How this run was started, as a shell command someone can copy."""
    main_mod = sys.modules.get("__main__")
    spec = getattr(main_mod, "__spec__", None)
    script = sys.argv[0] if sys.argv else ""
    if spec is not None and spec.name == "unison.bench":
        prog = "python -m unison.bench"
    elif os.path.basename(script) == "unison":
        prog = "unison bench"
    elif script.endswith(".py"):
        try:
            prog = "python " + os.path.relpath(script)
        except ValueError:
            prog = "python " + script
    else:
        prog = "python benchmarks/run.py"
    return " ".join([prog, *map(shlex.quote, argv)])


def render_section(
    cells: Sequence[Cell], systems: Sequence[str], workers: Sequence[int], command: str,
    date: str, machine: dict[str, str], quick: bool, plot: str | None,
) -> str:
    """The text between the markers of docs/benchmarks.md."""
    out = [
        "## Latest results",
        "",
        f"- Command: `{command}`",
        f"- Date: {date}",
        f"- Machine: {machine['nproc']} CPUs ({machine['cpu']}), {machine['python']}, "
        f"{machine['os']}",
        f"- Host before the run: CPUs {machine['busy_before']} busy (0.5 s sample), "
        f"load average {machine['load_before']} (1, 5, 15 min)",
        f"- Code: {machine['revision']}",
    ]
    out += [f"- `{s}`: {describe(s)}" for s in systems]
    if quick:
        out.append("- **--quick run**: few samples, for a smoke test, not for comparison.")
    out += ["", render_table(cells, systems, workers), ""]
    r = render_ratios(cells, systems, workers)
    if r:
        out += [
            "Speed-up over the pipe baseline (its median latency divided by unison's; "
            "above 1 means unison is faster):",
            "",
            r,
            "",
        ]
    if plot:
        out += [f"![dispatch and gather_small latency against N]({plot})", ""]
    errors = [c for c in cells if c.error]
    if errors:
        out.append("Errors:")
        out += [f"- {c.system} N={c.n} {c.metric}: {c.error}" for c in errors]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


_INTRO = """\
# Benchmarks

`benchmarks/run.py` (also `unison bench`) measures unison against the plain ways to drive N
local worker processes from Python: one `multiprocessing.Pipe` per worker (`pipe`),
`multiprocessing.Queue`s (`mpqueue`), and a `multiprocessing.Manager` mailbox like
optimum-tpu's (`manager`); Ray and mpi4py as well when they are installed. All run the same
workloads in the same run, one after another:

- **dispatch**: a trivial call to all N workers, then wait for all of them (unison:
  `sess.call(noop); sess.sync()`); median and p99 µs per round.
- **gather_small**: every worker returns a small int to the controller (unison:
  `sess.run(fn)`); median and p99 µs.
- **put**: a 1 MiB and a 64 MiB float32 array to every worker, waiting until all hold it
  (unison: `ref = sess.put(a); sess.sync(); ref.free()`); GB/s per worker = bytes / time.
- **start / close**: construct a session and finish one round trip; close it (ms, median).
- **idle**: CPU used by each worker process (all its threads) over 3 s without calls, after
  1 s of rest (% of one core, mean over the workers). Read from `/proc/PID/task/*/schedstat`
  (nanoseconds), since psutil's `cpu_times` count 10 ms ticks and cannot tell 0.01% from 0
  over 3 s; psutil where /proc lacks it. For `manager`, the manager server process is not
  counted (it is not a worker).

Timing uses `time.perf_counter_ns` per round after warm-up, with the garbage collector paused;
each loop stops after its time budget (with a minimum number of rounds). The baselines'
workers start with the `spawn` method. Their start time includes what `spawn` itself costs:
re-importing the controller's main script and importing `unison._baselines` (where their
worker code lives) in every worker. See `src/unison/bench.py` and `src/unison/_baselines.py`
for the details, and `python benchmarks/run.py --help` for the flags.

```bash
.venv/bin/python benchmarks/run.py --out docs/benchmarks.md --plot docs/bench_latency.png
```

The section below is rewritten by `--out`; anything outside its markers is kept.

"""


def update_section(path: Path, section: str) -> None:
    """Put ``section`` between the bench markers of ``path``, creating the file (with an
    introduction) if missing, or appending the markers if the file has none."""
    block = f"{START_MARK}\n{section.rstrip()}\n{END_MARK}\n"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_INTRO + block, encoding="utf-8")
        return
    text = path.read_text(encoding="utf-8")
    start, end = text.find(START_MARK), text.find(END_MARK)
    if start != -1 and end > start:
        tail = text[end + len(END_MARK):]
        text = text[:start] + block + tail.removeprefix("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text, encoding="utf-8")


def write_plot(cells: Sequence[Cell], systems: Sequence[str], workers: Sequence[int],
               path: Path, title: str) -> bool:
    """Median (solid) and p99 (dotted) latency against N; False if matplotlib is missing."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        return False
    matplotlib.use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    at = _index(cells)
    metrics = [m for m in ("dispatch", "gather_small") if any(c.metric == m for c in cells)]
    if not metrics:
        return True
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for system in systems:
            ok = [at[(system, metric, n)] for n in workers
                  if (system, metric, n) in at and at[(system, metric, n)].ok]
            if not ok:
                continue
            ns = [c.n for c in ok]
            (line,) = ax.plot(ns, [c.value for c in ok], marker="o", label=system)
            ax.plot(ns, [c.p99 for c in ok], linestyle=":", color=line.get_color(), alpha=0.7)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(list(workers), [str(n) for n in workers])
        ax.set_xlabel("workers (N)")
        ax.set_ylabel("µs per round (median solid, p99 dotted)")
        ax.set_title(metric)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title, fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# -- command line --------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4,8, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers like 1,2,4,8, got {text!r}")
    return values


def _choices(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(bad) or 'empty list'}: choose from {', '.join(allowed)}"
            )
        return values

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="unison bench",
        description="Dispatch, gather, put, start and idle costs of unison and its baselines.",
    )
    p.add_argument("--workers", type=_int_list, default=[1, 2, 4, 8],
                   help="comma-separated worker counts (default 1,2,4,8)")
    p.add_argument("--quick", action="store_true",
                   help="few iterations and short windows: a smoke test, not a measurement")
    p.add_argument("--only", type=_choices(WORKLOADS), default=list(WORKLOADS),
                   help=f"workloads to run (default all: {','.join(WORKLOADS)})")
    p.add_argument("--systems", type=_choices(SYSTEMS), default=None,
                   help=f"systems to run (default every available one of {','.join(SYSTEMS)})")
    p.add_argument("--out", type=Path, help="markdown file whose results section to rewrite")
    p.add_argument("--plot", type=Path, help="PNG of latency against N (needs matplotlib)")
    p.add_argument("--json", type=Path, help="write every number as JSON here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    systems: list[str] = []
    for name in args.systems or SYSTEMS:
        if available(name):
            systems.append(name)
        elif args.systems:
            log(f"[bench] skipping {name}: its package is not importable here")
    workers: list[int] = args.workers
    workloads = [w for w in WORKLOADS if w in args.only]
    per_system = [w for w in workloads if w != "allreduce"]
    plan = QUICK if args.quick else FULL
    log(f"[bench] systems {', '.join(systems)}; N = {', '.join(map(str, workers))}; "
        f"workloads {', '.join(workloads)}{' (quick)' if args.quick else ''}")

    machine = machine_info()  # before the run: it says how quiet the host was
    busy = machine["busy_before"]
    if busy.endswith("%") and float(busy[:-1]) > 20:
        log(f"[bench] warning: the host's CPUs are {busy} busy before the run; "
            "the numbers will be noisy")
    t0 = time.perf_counter()
    try:
        cells = run_benchmark(systems, workers, per_system, plan, log) if per_system else []
        collective_table = ""
        if "allreduce" in workloads and [n for n in workers if n >= 2]:
            from unison import bench_collectives

            log("[bench] allreduce inside the workers: unison against gloo")
            rows = bench_collectives.measure([n for n in workers if 2 <= n <= 4] or
                                             [min(n for n in workers if n >= 2)], args.quick)
            collective_table = bench_collectives.render(rows)
    except KeyboardInterrupt:
        log("[bench] interrupted; everything started was stopped")
        return 130
    log(f"[bench] done in {time.perf_counter() - t0:.1f} s")

    command = command_line(argv)
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    print(render_table(cells, systems, workers))
    r = render_ratios(cells, systems, workers)
    if r:
        print("\nSpeed-up over the pipe baseline (pipe median / unison median):\n")
        print(r)
    if collective_table:
        print("\n" + collective_table)

    plot_ref = None
    if args.plot:
        title = (f"unison bench, {date}: {machine['nproc']} CPUs ({machine['cpu']}), "
                 f"{machine['python']}")
        if write_plot(cells, systems, workers, args.plot, title):
            log(f"[bench] wrote {args.plot}")
            base = args.out.parent if args.out else Path.cwd()
            plot_ref = os.path.relpath(args.plot.resolve(), base.resolve())
        else:
            log("[bench] matplotlib is not installed: skipping --plot "
                "(pip install matplotlib, or the 'bench' extra)")
    if args.out:
        section = render_section(cells, systems, workers, command, date, machine, args.quick,
                                 plot_ref)
        if collective_table:
            section += ("\nAllreduce of float32 between the workers, timed inside them "
                        "(`unison.bench_collectives`; a round counts the slowest worker):\n\n"
                        + collective_table + "\n")
        update_section(args.out, section)
        log(f"[bench] updated {args.out}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "command": command, "date": date, "machine": machine, "quick": args.quick,
            "workers": workers, "workloads": workloads,
            "systems": {s: describe(s) for s in systems},
            "results": [asdict(c) for c in cells],
        }, indent=1) + "\n", encoding="utf-8")
        log(f"[bench] wrote {args.json}")
    return 1 if any(c.error for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
