"""The worker's loop of a base revision against this tree's, in one session, in turns (issue 9).

    python benchmarks/ab_worker.py --base REV [--workers 2 4] [--turns 40] [--per-turn 400]

A change to ``worker.serve`` moves dispatch by a few percent; compare_revs.py reads two
installs in separate runs, and this host drifts by more than that between runs. Here one
Session is measured throughout, and its workers switch loops between turns: each worker runs
the base revision's ``serve`` nested inside its own (a call that returns when the controller
sends a stop entry), then this tree's ``serve`` nested the same way, so both pay the same
wrapper; each turn starts one kind later than the one before, as the first after a pause
runs slower. A third loop, ``lean`` (lean_serve: the least the loop must do, as the floor's
worker does), bounds what the loop's bookkeeping costs: what stays between lean and the
floor is the channel's and the session's. The floor system is timed in the same turns.
``dispatch`` is ``sess.call(noop)`` then ``sess.sync()``; ``run`` is ``sess.run(noop)``
(the floor's gather_small). Medians in µs, and over the floor.

The base revision's worker.py (and protocol.py, which it imports from) are loaded as modules
of their own; the nested loop shares the live worker's state (registers, identity, the
cancellation board), so both loops do the same work. The controller sends this tree's
commands, so the base must read them: a revision from before CALLs were marshalled
(protocol.py's ``dumps_plain``, issue 9's seventh pass) is refused.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import unison
from harness.report import cpu_model, source_at, source_revision
from harness.systems import make_system
from harness.tasks import noop
from unison.protocol import call_msg

STOP = call_msg(None, 0, -1, None, None, 0)
"""The entry that ends a nested loop (function id -1: never a real one)."""


def nest(which: str, sources: dict[str, str] | None = None) -> int:
    """On a worker: run ``which`` ("base": the loop of ``sources``; "head": this tree's;
    "lean": ``lean_serve``) on the live channel until the controller sends STOP."""
    from unison import worker
    from unison.channel import WorkerChannel
    from unison.collective.base import Collectives

    live = gc.get_objects()
    chan = next(o for o in live if isinstance(o, WorkerChannel))
    coll = next((o for o in live if isinstance(o, Collectives)), None)
    loop = next(o for o in live if isinstance(o, worker.Loop))
    del live  # every object of the worker: not to be held while the loop runs
    serve: Callable[..., None] = worker.serve
    if which == "base":
        serve = _base_serve(sources or {})
    elif which == "lean":
        serve = lean_serve
    real = chan.recv

    def recv() -> Any:
        got = real()
        return None if got is None or got[0] == STOP else got

    serve(chan, coll, worker._board, loop, recv=recv)
    return 0


def lean_serve(chan: Any, coll: Any, board: Any, loop: Any, recv: Callable[[], Any]) -> None:
    """The least a worker's loop must do for dispatch and run, as the floor's worker does:
    unpickle, drop the frees, call, keep the result or reply with it. No errors, no
    cancellation, no collectives, no trace: a bound for what the real loop's bookkeeping
    costs, never a loop to use."""
    from unison import worker
    from unison.protocol import PLAIN, dumps_plain, loads_plain

    regs, fns = worker.registers, loop.fns
    while True:
        got = recv()
        if got is None:
            return
        _, frees, ref_id, fn_id, _, _, req_id = loads_plain(got[0])  # a CALL: marshalled
        if frees:
            for i in frees:
                regs.pop(i, None)
        value = fns[fn_id]()
        if req_id:
            chan.reply(dumps_plain((req_id, 0, value), PLAIN))
        else:
            regs[ref_id] = value


def _base_serve(sources: dict[str, str]) -> Callable[..., None]:
    """The base's serve, its module state the live worker's. Loaded once per worker: kept in
    sys.modules (``nest`` travels by value, so a global of this script would not last)."""
    loaded = sys.modules.get("unison_base_worker")
    if loaded is not None:
        return loaded.serve  # type: ignore[no-any-return]
    import unison
    from unison import worker

    protocol = types.ModuleType("unison_base_protocol")
    exec(compile(sources["protocol"], "base:protocol.py", "exec"), protocol.__dict__)
    mod = types.ModuleType("unison_base_worker")
    current, unison.protocol = unison.protocol, protocol
    saved = sys.modules["unison.protocol"]
    sys.modules["unison.protocol"] = protocol
    try:
        exec(compile(sources["worker"], "base:worker.py", "exec"), mod.__dict__)
    finally:
        unison.protocol = current
        sys.modules["unison.protocol"] = saved
    for name in ("registers", "_identity", "_current", "_board"):
        setattr(mod, name, getattr(worker, name))
    sys.modules["unison_base_worker"] = mod
    return mod.serve  # type: ignore[no-any-return]


def measure(n: int, sources: dict[str, str], turns: int, per_turn: int) -> dict[str, float]:
    floor = make_system("floor")
    floor.start(n)
    kinds = ("floor", "base dispatch", "head dispatch", "lean dispatch", "floor run",
             "base run", "head run", "lean run")
    samples: dict[str, list[int]] = {k: [] for k in kinds}
    try:
        with unison.Session(n) as sess:
            sess.run(noop)

            def dispatch() -> None:
                sess.call(noop)
                sess.sync()

            ops: dict[str, Callable[[], object]] = {
                "floor": floor.dispatch, "dispatch": dispatch,
                "floor run": floor.gather_small, "run": lambda: sess.run(noop)}
            clock = time.perf_counter_ns
            for turn in range(turns):
                k = turn % len(kinds)  # each turn starts one later: no kind always comes first
                for kind in kinds[k:] + kinds[:k]:
                    which, _, work = kind.partition(" ")
                    op = ops[kind] if which.startswith("floor") else ops[work]
                    if which in ("base", "head", "lean"):
                        sess.call(nest, which, sources if which == "base" else None)
                    for _ in range(50):
                        op()
                    out = samples[kind]
                    gc.disable()
                    try:
                        for _ in range(per_turn):
                            t0 = clock()
                            op()
                            out.append(clock() - t0)
                    finally:
                        gc.enable()
                    if which in ("base", "head", "lean"):
                        sess._chan.send(STOP, sess.workers)  # ends the nested loops
                        sess.sync()
    finally:
        floor.close()
    return {k: statistics.median(v) / 1e3 for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision whose worker loop to compare")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--per-turn", type=int, default=400)
    args = parser.parse_args()
    sources = {"worker": source_at(args.base, "src/unison/worker.py"),
               "protocol": source_at(args.base, "src/unison/protocol.py")}
    if "dumps_plain" not in sources["protocol"]:
        sys.exit(f"ab_worker.py: {args.base} predates the marshalled CALL this tree sends, so its "
                 "worker loop cannot read it; compare it with compare_revs.py instead")
    print(f"CPU: {cpu_model()}; head: {source_revision()}; base: {args.base}; command: python "
          f"benchmarks/ab_worker.py --base {args.base} --workers "
          f"{' '.join(map(str, args.workers))} --turns {args.turns} --per-turn {args.per_turn}\n")
    print("| N | work | floor | base | head | lean | head / base | base / floor "
          "| head / floor | lean / floor |")
    print("|--:|---|" + "--:|" * 8)
    for n in args.workers:
        m = measure(n, sources, args.turns, args.per_turn)
        for work, floor in (("dispatch", m["floor"]), ("run", m["floor run"])):
            base, head, lean = (m[f"{w} {work}"] for w in ("base", "head", "lean"))
            print(f"| {n} | {work} | {floor:.1f} | {base:.1f} | {head:.1f} | {lean:.1f} "
                  f"| {head / base:.2f}x | {base / floor:.2f}x | {head / floor:.2f}x "
                  f"| {lean / floor:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
