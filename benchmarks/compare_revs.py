"""Compare unison at two revisions side by side, in one run:
``python benchmarks/compare_revs.py --base c6a943a --head WORKTREE --workers 2,4``.

    for each repetition r:                      (order flips every repetition, so machine
        for rev in (base, head) or (head, base):  noise and drift hit both alike)
            child: PYTHONPATH=<tree of rev>/src python benchmarks/run.py --systems unison
                   --only dispatch,gather_small,put,fetch --json <file>
                   (``--tcp``: benchmarks/cluster_bench.py --systems tcp-plain, the TCP
                   channel's dispatch with workers as plain processes on loopback)
    table: each metric at each N, the median over repetitions of both, and head / base

A revision other than ``WORKTREE`` (the working tree of this checkout, edits included) is
checked out with ``git worktree add --detach`` under a temporary directory, its C fast paths
built in place (``setup.py build_ext --inplace``), and removed again at the end. Both sides
must run the same ring (C, or pure Python under ``UNISON_PURE=1``), or the run stops: before
2026-12-01 evening a checked-out base ran the pure-Python ring against this checkout's C
one. Both revisions are measured by the same harness, this checkout's
``benchmarks/harness/``, so only the library differs; each child imports unison from its
revision's ``src`` (checked before measuring), and so do its workers, which take the
controller's unison.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness.cli import int_list

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKTREE = "WORKTREE"
WORKLOADS = "dispatch,gather_small,put,fetch"


@dataclass
class Rev:
    """One side of the comparison: what was asked for, and the tree that holds it."""

    label: str
    name: str
    tree: Path
    values: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    units: dict[str, str] = field(default_factory=dict)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/compare_revs.py",
        description="dispatch, gather_small, put and fetch of unison at two revisions, "
                    "alternating per repetition, as one markdown table.",
    )
    p.add_argument("--base", required=True, help="the revision to compare against (git rev)")
    p.add_argument("--head", default=WORKTREE,
                   help=f"a git rev, or {WORKTREE} for this checkout as it is (default)")
    p.add_argument("--workers", type=int_list, default=[2, 4],
                   help="comma-separated worker counts (default 2,4)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each revision (3)")
    p.add_argument("--quick", action="store_true",
                   help="the harness's short loops: a smoke test, not a measurement")
    p.add_argument("--tcp", action="store_true",
                   help="the TCP channel's dispatch instead (cluster_bench.py's tcp-plain, "
                        "3 s a measurement; needs ray)")
    p.add_argument("--fetch-mib", type=int, default=64,
                   help="MiB each worker returns in the fetch workload (default 64)")
    return p.parse_args(argv)


def _log(msg: str) -> None:
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@contextlib.contextmanager
def checkout(label: str, rev: str, scratch: Path) -> Iterator[Rev]:
    """The tree of ``rev``: this checkout for WORKTREE, else a detached git worktree under
    ``scratch``, removed on exit."""
    if rev == WORKTREE:
        yield Rev(label, "working tree", REPO)
        return
    sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    tree = scratch / f"{label}-{sha[:10]}"
    _git("worktree", "add", "--detach", str(tree), sha)
    try:
        build_native(tree)
        yield Rev(label, f"{rev} ({sha[:10]})", tree)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                       check=False, capture_output=True)


def build_native(tree: Path) -> None:
    """Build the revision's C fast paths in place, as README's install does for this checkout:
    a fresh git worktree holds only sources, and without this its unison would run the
    pure-Python ring against this checkout's C one (a comparison of the two rings, not of the
    revisions). A revision from before the C ring has nothing to build; where the build
    fails (no compiler), the revision runs its pure-Python ring, and main() stops unless the
    other side does too."""
    if not (tree / "src" / "unison" / "_ring.c").exists():
        return
    _log(f"building the C fast paths of {tree.name}")
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        _log(f"building {tree.name}'s C fast paths failed: {proc.stderr[-500:]}")


def _env(rev: Rev) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(rev.tree / "src"), env.get("PYTHONPATH", "")) if p
    )
    return env


def check_import(rev: Rev) -> bool:
    """Make sure a child of ``rev`` imports unison from its own tree, not an installed one;
    whether its shm channel runs the C fast paths (else the pure-Python ring)."""
    where, native = subprocess.run(
        [sys.executable, "-c", "import unison, unison.channel.shm as shm; "
         "print(unison.__file__); print(getattr(shm, 'NATIVE', False))"],
        env=_env(rev), capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    if not Path(where).resolve().is_relative_to((rev.tree / "src").resolve()):
        raise SystemExit(f"{rev.name}: unison is imported from {where}, not {rev.tree}/src")
    return native == "True"


def measure(rev: Rev, args: argparse.Namespace, out: Path) -> None:
    """One run of the harness on ``rev``: every metric's median (and p99 of latencies) is
    appended to ``rev.values``."""
    if args.tcp:
        measure_tcp(rev, args, out)
        return
    cmd = [sys.executable, str(HERE / "run.py"), "--systems", "unison", "--only", WORKLOADS,
           "--workers", ",".join(map(str, args.workers)), "--fetch-mib", str(args.fetch_mib),
           "--json", str(out)]
    if args.quick:
        cmd.append("--quick")
    proc = subprocess.run(cmd, env=_env(rev), stdout=subprocess.DEVNULL, check=False)
    if not out.exists():
        raise SystemExit(f"{rev.name}: the harness failed (exit status {proc.returncode})")
    for cell in json.loads(out.read_text(encoding="utf-8"))["results"]:
        if cell["error"] is not None or cell["value"] is None:
            _log(f"{rev.name}: {cell['metric']} at N={cell['n']} failed: {cell['error']}")
            continue
        rows = [(cell["metric"], cell["value"])]
        if cell["unit"] == "us" and cell["p99"] is not None:
            rows.append((f"{cell['metric']} p99", cell["p99"]))
        for metric, value in rows:
            rev.units[metric] = cell["unit"]
            rev.values.setdefault((metric, cell["n"]), []).append(float(value))
    out.unlink()


def measure_tcp(rev: Rev, args: argparse.Namespace, out: Path) -> None:
    """``measure`` for ``--tcp``: cluster_bench's dispatch over TCP to plain processes."""
    cmd = [sys.executable, str(HERE / "cluster_bench.py"), "--systems", "tcp-plain",
           "--workers", *map(str, args.workers), "--json", str(out)]
    if args.quick:
        cmd.append("--quick")
    proc = subprocess.run(cmd, env=_env(rev), stdout=subprocess.DEVNULL, check=False)
    if not out.exists():
        raise SystemExit(f"{rev.name}: cluster_bench failed (exit status {proc.returncode})")
    for cell in json.loads(out.read_text(encoding="utf-8")):
        for metric, value in (("tcp dispatch", cell["median_us"]),
                              ("tcp dispatch p99", cell["p99_us"])):
            rev.units[metric] = "us"
            rev.values.setdefault((metric, cell["n"]), []).append(float(value))
    out.unlink()


LOWER_IS_BETTER = frozenset({"us", "ms", "x"})
"""Units where less is better (latency, time, memory); more is better for the rest (GB/s)."""


def render(base: Rev, head: Rev) -> str:
    """The markdown table: each metric at each N, the median over repetitions of both, in
    the harness's order of metrics."""
    lines = [
        f"| metric | N | base: {base.name} | head: {head.name} | head / base | better |",
        "|---|---:|---:|---:|---:|---|",
    ]
    order: dict[str, int] = {}
    for metric in [*base.units, *head.units]:
        order.setdefault(metric, len(order))
    keys = sorted(base.values.keys() | head.values.keys(), key=lambda k: (order[k[0]], k[1]))
    for metric, n in keys:
        unit = base.units.get(metric) or head.units.get(metric, "")
        b, h = (statistics.median(got) if (got := rev.values.get((metric, n))) else None
                for rev in (base, head))
        ratio = f"{h / b:.2f}" if b and h is not None else "n/a"
        better = "n/a"
        if b and h is not None:
            better = "~" if abs(h / b - 1) < 0.05 else (
                "head" if (h < b) == (unit in LOWER_IS_BETTER) else "base")
        shown = [f"{v:.3g} {unit}" if v is not None else "failed" for v in (b, h)]
        lines.append(f"| {metric} | {n} | {shown[0]} | {shown[1]} | {ratio} | {better} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reps < 1:
        raise SystemExit("--reps must be at least 1")
    scratch = Path(tempfile.mkdtemp(prefix="compare-revs-"))
    try:
        with checkout("base", args.base, scratch) as base, \
                checkout("head", args.head, scratch) as head:
            natives = [check_import(rev) for rev in (base, head)]
            if natives[0] != natives[1]:
                raise SystemExit(
                    "the base runs the shm channel's "
                    f"{'C' if natives[0] else 'pure-Python'} ring and the head the "
                    f"{'C' if natives[1] else 'pure-Python'} one: the comparison would measure "
                    "the rings, not the revisions (build both, or set UNISON_PURE=1 for both)")
            for rep in range(args.reps):
                order = (base, head) if rep % 2 == 0 else (head, base)
                for rev in order:
                    _log(f"repetition {rep + 1}/{args.reps}: {rev.label} = {rev.name}")
                    measure(rev, args, scratch / "cells.json")
            ring = "C" if natives[0] else "pure-Python"
            print(f"unison, {args.reps} repetition(s) of each revision, alternating "
                  f"(median of their medians){'; --quick' if args.quick else ''}; the shm "
                  f"channel's {ring} ring at both. "
                  "Less is better for us, ms and x (memory), more for GB/s; \"better\" "
                  "names the side ahead by 5 % or more.\n")
            print(render(base, head))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        _git("worktree", "prune")
    return 0


if __name__ == "__main__":
    sys.exit(main())
