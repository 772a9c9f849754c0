"""A timeline of every call, and who is slow (issue 13).

    controller                                 worker r
    Session(trace="run.json") or sess.trace()
      start: run(begin) on every worker  ----> events = [], answers its clock (for the offset)
      each message sent:  (t, kind, ids, ranks, bytes)
                                               each call: (ref, req, fn, start, end)
                                               each collective: (call, kind, enter, leave,
                                                                 scope)
      each reply arrived: (t, request, rank, bytes)
      stop: run(collect) on every worker  <--- its events, and off again
      -> Chrome/Perfetto JSON (one track per rank, one for the controller) and Stats

Off by default: then the worker loop and the collectives test one module attribute per
call, and the controller one attribute per message. Times are ``perf_counter_ns``, the
machine's monotonic clock: a worker whose clock read inside the start's round trip shares
the controller's (it runs on this host) and needs no offset, as any estimate would only add
error. Another host's clock is mapped onto the controller's by the midpoint of the shortest
of a few round trips to that worker alone, so it lines up to within half of that.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Stats", "Trace"]

log = logging.getLogger("unison.trace")
_clock = time.perf_counter_ns
PINGS = 5
"""Round trips to a worker on another host, for its clock's offset: the shortest counts."""
LATE_NS = 10_000
"""A straggler came later than this into its collectives, on average: less is the noise of
who wakes first."""
SLOW_NS = 50_000
"""A worker whose median call exceeds the others' by less than this is not called slow."""

# -- the worker's side ---------------------------------------------------------------------

events: list[tuple[Any, ...]] | None = None
"""This worker's events while a trace runs, else None (what the hot paths test)."""


def check_writable(path: str | os.PathLike[str]) -> None:
    """Raise now, where a trace's file cannot be written (a missing folder, no permission),
    rather than after the work it records; the file is left empty until the trace ends.
    A path only: ``open`` takes an int (or ``True``) for a file descriptor, and wrote the
    trace into it, then closed it (stdout, or the session's own ring)."""
    if isinstance(path, (int, bool)) or not isinstance(os.fspath(path), str):
        raise TypeError(f"a trace's path must be a str or os.PathLike of one, not "
                        f"{type(path).__name__} {path!r}")
    with open(path, "w", encoding="utf-8"):
        pass


def begin() -> int:
    """Run on every worker when a trace starts: record from now; our clock, for the offset."""
    global events
    events = []
    return _clock()


def collect() -> list[tuple[Any, ...]]:
    """Run on every worker when a trace stops: what was recorded, and stop recording."""
    global events
    out, events = events or [], None
    # the calls name their functions now, off the hot path (a new list: the loop still
    # appends this very call to the old one)
    return [(e[0], e[1], e[2], _name(e[3]), *e[4:]) if e[0] == "call" else e for e in out]


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


@contextmanager
def collective(kind: str, scope: int) -> Iterator[None]:
    """Around one collective on a worker, while a trace runs. ``scope``: -1 for the world,
    else the worker's group (the groups' collectives of one call are apart)."""
    from unison.worker import _current

    start = _clock()
    try:
        yield
    finally:
        if events is not None:
            events.append(("coll", _current[0], kind, start, _clock(), scope))


# -- the controller's side -----------------------------------------------------------------


@dataclass
class Stats:
    """What a trace says about speed: per rank and per call, and the straggler, if any.

    Entry time into collectives reveals the slow rank (the others wait inside the op for
    it, so op time hides it): ``late_ms`` sums, per rank, how long after the median rank it
    arrived; ``last_in`` counts the collectives it entered last."""

    calls: int
    per_rank: dict[int, dict[str, float]]
    """rank -> {"calls", "busy_ms", "median_call_ms", "max_call_ms"}."""
    collectives: int
    last_in: dict[int, int]
    late_ms: dict[int, float]
    """rank -> ms it entered collectives after the median rank did, summed over them."""
    straggler: int | None
    """The rank whose lateness into collectives outweighs all the others' together (over
    at least 3 collectives), else None."""
    slowest: list[tuple[str, float]] = field(default_factory=list)
    """The five slowest calls: (what, ms from first start to last end)."""

    def __str__(self) -> str:
        lines = [f"{self.calls} calls, {self.collectives} collectives"]
        for rank, row in sorted(self.per_rank.items()):
            lines.append(f"  rank {rank}: {int(row['calls'])} calls, busy {row['busy_ms']:.1f} ms, "
                         f"median {row['median_call_ms']:.3f} ms, max {row['max_call_ms']:.3f} ms, "
                         f"last into {self.last_in.get(rank, 0)} collectives, "
                         f"{self.late_ms.get(rank, 0.0):.1f} ms late in all")
        if self.straggler is not None:
            lines.append(f"  straggler: rank {self.straggler}, {self.late_ms[self.straggler]:.1f}"
                         f" ms late into {self.collectives} collectives (last into "
                         f"{self.last_in.get(self.straggler, 0)})")
        return "\n".join(lines)


class Trace:
    """One recording: the controller's events, then the workers' once it stopped."""

    def __init__(self, num_workers: int, path: str | os.PathLike[str] | None = None,
                 straggler_factor: float | None = 2.0) -> None:
        self.path = None if path is None else os.path.abspath(path)
        """Where the trace is written at its end: made absolute at its start, where the
        file was checked and emptied (a chdir in between wrote it elsewhere)."""
        self.num_workers = num_workers
        self.straggler_factor = straggler_factor
        self.sent: list[tuple[int, Any, int, tuple[int, ...], int]] = []
        """(time, kind or its protocol builder, request or ref id, ranks, bytes) per
        message."""
        self.replies: list[tuple[int, int, int, int]] = []
        """(time, request id, rank, bytes) per reply."""
        self.workers: dict[int, list[tuple[Any, ...]]] = {}
        self.offsets: dict[int, int] = {}
        """rank -> what to add to its clock to read the controller's."""
        self.start_ns = _clock()
        self.end_ns = 0

    # the hot paths call these two while the trace runs
    def on_message(self, sent: int, build: Any, fields: tuple[Any, ...],
                   ranks: tuple[int, ...], nbytes: int) -> None:
        """A message as the session built it (``build``: a protocol builder), its send
        begun at ``sent``: named, and matched to its request, when the trace is read."""
        ident = fields[4] if len(fields) == 5 and fields[4] else fields[0]
        self.sent.append((sent, build, ident, ranks, nbytes))

    def on_reply(self, req_id: int, rank: int, data: Any) -> None:
        """``data``: the reply, bytes or a channel's Reply (its pickle and buffers)."""
        size = len(data) if type(data) is bytes else _size(data)
        self.replies.append((_clock(), req_id, rank, size))

    def set_offsets(self, sent: int, clocks: Sequence[int], ranks: Sequence[int], back: int,
                    ping: Callable[[int], tuple[int, int, int]] | None = None) -> None:
        """Each worker's offset from its clock read during one round trip to all of them
        (``sent`` to ``back``): 0 where that reading lies inside the round trip (the same
        clock, or one that 0 fits as well as any other guess); else the midpoint of the
        shortest of PINGS round trips to it alone (``ping(rank)``: sent, its clock, back).
        The midpoint of the first round trip was off by up to half of it, milliseconds on a
        busy machine, and named stragglers that were none."""
        for rank, clock in zip(ranks, clocks):
            if sent <= clock <= back:
                self.offsets[rank] = 0
                continue
            trips = [(back - sent, sent, clock, back)]
            if ping is not None:
                trips += [(b - s, s, c, b) for s, c, b in map(ping, [rank] * PINGS)]
            _, s, c, b = min(trips)
            self.offsets[rank] = (s + b) // 2 - c

    def add_worker(self, rank: int, evs: list[tuple[Any, ...]]) -> None:
        off = self.offsets.get(rank, 0)
        shifted = []
        for ev in evs:
            if ev[0] == "call":  # ("call", ref, req, name, start, end)
                shifted.append((*ev[:4], ev[4] + off, ev[5] + off))
            else:  # ("coll", call, kind, enter, leave, scope)
                shifted.append((*ev[:3], ev[3] + off, ev[4] + off, ev[5]))
        self.workers[rank] = shifted

    # -- what it says ----------------------------------------------------------------------

    def chrome(self) -> dict[str, Any]:
        """The Chrome/Perfetto trace: pid 1, tid 0 the controller, tid r+1 worker r."""
        t0 = self.start_ns

        def us(t: int) -> float:
            return (t - t0) / 1000.0

        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 1, "tid": 0,
             "args": {"name": "unison session"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 0,
             "args": {"name": "controller"}},
        ]
        for rank in range(self.num_workers):
            out.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": rank + 1,
                        "args": {"name": f"worker {rank}"}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": rank + 1,
                        "args": {"sort_index": rank + 1}})
        arrivals: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
        for t, req, rank, nbytes in self.replies:
            arrivals[req].append((t, rank, nbytes))
        for t, kind, ident, ranks, nbytes in self.sent:
            if not isinstance(kind, str):  # a protocol builder, as on_message kept it
                kind = kind.__name__.removesuffix("_msg")
            done = arrivals.get(ident)
            if done:  # a request: from its message to its last reply
                end = max(a[0] for a in done)
                out.append({"name": kind, "cat": "request", "ph": "X", "pid": 1, "tid": 0,
                            "ts": us(t), "dur": max(us(end) - us(t), 0.001),
                            "args": {"id": ident, "ranks": list(ranks), "bytes_sent": nbytes,
                                     "bytes_back": sum(a[2] for a in done)}})
            else:
                out.append({"name": kind, "cat": "message", "ph": "i", "s": "t", "pid": 1,
                            "tid": 0, "ts": us(t),
                            "args": {"id": ident, "ranks": list(ranks), "bytes": nbytes}})
        for t, req, rank, nbytes in self.replies:
            out.append({"name": "reply arrived", "cat": "reply", "ph": "i", "s": "t", "pid": 1,
                        "tid": rank + 1, "ts": us(t), "args": {"request": req, "bytes": nbytes}})
        for rank, evs in self.workers.items():
            for ev in evs:
                if ev[0] == "call":
                    _, ref, req, name, start, end = ev
                    out.append({"name": name, "cat": "call", "ph": "X", "pid": 1,
                                "tid": rank + 1, "ts": us(start),
                                "dur": max(us(end) - us(start), 0.001),
                                "args": {"ref": ref, "request": req}})
                else:
                    _, call, kind, enter, leave, scope = ev
                    args = {"call": call} if scope < 0 else {"call": call, "group": scope}
                    out.append({"name": kind, "cat": "collective", "ph": "X", "pid": 1,
                                "tid": rank + 1, "ts": us(enter),
                                "dur": max(us(leave) - us(enter), 0.001), "args": args})
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"unison": "trace", "workers": self.num_workers}}

    def write(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.chrome(), f)

    def stats(self) -> Stats:
        per: dict[int, list[float]] = defaultdict(list)
        spans: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        names: dict[tuple[int, int], str] = {}
        # one collective: the k-th of its kind in a call and scope (each group's own)
        entries: dict[tuple[int, int, str, int], dict[int, int]] = defaultdict(dict)
        for rank, evs in self.workers.items():
            counters: Counter[tuple[int, str, int]] = Counter()
            for ev in evs:
                if ev[0] == "call":
                    _, ref, req, name, start, end = ev
                    per[rank].append((end - start) / 1e6)
                    spans[(ref, req)].append((start, end))
                    names[(ref, req)] = name
                else:
                    _, call, kind, enter, _leave, scope = ev
                    k = counters[(call, kind, scope)]
                    counters[(call, kind, scope)] += 1
                    entries[(call, k, kind, scope)][rank] = enter
        last_in: Counter[int] = Counter()
        late: Counter[int] = Counter()  # ns each rank came after the median arrival
        full = 0
        for by_rank in entries.values():
            if len(by_rank) < 2:
                continue
            full += 1
            last_in[max(by_rank, key=by_rank.__getitem__)] += 1
            middle = _median(by_rank.values())
            for rank, enter in by_rank.items():
                late[rank] += max(0, int(enter - middle))
        straggler = None
        total = sum(late.values())
        if full >= 3 and total > 0:
            rank, worst = late.most_common(1)[0]
            # more than all the others' lateness together, and more than who wakes first
            if worst * 2 > total and worst > LATE_NS * full:
                straggler = rank
        per_rank = {r: {"calls": float(len(d)), "busy_ms": sum(d),
                        "median_call_ms": _median(d), "max_call_ms": max(d)}
                    for r, d in per.items() if d}
        slowest = sorted(((f"{names[k]} (ref {k[0]}, request {k[1]})",
                           (max(e for _, e in v) - min(s for s, _ in v)) / 1e6)
                          for k, v in spans.items()), key=lambda x: -x[1])[:5]
        stats = Stats(calls=len(spans), per_rank=per_rank, collectives=full,
                      last_in=dict(last_in), late_ms={r: v / 1e6 for r, v in late.items()},
                      straggler=straggler, slowest=slowest)
        self._warn()
        return stats

    def _warn(self) -> None:
        """Warn of a worker whose calls take ``straggler_factor`` times its peers' in the
        same calls: its median over the calls several ranks ran, against the median of
        its peers' times in each of those calls (a median over whatever calls each rank
        got compared one worker's 5 ms calls with its peer's empty ones)."""
        factor = self.straggler_factor
        if factor is None:
            return
        calls: dict[tuple[int, int], dict[int, int]] = defaultdict(dict)
        for rank, evs in self.workers.items():
            for ev in evs:
                if ev[0] == "call":
                    calls[(ev[1], ev[2])][rank] = ev[5] - ev[4]
        own: dict[int, list[float]] = defaultdict(list)
        peers: dict[int, list[float]] = defaultdict(list)
        for times in calls.values():
            if len(times) > 1:
                for rank, t in times.items():
                    own[rank].append(t)
                    peers[rank].append(_median(v for r, v in times.items() if r != rank))
        for rank in sorted(own):
            m, middle = _median(own[rank]), _median(peers[rank])
            if m > factor * middle and m - middle > SLOW_NS:
                log.warning("unison: worker %d is slow: its median call took %.3f ms, %s "
                            "its peers' median in the same calls (%.3f ms)", rank, m / 1e6,
                            f"{m / middle:.1f}x" if middle else "against", middle / 1e6)


def _size(data: Any) -> int:
    """A reply's bytes: a memoryview, or a Reply (its pickle and out-of-band buffers)."""
    if isinstance(data, tuple):
        return len(data[0]) + sum(memoryview(b).nbytes for b in data[1])
    return memoryview(data).nbytes


def _median(values: Iterable[float]) -> float:
    """statistics.median, without importing statistics (and with it fractions, decimal and
    random) into every worker."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
