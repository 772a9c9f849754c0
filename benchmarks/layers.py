"""Where unison's dispatch time goes, layer by layer, against the floor (issue 9).

    python benchmarks/layers.py --workers 2 4 [--seconds 2] [--rounds 3]

The round trips below, measured in turns (each for ``seconds / rounds`` at a time, ``rounds``
times), so that a slow minute of the host falls on all of them alike:

    floor             the floor system (harness/systems/floor.py): the smallest pure-Python
                      ring doing the round trip
    channel run       a real Session's own channel and workers driven without the session
                      layer: one CALL that asks for a reply, sent as the session sends it
                      (``chan.send_plain``, else ``chan.send``), then ``chan.recv`` until
                      each worker's reply is in, its request id checked
    channel quick     the same, its replies read as run's usual case reads them: one
                      ``chan.plain_values`` (each look one C call that reads and decodes
                      every worker's reply once all are in)
    run               ``sess.run(noop)`` on that same Session: the session layer on top
                      (Request, router, locks, function cache, decoding)
    channel dispatch  one CALL that keeps its result (freeing the one before, as the session
                      does), then ``chan.wait_done`` on the workers' done positions
    dispatch          ``sess.call(noop)`` then ``sess.sync()`` (the dispatch workload of
                      benchmarks/run.py): Ref, frees, sync's checks on top
    dispatch + look   (``--death-look``) dispatch, then the look for a dead worker that sync
                      made after its workers finished until issue 9's fourth pass (one
                      epoll_wait on the pidfds): what dropping that look saved

With ``--tails``, each N also gives each kind's p99 over its median and the share of its
rounds at 3x the median or slower (issue 9's p99 target is 3x at N=2): the floor's own
share says how much of that tail the host makes, and the layers above it what each adds.

With ``--phases``, each N also splits ``run`` and ``dispatch`` of the same Session in
time: from the call to the channel's send, the send, from there to the channel's last
``recv`` or ``plain_values`` (or, for dispatch, until sync returns), and what the controller
does after it. The channel's send and reads are wrapped for that (a few hundred ns each),
so these rounds are a little slower than the table's; what matters is where the time goes.

The channel round trips use the session's private channel, between the session's own calls,
with ids drawn from the session's counter, so the session stays in step. Each turn is
harness.measure's timed loop, the garbage collector paused as in benchmarks/run.py (the
runs of 2026-12-01 19:10-19:38 UTC in docs/benchmarks.md had it running). Medians in µs, and
each over the floor's median of the same turns: the channel's ratio is what the ring, the
wake-ups and the workers' loop cost; the gap from there to run or dispatch is the session
layer's.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import unison
from harness.measure import Loop, tail, time_loop
from harness.report import cpu_model, source_revision
from harness.systems import make_system
from unison.channel import shm
from unison.protocol import OK, call_msg, read_reply

KINDS = ("floor", "channel run", "channel quick", "run", "channel dispatch", "dispatch")


def noop() -> None:
    pass


def _below(sess: unison.Session) -> tuple[Any, tuple[int, ...], int, Any]:
    """The session's channel, its ranks, noop's function id on its workers, its id counter."""
    sess.run(noop)  # the workers hold noop now
    fn_id, _ = sess._fns.lookup(noop)
    if not fn_id:
        raise RuntimeError("noop is not in the session's function cache")
    return sess._chan, sess.workers, fn_id, sess._ids


def channel_run(sess: unison.Session, quick: bool = False) -> Callable[[], None]:
    """``run(noop)`` with the session layer taken out: send, then read the replies (with
    ``quick``, in one step where the channel can, as the router's quick path does)."""
    chan, ranks, fn_id, ids = _below(sess)

    def once() -> None:
        req = next(ids)
        msg = call_msg(None, req, fn_id, None, None, req)
        if not chan.send_plain(msg, ranks):  # as the session's quick send
            chan.send(msg, ranks)
        if quick and chan.plain_values(ranks, req, 1.0) is not None:
            return
        left = len(ranks)  # plain_values read nothing: a long wait, or no C ring
        while left:
            for rank, data in chan.recv(None):
                if data is None:
                    raise RuntimeError(f"worker {rank} is gone: {chan.where(rank)}")
                got, status, _ = read_reply(data)
                if got != req or status != OK:
                    raise RuntimeError(f"worker {rank} answered {got} ({status}), not {req}")
                left -= 1
    return once


def channel_dispatch(sess: unison.Session) -> Callable[[], None]:
    """``call(noop)`` and ``sync()`` with the session layer taken out."""
    chan, ranks, fn_id, ids = _below(sess)
    held: list[int] = []  # the register the last call left on the workers

    def once() -> None:
        ref = next(ids)
        msg = call_msg(tuple(held) or None, ref, fn_id, None, None, 0)
        if not chan.send_plain(msg, ranks):
            chan.send(msg, ranks)
        held[:] = [ref]
        mark = chan.mark()
        while not chan.wait_done(ranks, mark, 1.0):
            sess.check_alive("waiting in benchmarks/layers.py")
    return once


def dispatch(sess: unison.Session) -> None:
    """The dispatch workload of benchmarks/run.py: a call, then sync (the Ref is dropped)."""
    sess.call(noop)
    sess.sync()


def dispatch_looked(sess: unison.Session) -> Callable[[], None]:
    """dispatch, then the death look sync used to make once its workers were done."""
    chan = sess._chan
    if not isinstance(chan, shm.ShmChannel):
        raise RuntimeError("--death-look needs the shm channel (Session(n) on Linux/x86)")
    look = chan._death_seen

    def once() -> None:
        dispatch(sess)
        look()
    return once


def measure(n: int, seconds: float, rounds: int, kinds: tuple[str, ...] = KINDS
            ) -> dict[str, list[int]]:
    """Each kind's round trips (ns), the kinds in turns."""
    floor = make_system("floor")
    floor.start(n)
    try:
        with unison.Session(n) as sess:
            ops: dict[str, Callable[[], object]] = {
                "floor": floor.dispatch,
                "channel run": channel_run(sess),
                "channel quick": channel_run(sess, quick=True),
                "run": lambda: sess.run(noop),
                "channel dispatch": channel_dispatch(sess),
                "dispatch": lambda: dispatch(sess),
                "dispatch + look": dispatch_looked(sess),
            }
            turn = Loop(warmup=200, min_iters=50, max_iters=1 << 30, budget_s=seconds / rounds)
            samples: dict[str, list[int]] = {k: [] for k in kinds}
            for _ in range(rounds):
                for kind in kinds:
                    samples[kind] += time_loop(ops[kind], turn)
    finally:
        floor.close()
    return samples


def phases(n: int, rounds: int = 20000) -> dict[str, dict[str, float]]:
    """Median µs of each phase of ``run`` and ``dispatch`` (see the module's docstring);
    dispatch has no "after": its wait is sync's, which ends the round."""
    clock = time.perf_counter_ns
    marks = {"sent": 0, "got": 0}
    out: dict[str, dict[str, float]] = {}
    with unison.Session(n) as sess:
        chan = sess._chan
        send, recv, quick = chan.send, chan.recv, chan.plain_values
        send_plain = chan.send_plain

        def timed_send(*args: Any, **kwargs: Any) -> None:
            marks["send"] = clock()
            send(*args, **kwargs)
            marks["sent"] = clock()

        def timed_send_plain(data: bytes, ranks: tuple[int, ...]) -> bool:
            marks["send"] = clock()
            sent = send_plain(data, ranks)
            marks["sent"] = clock()
            return sent

        def timed_recv(*args: Any, **kwargs: Any) -> Any:
            got = recv(*args, **kwargs)
            marks["got"] = clock()
            return got

        def timed_quick(*args: Any, **kwargs: Any) -> Any:
            got = quick(*args, **kwargs)
            marks["got"] = clock()
            return got

        chan.send, chan.recv = timed_send, timed_recv  # type: ignore[method-assign]
        chan.plain_values = timed_quick  # type: ignore[method-assign]
        chan.send_plain = timed_send_plain  # type: ignore[method-assign]
        for name, op in (("run", lambda: sess.run(noop)), ("dispatch", lambda: dispatch(sess))):
            for _ in range(1000):
                op()
            split: dict[str, list[int]] = {k: [] for k in PHASES}
            gc.collect()
            gc.disable()
            try:
                for _ in range(rounds):
                    t0 = clock()
                    op()
                    t1 = clock()
                    last = marks["got"] if name == "run" else t1  # dispatch ends in sync
                    split["total"].append(t1 - t0)
                    split["to send"].append(marks["send"] - t0)
                    split["send"].append(marks["sent"] - marks["send"])
                    split["waiting"].append(last - marks["sent"])
                    if name == "run":
                        split["after"].append(t1 - last)
            finally:
                gc.enable()
            out[name] = {k: statistics.median(v) / 1e3 for k, v in split.items() if v}
    return out


PHASES = ("total", "to send", "send", "waiting", "after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seconds", type=float, default=2.0, help="per kind and N")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--death-look", action="store_true",
                        help="also dispatch with the death look sync no longer makes")
    parser.add_argument("--phases", action="store_true",
                        help="also split run and dispatch into their phases")
    parser.add_argument("--tails", action="store_true",
                        help="also each kind's p99 / median and share of rounds at 3x+")
    args = parser.parse_args()
    kinds = (*KINDS, "dispatch + look") if args.death_look else KINDS
    ring = "C" if shm.NATIVE else "pure-Python (UNISON_PURE=1 or no C build)"
    print(f"CPU: {cpu_model()}; {source_revision()}; shm channel: {ring} ring; "
          "command: python benchmarks/layers.py "
          f"--workers {' '.join(map(str, args.workers))} --seconds {args.seconds} "
          f"--rounds {args.rounds}{' --death-look' if args.death_look else ''}"
          f"{' --phases' if args.phases else ''}{' --tails' if args.tails else ''}\n")
    over = kinds[1:]
    print("| N | " + " | ".join(kinds) + " | " + " | ".join(f"{k} / floor" for k in over) + " |")
    print("|--:|" + "--:|" * (len(kinds) + len(over)))
    tails = {}
    for n in args.workers:
        samples = measure(n, args.seconds, args.rounds, kinds)
        got = {k: statistics.median(v) / 1e3 for k, v in samples.items()}
        tails[n] = {k: tail(v) for k, v in samples.items()}
        cells = [f"{got[k]:.1f}" for k in kinds]
        ratios = [f"{got[k] / got['floor']:.2f}x" for k in over]
        print(f"| {n} | " + " | ".join(cells + ratios) + " |", flush=True)
    if args.tails:
        print("\nTails: p99 / median, and the % of rounds at 3x the median or slower:\n")
        print("| N | " + " | ".join(kinds) + " |")
        print("|--:|" + "--:|" * len(kinds))
        for n, row in tails.items():
            print(f"| {n} | " + " | ".join(f"{row[k][0]:.2f}x, {row[k][1]:.2f}%"
                                         for k in kinds) + " |")
    if args.phases:
        print("\nPhases of one round, median µs (the channel's send and reads timed):\n")
        print("| N | op | " + " | ".join(PHASES) + " |")
        print("|--:|---|" + "--:|" * len(PHASES))
        for n in args.workers:
            for name, split in phases(n).items():
                cells = [f"{split[k]:.1f}" if k in split else "-" for k in PHASES]
                print(f"| {n} | {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
