"""Soak (issue 14): a long run of the same few operations, checking that nothing accumulates.

    python benchmarks/soak.py [--workers 2] [--dispatches 1000000] [--puts 100000]
                              [--sessions 10000] [--session-seconds S] [--json PATH]

Three phases, each timed one operation at a time:

  dispatch   ``sess.call(noop)`` then ``sess.sync()``, the Ref dropped at once: the dispatch
             round trip of ``benchmarks/run.py`` (its ``dispatch`` workload for unison)
  put        ``sess.put(array)`` (``--put-bytes``, 1 MiB: through the arena), ``sess.sync()``,
             ``ref.free()``: the put workload of ``benchmarks/run.py``
  sessions   ``with unison.Session(N) as s: s.call(noop); s.sync()``, open and close; with
             ``--session-seconds`` the phase stops early at that much wall time and says how
             many cycles ran

The first two share one session. Each phase starts after a short untimed warm-up; its
baseline is taken then, and after the phase the checks compare against it (printed as
measured vs limit, PASS or FAIL; ``--json`` keeps every figure):

  memory     RSS growth over the phase under ``--rss-limit`` MB (20): the controller's, and
             each worker's (psutil)
  registers  every table that holds per-call state is back to what it held at the start:
             on the controller, the frees not yet sent, the requests awaiting replies, the
             errors nobody fetched, the function cache, the live Ref objects, the command
             arena's blocks in use and the pending ``weakref.finalize`` callbacks (each
             mapping of shared memory has one); on each worker, its register file, function
             table, list of unreported errors, reply arena's blocks in use and finalizers
  fds, threads  the controller's (psutil) and the workers' are what they were at the start
             (the session phase: what they were before any session; also no process started
             by this controller is left, anywhere, and no ``memfd:unison`` fd or mapping)
  latency    (dispatch) the median of the last 10% of dispatches within ``--drift-limit``
             (10%) of the first 10%'s, either way; the medians of every tenth are printed,
             so a trend shows apart from the noise of a busy machine

Where the public API says nothing, the register checks read internals (they may move; a
figure that cannot be read is printed as "n/a" and fails its check):
  controller  ``Session._frees``, ``Session._router._expect``, ``Session._errors._errors``,
              ``Session._fns._entries``, ``Session._chan.arena`` (``_busy``, ``_in_use``,
              ``_slots``, ``_kept``), ``unison.session.api._live``; and the stdlib's
              ``weakref.finalize._registry`` (controller and workers)
  workers     ``unison.worker.object_count()``, and the locals ``fns``, ``unreported`` and
              ``chan`` (its reply arena ``chan._replies``) of the frame of
              ``unison.worker.serve`` that runs the probe (``worker_state`` below, sent
              through ``sess.run`` like any function of a script)
Everything else is the public API, psutil and /proc.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import psutil

import unison
from harness.report import command_line, cpu_model, host_busy, source_revision
from harness.tasks import noop

MB = 1 << 20
SAMPLES = 10
"""Figures are sampled at every tenth of a phase (no message: psutil and /proc only)."""
SETTLE_S = 10.0
"""How long to wait, after the last session closed, for fds, threads and processes to go
(a closed session's output-relay thread may take up to a second to notice)."""


# -- what runs on a worker ----------------------------------------------------------------------


def worker_state() -> dict[str, Any]:
    """On a worker (sent by value through ``sess.run``): its tables and OS figures. The
    frees the controller had not sent yet ride on this call's message, and a worker applies
    them before it runs the call, so the counts are those after every free so far."""
    import os
    import sys
    import threading
    import weakref

    from unison import worker

    out: dict[str, Any] = {"pid": os.getpid(), "objects": worker.object_count()}
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "serve"
                                     and frame.f_globals.get("__name__") == "unison.worker"):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is not None:
        scope = frame.f_locals  # a snapshot (3.11/3.12): emptied below, not to hold anything
        try:
            for key in ("fns", "unreported"):
                table = scope.get(key)
                out[key] = len(table) if table is not None else None
            replies = getattr(scope.get("chan"), "_replies", None)
            busy = getattr(replies, "_busy", None)
            if replies is not None and busy is not None:
                out["reply_blocks_in_use"] = sum(1 for b in busy if replies._in_use(b))
                out["reply_blocks_made"] = replies._slots
        finally:
            if type(scope) is dict:
                scope.clear()
        del scope, frame
    out["finalizers"] = len(weakref.finalize._registry)  # type: ignore[attr-defined]
    out["fds"] = len(os.listdir("/proc/self/fd"))
    out["threads"] = threading.active_count()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "Threads:")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0])
    with open("/proc/self/maps") as f:
        out["memfd_maps"] = sum(1 for line in f if "memfd:unison" in line)
    return out


# -- what the controller reads -----------------------------------------------------------------


def _get(obj: Any, path: str) -> Any:
    """``obj.a.b`` for path "a.b", or None where some part is missing (internals move)."""
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _size(obj: Any, path: str) -> int | None:
    table = _get(obj, path)
    return None if table is None else len(table)


def controller_state(sess: unison.Session) -> dict[str, Any]:
    """The controller's tables of per-call state (internals: see the module's docstring)."""
    gc.collect()
    expect = _get(sess, "_router._expect")
    arena = _get(sess, "_chan.arena")
    busy = _get(arena, "_busy")
    return {
        "pending_frees": _size(sess, "_frees"),
        "awaited_replies": None if expect is None else sum(len(q) for q in expect),
        "unfetched_errors": _size(sess, "_errors._errors"),
        "cached_functions": _size(sess, "_fns._entries"),
        "live_refs": sum(1 for o in gc.get_objects() if type(o) is unison.Ref),
        "finalizers": len(weakref.finalize._registry),  # type: ignore[attr-defined]
        "arena_blocks_in_use": (None if busy is None else
                                sum(1 for b in busy if arena._in_use(b))),
        "arena_blocks_made": _get(arena, "_slots"),
        "arena_bytes_kept": _get(arena, "_kept"),
    }


def memfd_fds() -> int:
    """This process's fds on a ``memfd:unison...`` file."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:unison"):
                n += 1
        except OSError:
            pass  # the listing's own fd, closed by now
    return n


def memfd_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "memfd:unison" in line)


def my_workers() -> list[int]:
    """Every process, anywhere, started as a local worker of this controller (their command
    line names our pid), plus any descendant of ours: none may outlive its session."""
    me = os.getpid()
    found = {p.pid for p in psutil.Process(me).children(recursive=True)}
    mark = f"main({me})"
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if any("unison.worker" in part and mark in part for part in cmd):
            found.add(p.pid)
    return sorted(found)


def rss(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return None


def status_kb(pid: int | str, keys: tuple[str, ...]) -> dict[str, int]:
    """Fields of /proc/PID/status in kB (RssAnon, RssShmem, ...); {} where unreadable."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in keys:
                    out[key] = int(value.split()[0])
    except (OSError, ValueError):
        pass
    return out


@dataclass
class Sample:
    done: int
    elapsed_s: float
    rss: int
    anon: int | None  # RssAnon (bytes): the heap, without the shared rings and arenas
    shmem: int | None  # RssShmem (bytes): the shared-memory pages touched so far
    fds: int
    threads: int
    load1: float
    worker_rss: list[int | None] = field(default_factory=list)
    worker_anon: list[int | None] = field(default_factory=list)


def _malloc_trim() -> None:
    """Hand the heap's free pages back to the kernel (glibc), so that RSS counts live
    memory: not what this script's own statistics freed, which malloc would keep."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def sample(done: int, start: float, workers: list[int]) -> Sample:
    _malloc_trim()
    me = psutil.Process()
    mine = status_kb("self", ("RssAnon", "RssShmem"))
    anon = [status_kb(p, ("RssAnon",)).get("RssAnon") for p in workers]
    return Sample(done, time.perf_counter() - start, int(me.memory_info().rss),
                  None if "RssAnon" not in mine else mine["RssAnon"] * 1024,
                  None if "RssShmem" not in mine else mine["RssShmem"] * 1024,
                  int(me.num_fds()), int(me.num_threads()), os.getloadavg()[0],
                  [rss(p) for p in workers], [None if a is None else a * 1024 for a in anon])


# -- the checks ---------------------------------------------------------------------------------


@dataclass
class Check:
    phase: str
    name: str
    measured: Any
    limit: str
    ok: bool


class Checks:
    def __init__(self) -> None:
        self.items: list[Check] = []

    def add(self, phase: str, name: str, measured: Any, limit: str, ok: bool) -> None:
        check = Check(phase, name, "n/a" if measured is None else measured, limit,
                      measured is not None and ok)
        self.items.append(check)
        print(f"  [{'PASS' if check.ok else 'FAIL'}] {name}: {_fmt(check.measured)} "
              f"(limit {limit})", flush=True)

    def at_most(self, phase: str, name: str, measured: float | None, limit: float,
                unit: str = "") -> None:
        self.add(phase, name, measured, f"<= {_fmt(limit)}{unit}",
                 measured is not None and measured <= limit)

    def equal(self, phase: str, name: str, measured: Any, expected: Any) -> None:
        self.add(phase, name, measured, f"== {_fmt(expected)}",
                 measured is not None and measured == expected)


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def mb(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / MB


def check_memory(checks: Checks, phase: str, base: Sample, end: Sample, limit_mb: float) -> None:
    checks.at_most(phase, "controller RSS growth (MB)", mb(end.rss - base.rss), limit_mb)
    for i, (b, e) in enumerate(zip(base.worker_rss, end.worker_rss)):
        growth = None if b is None or e is None else mb(e - b)
        checks.at_most(phase, f"worker {i} RSS growth (MB)", growth, limit_mb)
    print(f"  of which anonymous (heap) memory: controller {_growth(base.anon, end.anon)} MB, "
          "workers " + ", ".join(_growth(b, e) for b, e in zip(base.worker_anon,
                                                              end.worker_anon)) + " MB; "
          f"the controller's shared-memory pages: {_growth(base.shmem, end.shmem)} MB",
          flush=True)


def _growth(before: int | None, after: int | None) -> str:
    return "n/a" if before is None or after is None else f"{(after - before) / MB:+.2f}"


def check_tables(checks: Checks, phase: str, sess: unison.Session,
                 before: tuple[dict[str, Any], list[dict[str, Any]]]) -> tuple[
                     dict[str, Any], list[dict[str, Any]]]:
    """The registers after the phase: a probe call first (its message carries the frees
    still pending), then the controller's tables, then the workers' as the probe saw them."""
    ctl0, w0 = before
    pending = _size(sess, "_frees")
    print(f"  frees pending before the probe call: {pending}", flush=True)
    workers = sess.run(worker_state)
    ctl = controller_state(sess)
    for key in ("pending_frees", "awaited_replies", "unfetched_errors", "live_refs",
                "arena_blocks_in_use"):
        checks.equal(phase, f"controller {key}", ctl[key], 0)
    for key in ("cached_functions", "finalizers"):
        checks.at_most(phase, f"controller {key}", ctl[key], ctl0[key] or 0)
    print(f"  controller arena: {ctl['arena_blocks_made']} blocks made "
          f"(at the phase's start {ctl0['arena_blocks_made']}), "
          f"{ctl['arena_bytes_kept']} bytes kept backed for reuse", flush=True)
    for rank, (st, st0) in enumerate(zip(workers, w0)):
        checks.equal(phase, f"worker {rank} objects in its register file", st["objects"], 0)
        checks.equal(phase, f"worker {rank} unreported errors", st.get("unreported"), 0)
        checks.equal(phase, f"worker {rank} functions defined", st.get("fns"), st0.get("fns"))
        checks.equal(phase, f"worker {rank} reply-arena blocks in use",
                     st.get("reply_blocks_in_use"), 0)
        checks.at_most(phase, f"worker {rank} weakref finalizers pending", st["finalizers"],
                       st0["finalizers"])
        checks.equal(phase, f"worker {rank} fds", st["fds"], st0["fds"])
        checks.equal(phase, f"worker {rank} threads (OS)", st.get("Threads"),
                     st0.get("Threads"))
        checks.equal(phase, f"worker {rank} memfd:unison mappings", st["memfd_maps"],
                     st0["memfd_maps"])
    return ctl, workers


def check_own(checks: Checks, phase: str, base: Sample, end: Sample) -> None:
    checks.equal(phase, "controller fds", end.fds, base.fds)
    checks.equal(phase, "controller threads", end.threads, base.threads)


# -- timing ------------------------------------------------------------------------------------


def tenths(times: np.ndarray[Any, np.dtype[np.float64]], scale: float) -> list[float]:
    """The median of each tenth of ``times`` (in order), times ``scale``."""
    parts = np.array_split(times[np.isfinite(times)], SAMPLES)
    return [float(np.median(p)) * scale for p in parts if len(p)]


def describe_times(name: str, times: np.ndarray[Any, np.dtype[np.float64]], scale: float,
                   unit: str) -> dict[str, Any]:
    done = times[np.isfinite(times)]
    if not len(done):
        return {}
    meds = tenths(times, scale)
    p99 = float(np.percentile(done, 99)) * scale
    print(f"  {name}: {len(done)} timed, median {np.median(done) * scale:.1f} {unit}, "
          f"p99 {p99:.1f} {unit}, max {done.max() * scale:.1f} {unit}")
    print(f"  median of each tenth ({unit}): " + " ".join(f"{m:.1f}" for m in meds), flush=True)
    return {"count": len(done), "median": float(np.median(done)) * scale, "p99": p99,
            "max": float(done.max()) * scale, "tenths_median": meds, "unit": unit}


def timed_loop(count: int, op: Callable[[], None], progress: Callable[[int], None],
               times: np.ndarray[Any, np.dtype[np.float64]],
               stop_at: float | None = None, every_s: float | None = None) -> int:
    """Run ``op`` ``count`` times, each timed into ``times``; ``progress(i)`` at each tenth
    (and every ``every_s`` seconds). Stops early once ``time.monotonic()`` passes
    ``stop_at``; returns how many ran."""
    clock = time.perf_counter
    marks = {count * k // SAMPLES for k in range(1, SAMPLES + 1)}
    every = every_s or 0.0
    next_at = time.monotonic() + every if every else None
    last = 0
    for i in range(count):
        if stop_at is not None and time.monotonic() >= stop_at:
            if i != last:
                progress(i)
            return i
        t = clock()
        op()
        times[i] = clock() - t
        due = next_at is not None and time.monotonic() >= next_at
        if i + 1 in marks or due:
            progress(i + 1)
            last = i + 1
        if due:
            next_at = time.monotonic() + every
    return count


# -- the phases --------------------------------------------------------------------------------


def print_sample(s: Sample, total: int, what: str) -> None:
    def m(x: int | None) -> str:
        return "-" if x is None else f"{x / MB:.1f}"

    workers = " ".join(f"{m(r)} ({m(a)})" for r, a in zip(s.worker_rss, s.worker_anon))
    print(f"    {s.done}/{total} {what} at {s.elapsed_s:.1f} s (load {s.load1:.2f}): controller "
          f"RSS {m(s.rss)} MB (anon {m(s.anon)}, shmem {m(s.shmem)}), fds {s.fds}, threads "
          f"{s.threads}" + (f"; workers' RSS (anon) {workers} MB" if workers else ""),
          flush=True)


def run_in_session(args: argparse.Namespace, checks: Checks, results: dict[str, Any]) -> None:
    with unison.Session(args.workers) as sess:
        pids = [int(p) for p in sess.run(os.getpid)]
        results["worker_pids"] = pids
        if args.dispatches:
            results["dispatch"] = dispatch_phase(sess, pids, args, checks)
        if args.puts:
            results["put"] = put_phase(sess, pids, args, checks)


def _baseline(sess: unison.Session, pids: list[int]) -> tuple[
        Sample, tuple[dict[str, Any], list[dict[str, Any]]]]:
    workers = sess.run(worker_state)  # first: so the probe is defined in the baseline too
    tables = (controller_state(sess), workers)
    return sample(0, time.perf_counter(), pids), tables


def _timed_phase(name: str, what: str, sess: unison.Session, pids: list[int], n: int,
                 op: Callable[[], None], times: np.ndarray[Any, np.dtype[np.float64]],
                 args: argparse.Namespace, checks: Checks
                 ) -> tuple[int, float, dict[str, Any]]:
    """What every in-session phase does around its op: the baseline, ``n`` timed runs with a
    sample at each tenth, then the memory, table and own-resource checks. How many ran, the
    wall time, and the phase's record of samples and tables."""
    base, tables = _baseline(sess, pids)
    start = time.perf_counter()
    samples = [base]

    def progress(done: int) -> None:
        samples.append(sample(done, start, pids))
        print_sample(samples[-1], n, what)

    ran = timed_loop(n, op, progress, times)
    wall = time.perf_counter() - start
    end = sample(ran, start, pids)  # before the statistics' temporaries (8 MB per 1M)
    check_memory(checks, name, base, end, args.rss_limit)
    ctl, workers = check_tables(checks, name, sess, tables)
    check_own(checks, name, base, sample(ran, start, pids))
    return ran, wall, {"samples": [s.__dict__ for s in samples], "end": end.__dict__,
                       "controller": ctl, "workers": workers}


def dispatch_phase(sess: unison.Session, pids: list[int], args: argparse.Namespace,
                   checks: Checks) -> dict[str, Any]:
    n = args.dispatches
    print(f"\n== dispatch: {n} x (sess.call(noop); sess.sync()) on {args.workers} workers",
          flush=True)
    times = np.full(n, np.nan)  # every page touched now, before the baseline

    def op() -> None:
        sess.call(noop)
        sess.sync()

    for _ in range(min(args.warmup, n)):
        op()
    ran, wall, record = _timed_phase("dispatch", "dispatches", sess, pids, n, op, times, args,
                                     checks)
    print(f"  {ran} dispatches in {wall:.1f} s ({ran / wall:.0f}/s)")
    out: dict[str, Any] = {"count": ran, "wall_s": wall,
                           "latency": describe_times("dispatch", times, 1e6, "µs")}
    tenth = max(1, ran // 10)
    first = float(np.median(times[:tenth]))
    last = float(np.median(times[ran - tenth : ran]))
    drift = last / first - 1
    checks.add("dispatch", f"latency drift: median of the last 10% ({last * 1e6:.2f} µs) vs the "
               f"first 10% ({first * 1e6:.2f} µs), %", round(100 * drift, 2),
               f"within +-{args.drift_limit:g}%", abs(100 * drift) <= args.drift_limit)
    floor0 = float(np.percentile(times[:tenth], 10))
    floor1 = float(np.percentile(times[ran - tenth : ran], 10))
    print(f"  for comparison, the 10th percentile (the undisturbed floor) of the first and last "
          f"10%: {floor0 * 1e6:.2f} and {floor1 * 1e6:.2f} µs "
          f"({100 * (floor1 / floor0 - 1):+.1f}%)", flush=True)
    out.update(first_tenth_median_us=first * 1e6, last_tenth_median_us=last * 1e6,
               drift=drift, first_tenth_p10_us=floor0 * 1e6, last_tenth_p10_us=floor1 * 1e6,
               **record)
    return out


def put_phase(sess: unison.Session, pids: list[int], args: argparse.Namespace,
              checks: Checks) -> dict[str, Any]:
    n = args.puts
    value = np.full(max(1, args.put_bytes // 8), 1.5)
    print(f"\n== put: {n} x (ref = sess.put({value.nbytes} bytes of float64); sess.sync(); "
          "ref.free())", flush=True)
    times = np.full(n, np.nan)

    def op() -> None:
        ref = sess.put(value)
        sess.sync()
        ref.free()

    for _ in range(min(args.warmup // 10, n)):
        op()
    ran, wall, record = _timed_phase("put", "puts", sess, pids, n, op, times, args, checks)
    print(f"  {ran} put/free cycles in {wall:.1f} s ({ran / wall:.0f}/s, "
          f"{ran * value.nbytes / wall / 1e9:.2f} GB/s)")
    return {"count": ran, "wall_s": wall, "bytes": int(value.nbytes),
            "latency": describe_times("put/free", times, 1e6, "µs"), **record}


def settle(start: Sample) -> tuple[float, Sample, list[int]]:
    """Wait (sleeping, at most SETTLE_S) until fds and threads are back at ``start`` and no
    worker process of ours is left; what was seen last, and how long that took."""
    t0 = time.perf_counter()
    while True:
        gc.collect()
        now = sample(0, t0, [])
        left = my_workers()
        waited = time.perf_counter() - t0
        if (now.fds <= start.fds and now.threads <= start.threads and not left) or \
                waited >= SETTLE_S:
            return waited, now, left
        time.sleep(0.1)


def session_phase(args: argparse.Namespace, checks: Checks, initial: Sample,
                  initial_finalizers: int) -> dict[str, Any]:
    n = args.sessions
    w = args.session_workers or args.workers
    budget = args.session_seconds
    print(f"\n== sessions: {n} x (with unison.Session({w}) as s: s.call(noop); s.sync())"
          + (f", stopping at {budget:g} s" if budget else ""), flush=True)
    times = np.full(n, np.nan)
    errors: list[str] = []

    def op() -> None:
        try:
            with unison.Session(w) as s:
                s.call(noop)
                s.sync()
        except Exception:
            if len(errors) < 5:
                errors.append(traceback.format_exc())
            else:
                errors.append("")

    for _ in range(min(args.session_warmup, n)):
        op()
    gc.collect()
    base = sample(0, time.perf_counter(), [])
    start = time.perf_counter()
    samples = [base]

    def progress(done: int) -> None:
        samples.append(sample(done, start, []))
        print_sample(samples[-1], n, "sessions")

    stop_at = None if not budget else time.monotonic() + budget
    ran = timed_loop(n, op, progress, times, stop_at, budget / SAMPLES if budget else 300.0)
    wall = time.perf_counter() - start
    waited, end, left = settle(initial)  # before the statistics' temporaries
    print(f"  {ran} of {n} session cycles ran in {wall:.1f} s ({wall / max(ran, 1):.3f} s each)"
          + (" (stopped by --session-seconds)" if ran < n else ""))
    out: dict[str, Any] = {"requested": n, "count": ran, "wall_s": wall, "workers": w,
                           "latency": describe_times("open+call+close", times, 1e3, "ms")}
    print(f"  after the last close: settled in {waited:.1f} s", flush=True)
    checks.equal("sessions", "sessions that failed", len(errors), 0)
    for text in errors[:5]:
        print(text)
    checks.at_most("sessions", "controller RSS growth (MB) over the cycles after warm-up",
                   mb(end.rss - base.rss), args.rss_limit)
    checks.at_most("sessions", "controller RSS growth (MB) since before any session",
                   mb(end.rss - initial.rss), args.rss_limit)
    checks.equal("sessions", "controller fds vs before any session", end.fds, initial.fds)
    checks.equal("sessions", "controller threads vs before any session", end.threads,
                 initial.threads)
    checks.equal("sessions", "worker processes of this controller left", len(left), 0)
    checks.equal("sessions", "memfd:unison fds open", memfd_fds(), 0)
    checks.equal("sessions", "memfd:unison mappings", memfd_maps(), 0)
    from unison.session import api

    live = _size(api, "_live")
    checks.equal("sessions", "sessions still registered (unison.session.api._live)", live, 0)
    gc.collect()
    objects = sum(1 for o in gc.get_objects() if type(o) is unison.Session)
    checks.equal("sessions", "Session objects alive", objects, 0)
    checks.at_most("sessions", "weakref finalizers pending vs before any session",
                   len(weakref.finalize._registry), initial_finalizers)  # type: ignore[attr-defined]
    out.update(samples=[s.__dict__ for s in samples], end=end.__dict__, settle_s=waited,
               errors=errors, leftover_pids=left)
    return out


# -- main --------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dispatches", type=int, default=1_000_000)
    parser.add_argument("--puts", type=int, default=100_000)
    parser.add_argument("--put-bytes", type=int, default=MB)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--session-workers", type=int, default=0,
                        help="workers of each session of the session phase (default --workers)")
    parser.add_argument("--session-seconds", type=float, default=0.0,
                        help="stop the session phase after this much wall time (0: never)")
    parser.add_argument("--warmup", type=int, default=2000,
                        help="untimed dispatches before the baseline (puts: a tenth)")
    parser.add_argument("--session-warmup", type=int, default=3)
    parser.add_argument("--rss-limit", type=float, default=20.0, help="MB")
    parser.add_argument("--drift-limit", type=float, default=10.0, help="%%")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    for name in ("workers", "dispatches", "puts", "sessions", "put_bytes", "warmup",
                 "session_warmup", "session_workers"):
        if getattr(args, name) < (1 if name == "workers" else 0):
            parser.error(f"--{name.replace('_', '-')} must be at least "
                         f"{1 if name == 'workers' else 0}")

    load0 = os.getloadavg()
    busy0 = host_busy()
    machine = {
        "cpu": cpu_model(), "nproc": len(os.sched_getaffinity(0)),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "numpy": np.__version__, "psutil": psutil.__version__,
        "revision": source_revision(), "os": f"{platform.system()} {platform.release()}",
        "niceness": os.nice(0),
    }
    command = command_line(sys.argv[1:])
    print(f"soak: {command}")
    print(f"CPU: {machine['cpu']} ({machine['nproc']} usable); {machine['python']}, numpy "
          f"{machine['numpy']}; {machine['revision']}; niceness {machine['niceness']}")
    print(f"load at start: {' '.join(f'{x:.2f}' for x in load0)} (1/5/15 min), CPUs busy "
          f"{'unknown' if busy0 is None else f'{busy0:.0f}%'}; started "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)

    checks = Checks()
    gc.collect()
    initial = sample(0, time.perf_counter(), [])
    initial_memfd = memfd_fds()
    initial_finalizers = len(weakref.finalize._registry)  # type: ignore[attr-defined]
    print(f"controller before any session: RSS {initial.rss / MB:.1f} MB, fds {initial.fds}, "
          f"threads {initial.threads}, memfd:unison fds {initial_memfd}", flush=True)
    results: dict[str, Any] = {"command": command, "machine": machine,
                               "load_start": list(load0), "busy_start": busy0,
                               "initial": initial.__dict__}
    t0 = time.perf_counter()
    if args.dispatches or args.puts:
        run_in_session(args, checks, results)
        waited, after, left = settle(initial)
        print(f"\n== after the soak session closed (settled in {waited:.1f} s)")
        checks.equal("session closed", "controller fds vs before any session", after.fds,
                     initial.fds)
        checks.equal("session closed", "controller threads vs before any session",
                     after.threads, initial.threads)
        checks.equal("session closed", "worker processes of this controller left",
                      len(left), 0)
        checks.equal("session closed", "memfd:unison fds open", memfd_fds(), 0)
        checks.equal("session closed", "memfd:unison mappings", memfd_maps(), 0)
        checks.at_most("session closed", "weakref finalizers pending vs before any session",
                       len(weakref.finalize._registry),  # type: ignore[attr-defined]
                       initial_finalizers)
    if args.sessions:
        results["sessions"] = session_phase(args, checks, initial, initial_finalizers)

    load1 = os.getloadavg()
    busy1 = host_busy()
    failed = [c for c in checks.items if not c.ok]
    print(f"\nload at end: {' '.join(f'{x:.2f}' for x in load1)} (1/5/15 min), CPUs busy "
          f"{'unknown' if busy1 is None else f'{busy1:.0f}%'}; "
          f"{time.perf_counter() - t0:.0f} s in all")
    print(f"{len(checks.items) - len(failed)} of {len(checks.items)} checks passed"
          + ("" if not failed else "; FAILED: " + "; ".join(
              f"[{c.phase}] {c.name}" for c in failed)))
    results.update(load_end=list(load1), busy_end=busy1, wall_s=time.perf_counter() - t0,
                   checks=[c.__dict__ for c in checks.items], passed=not failed)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
        print(f"results: {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
