"""The dispatch round trip to N workers: unison over TCP (workers as Ray actors that join
over TCP, ``Session(n, launcher=RayLauncher(...), channel="tcp")``; and, without Ray, plain
local processes that join over loopback), unison with Ray actors on the driver's node as
they run by default (joined over the Unix socket, on shared memory), and over shared memory
(``Session(n)``), against Ray actor calls and Ray Compiled Graphs, all in one run on a
local ``ray.init``.

    python benchmarks/cluster_bench.py --quick           # about a minute
    python benchmarks/cluster_bench.py --workers 2 4 --seconds 5
    python benchmarks/cluster_bench.py --systems tcp-plain --json out.json  # compare_revs --tcp

Each figure times one call that every worker runs and answers (a function returning None):
``sess.run(noop)`` for unison; ``ray.get([a.noop.remote() for a in actors])`` for actor
calls; ``ray.get(compiled.execute(0))`` for a compiled ``MultiOutputNode`` over the actors'
``noop``. Median and 99th percentile in microseconds; the ratios are each Ray figure over
unison TCP's, median against median (higher: unison faster). Systems run one at a time,
each with its own workers, the others torn down. ``floor`` is the smallest pure-Python
shared-memory round trip on this machine (``../shared/probes/ring.py``), where present.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

try:
    import unison
except ImportError:  # a checkout without unison installed: use its src/ directly
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import unison

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.report import cpu_model, source_revision
from unison.launch import SECRET_VAR
from unison.launch.connect import ConnectLauncher

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT.parent / "shared" / "probes" / "ring.py"
SYSTEMS = ("unison TCP (Ray actors)", "unison TCP (plain processes)",
           "unison shm (Ray actors)", "unison shm (local)", "Ray actor calls",
           "Ray Compiled Graphs", "floor (probe ring)")
KEYS = ("tcp", "tcp-plain", "ray-shm", "shm", "actors", "cg", "floor")
LOCAL = frozenset({"tcp-plain", "shm", "floor"})
"""The systems that run without Ray."""


def noop() -> None:
    """The call every worker runs."""
    return None


class Noop:
    """The Ray actor of the Ray baselines."""

    def noop(self, _x: object = None) -> None:
        return None


def time_calls(op: Callable[[], object], seconds: float, warmup: int) -> list[float]:
    """Run ``op`` ``warmup`` times, then for ``seconds``: each call's time in µs."""
    for _ in range(warmup):
        op()
    samples: list[float] = []
    gc.collect()
    gc.disable()
    try:
        end = time.perf_counter() + seconds
        clock = time.perf_counter_ns
        while True:
            t0 = clock()
            op()
            samples.append((clock() - t0) / 1000)
            if time.perf_counter() > end and len(samples) >= 50:
                break
    finally:
        gc.enable()
    return samples


def summary(samples: Sequence[float]) -> tuple[float, float]:
    """(median, p99) of the samples."""
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return statistics.median(ordered), p99


@contextlib.contextmanager
def unison_tcp(n: int) -> Iterator[Callable[[], object]]:
    from unison.launch.ray import RayLauncher

    # channel="tcp": every worker over TCP, even those beside the driver (all of them here)
    with unison.Session(n, launcher=RayLauncher(num_cpus=1), channel="tcp") as sess:
        yield lambda: sess.run(noop)


@contextlib.contextmanager
def unison_ray_shm(n: int) -> Iterator[Callable[[], object]]:
    from unison.launch.ray import RayLauncher

    # the default: Ray actors on the driver's node join over its Unix socket and use shm
    with unison.Session(n, launcher=RayLauncher(num_cpus=1)) as sess:
        yield lambda: sess.run(noop)


@contextlib.contextmanager
def unison_tcp_plain(n: int) -> Iterator[Callable[[], object]]:
    """Workers as plain local processes that join over loopback (``unison worker
    --connect``, as srun or ssh would start them): the TCP channel without Ray."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(address: str, secret: bytes) -> None:
        env = {**os.environ, SECRET_VAR: secret.hex()}
        procs.extend(subprocess.Popen([sys.executable, "-m", "unison", "worker", "--connect",
                                       address], env=env) for _ in range(n))

    try:
        with unison.Session(n, launcher=ConnectLauncher(announce=start)) as sess:
            yield lambda: sess.run(noop)
    finally:
        for p in procs:
            p.wait(10)


@contextlib.contextmanager
def unison_shm(n: int) -> Iterator[Callable[[], object]]:
    with unison.Session(n) as sess:
        yield lambda: sess.run(noop)


def _actors(n: int) -> list[Any]:
    import ray

    cls: Any = ray.remote(Noop)
    actors = [cls.options(num_cpus=1).remote() for _ in range(n)]
    ray.get([a.noop.remote() for a in actors])
    return actors


def _kill(actors: list[Any]) -> None:
    import ray

    for a in actors:
        ray.kill(a)


@contextlib.contextmanager
def ray_actors(n: int) -> Iterator[Callable[[], object]]:
    import ray

    actors = _actors(n)
    try:
        yield lambda: ray.get([a.noop.remote() for a in actors])
    finally:
        _kill(actors)


@contextlib.contextmanager
def compiled_graph(n: int) -> Iterator[Callable[[], object]]:
    import ray
    from ray.dag import InputNode, MultiOutputNode

    actors = _actors(n)
    compiled: Any = None
    try:
        with InputNode() as inp:
            dag: Any = MultiOutputNode([a.noop.bind(inp) for a in actors])
        compiled = dag.experimental_compile()
        yield lambda: ray.get(compiled.execute(0))
    finally:
        if compiled is not None:
            compiled.teardown()
        _kill(actors)


def probe_floor(n: int, seconds: float) -> tuple[float, float] | None:
    """The probe ring's (median, p99) at ``n`` workers, or None where it is absent."""
    if not PROBE.exists():
        return None
    iters = max(1000, int(seconds * 20000))
    cmd = [sys.executable, str(PROBE), "--n", str(n), "--mode", "yield", "--sleeper",
           "eventfd", "--budget-us", "200", "--idle-s", "0", "--iters", str(iters), "--json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
        data = json.loads(out.stdout.strip().splitlines()[-1])
        return float(data["med_us"]), float(data["p99_us"])
    except (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError):
        return None


def _fmt(cell: tuple[float, float] | None) -> str:
    return "n/a" if cell is None else f"{cell[0]:,.0f} / {cell[1]:,.0f}"


def _ratio(top: tuple[float, float] | None, bottom: tuple[float, float] | None) -> str:
    if top is None or bottom is None or bottom[0] <= 0:
        return "n/a"
    return f"{top[0] / bottom[0]:.1f}x"


def render(results: dict[tuple[str, int], tuple[float, float] | None],
           workers: Sequence[int]) -> str:
    head = "| N | " + " | ".join(SYSTEMS) + " | actor / TCP | Compiled Graphs / TCP |"
    lines = [head, "|" + "---|" * (len(SYSTEMS) + 3)]
    for n in workers:
        tcp = results.get(("unison TCP (Ray actors)", n))
        cells = [_fmt(results.get((s, n))) for s in SYSTEMS]
        lines.append(f"| {n} | " + " | ".join(cells) + " | "
                     f"{_ratio(results.get(('Ray actor calls', n)), tcp)} | "
                     f"{_ratio(results.get(('Ray Compiled Graphs', n)), tcp)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    parser.add_argument("--quick", action="store_true", help="1 s per measurement")
    parser.add_argument("--systems", nargs="+", default=list(KEYS), choices=KEYS)
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the figures here: system, N, median and p99 (µs)")
    args = parser.parse_args(argv)
    seconds = 1.0 if args.quick else args.seconds
    warmup = 50 if args.quick else 200

    import ray

    if set(args.systems) - LOCAL:  # else no Ray: its starting daemons would share the cores
        # logical CPUs, so every worker's bundle fits whatever the machine's size
        ray.init(num_cpus=max(args.workers) + 2, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    runs: dict[str, Callable[[int], contextlib.AbstractContextManager[Callable[[], object]]]]
    runs = {"tcp": unison_tcp, "tcp-plain": unison_tcp_plain, "ray-shm": unison_ray_shm,
            "shm": unison_shm,
            "actors": ray_actors, "cg": compiled_graph}
    names = dict(zip(KEYS, SYSTEMS))
    results: dict[tuple[str, int], tuple[float, float] | None] = {}
    try:
        for n in args.workers:
            # Compiled Graphs first: run after the actor calls at N=4 (2026-12-01, a slower
            # host), its first execute timed out in Ray (RAY_CGRAPH_get_timeout, 10 s) four
            # times of four, even with the killed actors reported dead; run first, never
            for key in sorted(args.systems, key=lambda k: k != "cg"):
                name = names[key]
                print(f"measuring {name} at N={n} ...", file=sys.stderr, flush=True)
                try:
                    if key == "floor":
                        results[(name, n)] = probe_floor(n, seconds)
                        continue
                    with runs[key](n) as op:
                        results[(name, n)] = summary(time_calls(op, seconds, warmup))
                except Exception as exc:
                    print(f"  {name} at N={n} failed: {type(exc).__name__}: {exc}",
                          file=sys.stderr, flush=True)
                    results[(name, n)] = None
    finally:
        ray.shutdown()
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    print("Dispatch round trip to N workers, median / p99 in µs (lower is better); ratios: "
          "the Ray figure's median over unison TCP's (higher: unison faster).\n")
    print(render(results, args.workers))
    if args.json is not None:
        args.json.write_text(json.dumps([
            {"system": name, "n": n, "median_us": cell[0], "p99_us": cell[1]}
            for (name, n), cell in results.items() if cell is not None]), encoding="utf-8")
    print(f"\nCPU: {cpu_model()}; Python {platform.python_version()}; ray {ray.__version__}; "
          f"{source_revision()}; {os.cpu_count()} CPUs; {seconds:g} s per measurement")
    print(f"command: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
