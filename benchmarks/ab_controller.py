"""Controller functions of a base revision against this tree's, on one live Session, in turns
(issue 9).

    python benchmarks/ab_controller.py --base REV --swap unison.session.api:Session._sync
        [--swap MODULE:OWNER.NAME ...] [--workers 2 4] [--turns 24] [--per-turn 1500]
        [--inline]

The controller's side of ab_worker.py. A change to the session's or the channel's hot path
moves a round by a few percent, less than this host drifts between two runs of
compare_revs.py. Here one Session is measured throughout: each ``--swap`` names a function of
the controller (``module:Class.attribute``), and between turns the class holds either the base
revision's version of it or this tree's. Each turn starts with the other kind than the one
before, as the first after a switch runs slower. ``dispatch`` is ``sess.call(noop)`` then
``sess.sync()``; ``gather_small`` is ``sess.run(small_value)``. Medians of every round, in µs.

The base revision's module is loaded from ``git show`` as a module of its own; its imports
are this tree's modules, and its function runs on this tree's objects. So it suits a base
whose swapped functions use the same attributes as this tree's (a change inside a function,
or one that adds one); one that needs state the live objects lack fails on its first call.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import unison
from harness.report import cpu_model, source_at, source_revision
from harness.tasks import noop, small_value

WORKLOADS = ("dispatch", "gather_small")


def _base_module(rev: str, name: str) -> types.ModuleType:
    """Module ``name`` (e.g. unison.session.api) as it was at ``rev``, loaded apart."""
    path = "src/" + name.replace(".", "/") + ".py"
    source = source_at(rev, path)
    mod = types.ModuleType(f"base_{name.replace('.', '_')}")
    mod.__file__ = f"base:{path}"
    exec(compile(source, mod.__file__, "exec"), mod.__dict__)
    return mod


def _owner(root: object, dotted: str) -> tuple[Any, str]:
    """The object holding the last name of ``dotted``, and that name."""
    *path, name = dotted.split(".")
    for part in path:
        root = getattr(root, part)
    return root, name


def swaps(rev: str, specs: list[str]) -> list[tuple[Any, str, Any, Any]]:
    """(owner, name, base's value, this tree's value) for each ``module:Owner.name``."""
    out = []
    for spec in specs:
        module, _, dotted = spec.partition(":")
        if not dotted:
            raise SystemExit(f"--swap {spec!r}: give it as module:Class.name")
        owner, name = _owner(importlib.import_module(module), dotted)
        base_owner, _ = _owner(_base_module(rev, module), dotted)
        head = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        base = (base_owner.__dict__[name] if isinstance(base_owner, type)
                else getattr(base_owner, name))
        out.append((owner, name, base, head))
    return out


def measure(n: int, swapped: list[tuple[Any, str, Any, Any]], turns: int,
            per_turn: int, inline: bool = False) -> dict[tuple[str, str], float]:
    """Median µs per (workload, "base" | "head"); ``inline``: worker 0 in the controller."""
    samples: dict[tuple[str, str], list[int]] = {
        (w, k): [] for w in WORKLOADS for k in ("base", "head")}
    clock = time.perf_counter_ns
    with unison.Session(n, inline_worker0=inline) as sess:
        for _ in range(500):  # warm: functions defined, caches filled
            sess.call(noop)
            sess.sync()
            sess.run(small_value)
        gc.disable()
        try:
            for turn in range(turns):
                for kind in ("base", "head") if turn % 2 else ("head", "base"):
                    for owner, name, base, head in swapped:
                        setattr(owner, name, base if kind == "base" else head)
                    times = samples[("dispatch", kind)]
                    for _ in range(per_turn):
                        t = clock()
                        sess.call(noop)
                        sess.sync()
                        times.append(clock() - t)
                    times = samples[("gather_small", kind)]
                    for _ in range(per_turn):
                        t = clock()
                        sess.run(small_value)
                        times.append(clock() - t)
        finally:
            gc.enable()
            for owner, name, _, head in swapped:
                setattr(owner, name, head)
    return {key: statistics.median(v) / 1000 for key, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the revision to load the functions from")
    ap.add_argument("--swap", action="append", required=True,
                    help="module:Class.name, e.g. unison.session.api:Session._sync (repeatable)")
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--turns", type=int, default=24)
    ap.add_argument("--per-turn", type=int, default=1500)
    ap.add_argument("--inline", action="store_true", help="Session(N, inline_worker0=True)")
    args = ap.parse_args()
    swapped = swaps(args.base, args.swap)
    print(f"CPU: {cpu_model()}; {source_revision()}; command: "
          f"python benchmarks/ab_controller.py {' '.join(sys.argv[1:])}\n")
    print(f"| N | work | base ({args.base}), µs | head, µs | head / base |")
    print("|--:|---|--:|--:|--:|")
    for n in args.workers:
        got = measure(n, swapped, args.turns, args.per_turn, args.inline)
        for work in WORKLOADS:
            base, head = got[(work, "base")], got[(work, "head")]
            print(f"| {n} | {work} | {base:.2f} | {head:.2f} | {head / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
