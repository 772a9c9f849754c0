"""The session layer's round trips rebuilt in one frame, then one piece of the session put
back at a time, against the floor, in turns (issue 9: "build up from the floor one piece at
a time").

    python benchmarks/session_parts.py --workers 2 4 [--seconds 0.25] [--rounds 18]

layers.py says how much the session layer adds to the channel's round trip; this says
which of its pieces the time goes to. Each kind is a round trip on one live Session (the shm
channel, its C ring), in turns with the floor and with each other, in an order that rotates
and reverses from one round to the next (the first turn after a switch runs slower):

    floor             the floor system's dispatch or gather_small (harness/systems/floor.py)
    dispatch          ``sess.call(noop)`` then ``sess.sync()``: the product
    lean dispatch     the same steps written out in this one frame: the send lock, the
                      function's id (FunctionCache.last), the id counter, the frees taken,
                      the CALL marshalled as protocol.call_msg does it, the C ring's send,
                      the Ref made and dropped; then the router's idle test, the C look at
                      the done positions (and the death look where they are done at once),
                      the spin, and the test for unreported errors
    + <piece>         lean dispatch with one piece done by the session's own function:
                      ``lookup`` (FunctionCache.lookup), ``take_frees``
                      (Session._take_frees), ``call_msg`` (protocol.call_msg), ``send``
                      (ShmChannel.send in place of the C ring's send_plain), ``settled``
                      (ShmChannel.settled in place of the look and spin),
                      ``pop_earliest`` (Unreported.pop_earliest, below the id the
                      sync takes at its start)
    run               ``sess.run(noop)``
    lean run          run's quick path in this one frame: ids, the CALL, the C send, the
                      core handed over, then the C look that reads and decodes every reply
                      (Sender.values) and the spin
    + request         lean run with the router's bookkeeping: a Request, Router.expect,
                      and each rank's FIFO popped
    + recv lock       lean run holding the router's receive lock around its read

Each kind's median of its turns' medians, in µs, and over the floor's. The lean kinds skip
checks that cannot fail here (no trace, no deadline, one thread, every worker alive); they
are not a faster session, but what the pieces cost where a round trip pays them: in a round
at N=2 a piece costs more than its own time in a loop (python_cost.py), as the workers that
share the core evict what it touches.
"""

from __future__ import annotations

import argparse
import marshal
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import unison
from harness.measure import Loop, time_loop
from harness.report import cpu_model, source_revision
from harness.systems import make_system
from unison import pacing, protocol
from unison.channel import shm
from unison.refs import Ref
from unison.session.router import Request

DISPATCH_PIECES = ("lookup", "take_frees", "call_msg", "send", "settled", "pop_earliest")
RUN_PIECES = ("request", "recv lock")


def noop() -> None:
    pass


def lean_dispatch(sess: unison.Session, piece: str = "") -> Callable[[], None]:
    """``call(noop)`` and ``sync()`` in one frame, with ``piece`` done by the session's own
    function (see the module's docstring)."""
    chan: Any = sess._chan
    fast, fns, errors, router = chan._fast, sess._fns, sess._errors, sess._router
    ranks, lock, ids, frees = sess.workers, sess._send_lock, sess._ids, sess._frees
    mask = chan._masks[ranks]
    sess.run(noop)  # the workers hold noop, and the cache has it last
    spin, budget, busy = pacing.spin, pacing.SPIN, chan._busy

    def once() -> None:
        lock.acquire()
        try:
            fn_id = (fns.last_id if piece != "lookup" and fns.last is noop
                     else fns.lookup(noop)[0])
            ref_id = next(ids)
            taken: tuple[int, ...] | None = None
            if piece == "take_frees":
                taken = sess._take_frees() if frees else None
            elif frees:
                out = []
                while frees:
                    out.append(frees.popleft())
                taken = tuple(out)
            if piece == "call_msg":
                msg = protocol.call_msg(taken, ref_id, fn_id, None, None, 0)
            else:
                msg = marshal.dumps((protocol.CALL, taken, ref_id, fn_id, None, None, 0),
                                    protocol.PLAIN)
            if piece == "send" or not fast.send(msg, ranks):
                chan.send(msg, ranks)
        finally:
            lock.release()
        Ref(sess, ref_id, ranks)  # dropped at once: its free rides with the next call
        if not router.idle(ranks):
            raise RuntimeError("a request is in flight: the lean round cannot go on")
        if piece == "settled":
            while not chan.settled(ranks, 1.0):
                sess.check_alive("waiting in benchmarks/session_parts.py")
        else:
            mark = fast.wpos
            got = fast.settled(mask, mark)
            if got:
                if chan._death_seen():
                    sess.check_alive("waiting in benchmarks/session_parts.py")
            else:
                got = spin(fast.settled, budget, busy, mask, mark)
            while not got:  # a long wait: the channel's own
                got = chan._wait_progress(ranks, mark, 1.0)
                sess.check_alive("waiting in benchmarks/session_parts.py")
            if got != 1:
                raise RuntimeError("a worker holds an error nobody fetched")
        if piece == "pop_earliest":  # with the floor the sync takes at its start
            if errors.pop_earliest(ranks, next(ids)) is not None:
                raise RuntimeError("a worker reported an error")
        elif errors._errors:
            raise RuntimeError("a worker reported an error")
    return once


def lean_run(sess: unison.Session, piece: str = "") -> Callable[[], list[Any]]:
    """``run(noop)``'s quick path in one frame, with ``piece`` done as the session does it."""
    chan: Any = sess._chan
    fast, router = chan._fast, sess._router
    ranks, lock, ids, expect = sess.workers, sess._send_lock, sess._ids, sess._router._expect
    recv_lock, pos, partial = router.recv_lock, chan._reply_pos, chan._partial
    sess.run(noop)
    fn_id = sess._fns.lookup(noop)[0]
    spin, budget, busy, hand_over = pacing.spin, pacing.SPIN, chan._busy, pacing.hand_over

    def once() -> list[Any]:
        req_id = next(ids)
        req = Request(req_id, len(ranks)) if piece == "request" else None
        lock.acquire()
        try:
            ref_id = next(ids)
            if req is not None:
                req.ref_id = ref_id
                router.expect(req, ranks)
            msg = marshal.dumps((protocol.CALL, None, ref_id, fn_id, None, None, req_id),
                                protocol.PLAIN)
            if not fast.send(msg, ranks):
                chan.send(msg, ranks)
        finally:
            lock.release()
        if piece == "recv lock" and not recv_lock.acquire(False):
            raise RuntimeError("another thread reads: the lean round cannot go on")
        try:
            if not busy:
                hand_over()
            got = fast.values(pos, ranks, req_id, partial)
            while type(got) is not list:
                if got is True:
                    raise RuntimeError("a reply that is not a plain value")
                got = spin(fast.values, budget, busy, pos, ranks, req_id, partial)
                if got is False:
                    sess.check_alive("waiting in benchmarks/session_parts.py")
                    got = fast.values(pos, ranks, req_id, partial)
            if req is not None:
                for r in ranks:
                    expect[r].popleft()
                req.remaining = 0
            return got
        finally:
            if piece == "recv lock":
                recv_lock.release()
    return once


def kinds(sess: unison.Session, floor: Any) -> dict[str, dict[str, Callable[[], object]]]:
    """Each family's kinds: the floor first, then the product, the lean, the pieces."""
    def product_dispatch() -> None:
        sess.call(noop)
        sess.sync()

    dispatch: dict[str, Callable[[], object]] = {
        "floor": floor.dispatch, "dispatch": product_dispatch,
        "lean dispatch": lean_dispatch(sess)}
    dispatch.update({f"+ {p}": lean_dispatch(sess, p) for p in DISPATCH_PIECES})
    run: dict[str, Callable[[], object]] = {
        "floor": floor.gather_small, "run": lambda: sess.run(noop), "lean run": lean_run(sess)}
    run.update({f"+ {p}": lean_run(sess, p) for p in RUN_PIECES})
    return {"dispatch": dispatch, "run": run}


def measure(n: int, seconds: float, rounds: int) -> dict[str, dict[str, float]]:
    """Each family's kinds: the median of their turns' medians, in ns."""
    floor = make_system("floor")
    floor.start(n)
    try:
        with unison.Session(n) as sess:
            if not isinstance(sess._chan, shm.ShmChannel) or sess._chan._fast is None:
                raise SystemExit("session_parts.py needs the shm channel's C ring "
                                 "(Session(n) on Linux, _ring built, UNISON_PURE unset)")
            out = {}
            turn = Loop(warmup=200, min_iters=50, max_iters=1 << 30, budget_s=seconds)
            for family, ops in kinds(sess, floor).items():
                names = list(ops)
                got: dict[str, list[float]] = {k: [] for k in names}
                for i in range(rounds):
                    order = names[i % len(names):] + names[:i % len(names)]
                    if i % 2:
                        order.reverse()
                    for k in order:
                        got[k].append(statistics.median(time_loop(ops[k], turn)))
                out[family] = {k: statistics.median(v) for k, v in got.items()}
    finally:
        floor.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seconds", type=float, default=0.25, help="per turn")
    parser.add_argument("--rounds", type=int, default=18)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}; {source_revision()}; command: python "
          f"benchmarks/session_parts.py --workers {' '.join(map(str, args.workers))} "
          f"--seconds {args.seconds} --rounds {args.rounds}\n")
    print("| N | family | kind | µs | / floor | / lean |")
    print("|--:|---|---|--:|--:|--:|")
    for n in args.workers:
        for family, got in measure(n, args.seconds, args.rounds).items():
            lean = got[f"lean {family}"]
            for kind, ns in got.items():
                print(f"| {n} | {family} | {kind} | {ns / 1e3:.2f} | "
                      f"{ns / got['floor']:.2f}x | {ns / lean:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
