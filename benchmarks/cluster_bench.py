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

Rounds (``--rounds``, 3 by default): each N runs every system ``rounds`` times in turn, each
time for ``seconds / rounds`` with fresh workers, and a figure pools its rounds' samples.
So a slow minute of this shared host falls on all systems alike, rather than on whichever
ran then; the ratio cells also give the range of the ratios of the single rounds.
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
from harness.systems.unison_session import UnisonSystem

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

    def pid(self) -> int:
        return os.getpid()


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
    --connect``, as srun or ssh would start them): the TCP channel without Ray, as the
    harness's ``unison-tcp`` system starts it."""
    system = UnisonSystem("unison-tcp", "tcp")
    system.start(n)
    try:
        sess = system.session
        yield lambda: sess.run(noop)
    finally:
        system.close()


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


def _kill(actors: list[Any], timeout: float = 30.0) -> None:
    """Kill the actors and wait until their processes are gone. Compiled Graphs at N=4 run
    right after the actor calls at N=2 timed out in their first execute
    (RAY_CGRAPH_get_timeout, 10 s) on every try (`--workers 2 4 --rounds 1 --systems cg
    actors`); a second's pause after the kill, or this wait, cleared that, but one such
    timeout in 17 Compiled Graphs blocks still came later, so ``measure`` tries twice."""
    import ray

    try:
        pids = ray.get([a.pid.remote() for a in actors], timeout=timeout)
    except Exception:  # an actor already gone: nothing to wait for but the others' kill
        pids = []
    for a in actors:
        ray.kill(a)
    end = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < end:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.02)


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


def measure(run: Callable[[int], contextlib.AbstractContextManager[Callable[[], object]]],
            n: int, seconds: float, warmup: int, what: str) -> list[float] | None:
    """One block of samples with fresh workers; one more try with fresh ones if it fails
    (Ray's Compiled Graphs, now and then, time out in their first execute: see _kill);
    None if both fail, each failure printed."""
    for attempt in (1, 2):
        try:
            with run(n) as op:
                return time_calls(op, seconds, warmup)
        except Exception as exc:
            again = ", trying once more with fresh workers" if attempt == 1 else ""
            print(f"  {what} failed: {type(exc).__name__}: {exc}{again}", file=sys.stderr,
                  flush=True)
    return None


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


def _ratio(top: Sequence[float] | None, bottom: Sequence[float] | None,
           rounds: tuple[list[float], list[float]] | None = None) -> str:
    """Median over median, and the range of the single rounds' ratios where there are
    several rounds with both figures."""
    if not top or not bottom or bottom[0] <= 0:
        return "n/a"
    text = f"{top[0] / bottom[0]:.1f}x"
    if rounds is not None:
        each = [t / b for t, b in zip(*rounds) if b > 0]
        if len(each) > 1:
            text += f" ({min(each):.1f}-{max(each):.1f})"
    return text


def render(results: dict[tuple[str, int], tuple[float, float] | None],
           workers: Sequence[int],
           per_round: dict[tuple[str, int], list[float]] | None = None) -> str:
    head = "| N | " + " | ".join(SYSTEMS) + " | actor / TCP | Compiled Graphs / TCP |"
    lines = [head, "|" + "---|" * (len(SYSTEMS) + 3)]
    per_round = per_round or {}
    for n in workers:
        key = ("unison TCP (Ray actors)", n)
        tcp = results.get(key)
        cells = [_fmt(results.get((s, n))) for s in SYSTEMS]
        ratios = []
        for ray_name in ("Ray actor calls", "Ray Compiled Graphs"):
            pair = None
            if (ray_name, n) in per_round and key in per_round:
                pair = (per_round[(ray_name, n)], per_round[key])
            ratios.append(_ratio(results.get((ray_name, n)), tcp, pair))
        lines.append(f"| {n} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="per system and N, over all rounds")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times each system runs at each N, in turn with the others")
    parser.add_argument("--quick", action="store_true",
                        help="1 s per system and N, over all rounds")
    parser.add_argument("--systems", nargs="+", default=list(KEYS), choices=KEYS)
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the figures here: system, N, median and p99 (µs)")
    args = parser.parse_args(argv)
    seconds = 1.0 if args.quick else args.seconds
    rounds = max(1, args.rounds)
    block = seconds / rounds
    warmup = 50 if args.quick else 200

    ray: Any = None  # not even imported for local systems alone: Ray need not be installed
    if set(args.systems) - LOCAL:  # else no Ray: its starting daemons would share the cores
        import ray

        # logical CPUs, so every worker's bundle fits whatever the machine's size
        ray.init(num_cpus=max(args.workers) + 2, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    runs: dict[str, Callable[[int], contextlib.AbstractContextManager[Callable[[], object]]]]
    runs = {"tcp": unison_tcp, "tcp-plain": unison_tcp_plain, "ray-shm": unison_ray_shm,
            "shm": unison_shm,
            "actors": ray_actors, "cg": compiled_graph}
    names = dict(zip(KEYS, SYSTEMS))
    samples: dict[tuple[str, int], list[float]] = {}
    floors: dict[tuple[str, int], list[tuple[float, float]]] = {}
    per_round: dict[tuple[str, int], list[float]] = {}
    failed: set[tuple[str, int]] = set()
    try:
        for n in args.workers:
            for r in range(rounds):
                # Compiled Graphs first in each round (and _kill waits for killed actors'
                # processes to end: see there)
                for key in sorted(args.systems, key=lambda k: k != "cg"):
                    name = names[key]
                    if (name, n) in failed:
                        continue
                    print(f"measuring {name} at N={n}, round {r + 1} of {rounds} ...",
                          file=sys.stderr, flush=True)
                    if key == "floor":  # the probe gives (median, p99), no samples
                        floor = probe_floor(n, block)
                        if floor is None:
                            failed.add((name, n))
                        else:
                            floors.setdefault((name, n), []).append(floor)
                        continue
                    got = measure(runs[key], n, block, warmup, f"{name} at N={n}")
                    if got is None:
                        failed.add((name, n))
                        continue
                    samples.setdefault((name, n), []).extend(got)
                    per_round.setdefault((name, n), []).append(statistics.median(got))
                    print(f"  median {per_round[(name, n)][-1]:,.1f} µs", file=sys.stderr,
                          flush=True)
    finally:
        if ray is not None:
            ray.shutdown()
    results: dict[tuple[str, int], tuple[float, float] | None] = {
        where: summary(got) for where, got in samples.items()}
    for where, cells in floors.items():  # the rounds' medians' median, and their worst p99
        results[where] = (statistics.median(c[0] for c in cells), max(c[1] for c in cells))
    for where in failed:
        results[where] = None
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    print("Dispatch round trip to N workers, median / p99 in µs (lower is better); ratios: "
          "the Ray figure's median over unison TCP's (higher: unison faster), and in "
          "brackets the range over the rounds.\n")
    print(render(results, args.workers, per_round))
    if args.json is not None:
        args.json.write_text(json.dumps([
            {"system": name, "n": n, "median_us": cell[0], "p99_us": cell[1]}
            for (name, n), cell in results.items() if cell is not None]), encoding="utf-8")
    ray_version = ray.__version__ if ray is not None else "not used"
    print(f"\nCPU: {cpu_model()}; Python {platform.python_version()}; ray {ray_version}; "
          f"{source_revision()}; {os.cpu_count()} CPUs; {seconds:g} s per system and N, in "
          f"{rounds} round(s)")
    print(f"command: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
