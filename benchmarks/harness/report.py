"""The results as text: the markdown table and ratios printed after a run, the docs section
that ``--out`` rewrites, the latency plot, and a description of the machine and code."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from harness.measure import HOGS, Cell
from harness.systems import describe

START_MARK = "<!-- bench:start -->"
END_MARK = "<!-- bench:end -->"

ROWS: dict[str, tuple[str, str]] = {
    "dispatch": ("dispatch", "µs, median / p99"),
    "dispatch_script_fn": ("dispatch_script_fn", "µs, median / p99"),
    "gather_small": ("gather_small", "µs, median / p99"),
    "put_1MiB": ("put 1 MiB", "GB/s per worker"),
    "put_64MiB": ("put 64 MiB", "GB/s per worker"),
    "fetch": ("fetch", "GB/s per worker"),
    "fetch_time": ("fetch", "ms, median / p99"),
    "fetch_memory": ("fetch", "controller's peak extra memory, x the result"),
    "start": ("start", "ms"),
    "close": ("close", "ms"),
    "idle": ("idle", "% of a core per worker"),
    "dispatch_hogs": (f"dispatch with {HOGS} CPU hogs", "µs, median / p99"),
}
"""Every row of the table, in order: metric -> (label, unit)."""

LATENCY = ("dispatch", "dispatch_script_fn", "gather_small")
PIPE_RATIO_METRICS = (*LATENCY, "dispatch_hogs")
"""The rows read against the pipe baseline (issue 9: never slower, CPU hogs or not)."""
SCRIPT_TARGET = 1.3
"""Issue 7: a script's function with two arguments within 1.3x of a module function."""
FLOOR = "floor"
FLOOR_METRICS = ("dispatch", "gather_small", "start")
FLOOR_TARGET = 1.3
"""Issue 9: unison's dispatch and gather_small at most 1.3x the floor system's, and its
start at most 1.3x the bare system's (N interpreters importing numpy), same run."""
_FLOOR_OF = {"start": "bare"}


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


def _label(metric: str, cells: Sequence[Cell]) -> str:
    label, unit = ROWS[metric]
    if metric.startswith("fetch"):
        sizes = {c.extra["bytes"] for c in cells if c.metric == "fetch" and "bytes" in c.extra}
        if len(sizes) == 1:
            label += f" {sizes.pop() / (1 << 20):g} MiB"
    return f"{label} ({unit})"


def render_table(cells: Sequence[Cell], systems: Sequence[str], workers: Sequence[int]) -> str:
    """The results as a markdown table: rows are workload and N, columns the systems."""
    at = _index(cells)
    metrics = [m for m in ROWS if any(c.metric == m for c in cells)]
    lines = [
        "| workload | N | " + " | ".join(systems) + " |",
        "|---|--:|" + "--:|" * len(systems),
    ]
    for metric in metrics:
        label = _label(metric, cells)
        for n in workers:
            row = [label, str(n)] + [_show(at.get((s, metric, n))) for s in systems]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _ratio(at: dict[tuple[str, str, int], Cell], top: tuple[str, str, int],
           bottom: tuple[str, str, int]) -> float | None:
    a, b = at.get(top), at.get(bottom)
    if a is None or b is None or not (a.ok and b.ok) or not b.value:
        return None
    assert a.value is not None
    return a.value / b.value


def ratios(cells: Sequence[Cell], systems: Sequence[str], workers: Sequence[int]
           ) -> dict[tuple[str, str, int], float]:
    """(unison system, metric, N) -> the pipe baseline's median / that system's median."""
    at = _index(cells)
    out = {}
    for s in (s for s in systems if s.startswith("unison")):
        for metric in PIPE_RATIO_METRICS:
            for n in workers:
                r = _ratio(at, ("pipe", metric, n), (s, metric, n))
                if r is not None:
                    out[(s, metric, n)] = r
    return out


def render_ratios(cells: Sequence[Cell], systems: Sequence[str], workers: Sequence[int]) -> str:
    """Markdown: how many times faster than the pipe baseline each unison system is."""
    r = ratios(cells, systems, workers)
    cols = sorted({(s, m) for s, m, _ in r},
                  key=lambda k: (PIPE_RATIO_METRICS.index(k[1]), k[0]))
    return _ratio_table(r, cols, workers)


def floor_ratios(cells: Sequence[Cell], systems: Sequence[str], workers: Sequence[int]
                 ) -> dict[tuple[str, str, int], float]:
    """(unison system, metric, N) -> that system's median / the floor system's median."""
    at = _index(cells)
    out = {}
    for s in (s for s in systems if s.startswith("unison")):
        for metric in FLOOR_METRICS:
            for n in workers:
                r = _ratio(at, (s, metric, n), (_FLOOR_OF.get(metric, FLOOR), metric, n))
                if r is not None:
                    out[(s, metric, n)] = r
    return out


def render_floor_ratios(cells: Sequence[Cell], systems: Sequence[str],
                        workers: Sequence[int]) -> str:
    """Markdown: unison / floor, the median ratio per workload and N."""
    r = floor_ratios(cells, systems, workers)
    cols = sorted({(s, m) for s, m, _ in r}, key=lambda k: (FLOOR_METRICS.index(k[1]), k[0]))
    return _ratio_table(r, cols, workers)


def _ratio_table(r: dict[tuple[str, str, int], float], cols: Sequence[tuple[str, str]],
                 workers: Sequence[int]) -> str:
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


def script_ratios(cells: Sequence[Cell], systems: Sequence[str], workers: Sequence[int]
                  ) -> dict[tuple[str, int], float]:
    """(system, N) -> median of dispatch_script_fn / median of dispatch, same run."""
    at = _index(cells)
    out = {}
    for s in systems:
        for n in workers:
            r = _ratio(at, (s, "dispatch_script_fn", n), (s, "dispatch", n))
            if r is not None:
                out[(s, n)] = r
    return out


def render_script_ratios(cells: Sequence[Cell], systems: Sequence[str],
                         workers: Sequence[int]) -> str:
    """Markdown: the cost of a script's function with arguments over a module function."""
    r = script_ratios(cells, systems, workers)
    cols = [s for s in systems if any((s, n) in r for n in workers)]
    if not cols:
        return ""
    lines = ["| N | " + " | ".join(cols) + " |", "|--:|" + "--:|" * len(cols)]
    for n in workers:
        row = [f"{r[(s, n)]:.2f}x" if (s, n) in r else "-" for s in cols]
        lines.append(f"| {n} | " + " | ".join(row) + " |")
    return "\n".join(lines)


SCRIPT_RATIO_TITLE = (
    "A function of the script with two arguments against a module function without any "
    f"(dispatch_script_fn / dispatch, medians of the same run; target for unison: at most "
    f"{SCRIPT_TARGET}x):"
)
FLOOR_RATIO_TITLE = (
    "unison / floor: unison's median latency divided by the floor system's (the smallest "
    "pure-Python ring doing the same round trip; for start, the bare system's N interpreters "
    f"importing numpy and cloudpickle), same run; target: at most {FLOOR_TARGET}x:"
)
PIPE_RATIO_TITLE = (
    "Speed-up over the pipe baseline (its median latency divided by unison's; above 1 means "
    "unison is faster):"
)


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


def cpu_ticks() -> list[int] | None:
    """The host's CPU time so far, by kind (/proc/stat's first line), or None where that is
    unavailable: two readings make ``steal``."""
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def steal(before: list[int] | None, after: list[int] | None) -> str:
    """The share of CPU time between two ``cpu_ticks`` that the hypervisor gave to other
    guests ("steal"), as text. On a shared VM it comes and goes by the minute (0.5% to 21%
    on the same host within an hour, issue 9's seventeenth pass), and every figure of the
    run swings with it, the floor's included."""
    if before is None or after is None or len(before) < 8 or len(after) < 8:
        return "unknown"
    spent = [b - a for a, b in zip(before, after)]
    total = sum(spent[:8])  # guest time is counted inside user time already
    return f"{100 * spent[7] / total:.1f}%" if total > 0 else "unknown"


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo says ("unknown" elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, str]:
    model = cpu_model()
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


def source_at(rev: str, path: str) -> str:
    """File ``path`` of this checkout as it was at git revision ``rev`` (ab_worker.py and
    ab_controller.py load a base revision's code from it)."""
    repo = Path(__file__).resolve().parents[2]
    return subprocess.run(["git", "-C", str(repo), "show", f"{rev}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def command_line(argv: Sequence[str]) -> str:
    """How this run was started, as a shell command someone can copy."""
    script = sys.argv[0] if sys.argv else ""
    prog = "python benchmarks/run.py"
    if script.endswith(".py"):
        try:
            prog = "python " + os.path.relpath(script)
        except ValueError:
            prog = "python " + script
    return " ".join([prog, *map(shlex.quote, argv)])


def header(argv: Sequence[str]) -> str:
    """A benchmark's first line: the CPU, the code's revision and the command that ran."""
    return f"CPU: {cpu_model()}; {source_revision()}; command: {command_line(argv)}"


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
        f"- CPU time stolen by the hypervisor during the run: {machine.get('steal', 'unknown')}",
        f"- Code: {machine['revision']}",
    ]
    out += [f"- `{s}`: {describe(s)}" for s in systems]
    if quick:
        out.append("- **--quick run**: few samples, for a smoke test, not for comparison.")
    out += ["", render_table(cells, systems, workers), ""]
    for title, table in ((FLOOR_RATIO_TITLE, render_floor_ratios(cells, systems, workers)),
                         (PIPE_RATIO_TITLE, render_ratios(cells, systems, workers)),
                         (SCRIPT_RATIO_TITLE, render_script_ratios(cells, systems, workers))):
        if table:
            out += [title, "", table, ""]
    if plot:
        out += [f"![dispatch, dispatch_script_fn and gather_small latency against N]({plot})", ""]
    errors = [c for c in cells if c.error]
    if errors:
        out.append("Errors:")
        out += [f"- {c.system} N={c.n} {c.metric}: {c.error}" for c in errors]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


_INTRO = """\
# Benchmarks

`benchmarks/run.py` measures unison against the plain ways to drive N local worker processes
from Python; see the top of that file and `python benchmarks/run.py --help`.

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
    metrics = [m for m in LATENCY if any(c.metric == m for c in cells)]
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


def print_block_ratios(medians: dict[str, list[float]], base: str, against: str) -> None:
    """One row per op of ``block_medians``: its block medians, their median (µs) and its
    ratio to op ``base``'s, said as "{ratio}x {against}" (result_shapes.py, ref_args.py)."""
    width = max(len(name) for name in medians)
    base_median = statistics.median(medians[base])
    for name, got in medians.items():
        med = statistics.median(got)
        print(f"{name:{width}}: {' '.join(f'{m:.1f}' for m in got)} | median {med:.1f} µs | "
              f"{med / base_median:.2f}x {against}")


def blocks_args(doc: str | None, blocks: int) -> argparse.Namespace:
    """The options of a script that times ops in turns in one session (``--workers``,
    ``--blocks``, ``--seconds``, ``--channel``), parsed; the run's header line printed."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--blocks", type=int, default=blocks)
    p.add_argument("--seconds", type=float, default=0.3)
    p.add_argument("--channel", default="auto")
    args = p.parse_args()
    print(f"CPU: {cpu_model()}; {source_revision()}; command: {command_line(sys.argv[1:])}")
    return args
