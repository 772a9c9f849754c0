"""Fuzzing the shared-memory channel's decoders (issue 14): every place where one process
reads bytes that another one wrote into shared memory gets malformed, truncated and
oversized input, in both rings (the C fast paths, unison/_ring.c, and the pure-Python
ones, UNISON_PURE=1).

    decoder                                        what a rogue writer controls
    controller: reply rings (C values and          reply_write, each entry's header word
      collect, then _collect_py, _unpack_reply,    (size, chunk/indirect flags, descriptor
      _unpack_descs)                               count), the body, wrap markers
    controller: ArenaReader.view / map_block       descriptors (offset, length, slot|flags)
    worker: command ring (C take, then _recv)      cmd_write, header (size, buffer count,
                                                   flags), rank mask, payload, descriptors
    both: protocol.loads of the payload            the pickle, its out-of-band buffers

What is claimed, and checked here: no input crashes the reading process (no SIGSEGV or
SIGBUS: nothing is read outside a ring or mapped past the arena's end), hangs it (each
read is bounded: every step moves toward the published position, which may not be more
than a ring ahead), or makes it deliver bytes from outside a well-framed entry. A
controller that meets a malformed reply entry ends that worker's stream there, as a closed
TCP connection does: ``(rank, None)`` once, after every valid reply before it, with the
reason in ``channel.where(rank)`` (the session turns it into WorkerDied and kills the
worker); the other workers' rings are untouched. A worker that meets a malformed command
raises ``Malformed`` (an OSError) and leaves. A malformed frame is never unpickled, so a
pickle that would run code inside one never runs (the marker cases below).

What is not claimed: the payload of a *well-framed* entry is unpickled with the full
pickle (protocol.loads), on both sides, as it must be to carry any user object back; a
worker is the user's own code, run as the same user, and is trusted like it (it could
equally ptrace the controller). Garbage pickles raise an ordinary exception there (the
router turns it into a TypeError for that call), which the payload target checks; a
truncated but well-framed pickle may run the part of it that came. Nor are the progress
words (done, unreported, cmd_read) validated: garbage there makes ``sync`` early or slow,
never a crash.

Every example runs in a child process (this file is also a script), so that a crash is a
failed test that names the last input instead of a dead test run; each ring gets one child.
benchmarks/fuzz_long.py runs the same targets for a long budget.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import faulthandler
import gc
import json
import os
import pickle
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unison import _native, protocol
from unison.channel import Reply
from unison.channel import shm as shm_mod
from unison.channel.arena import (
    MIN_BLOCK,
    SLOTS,
    WRITABLE,
    Arena,
    ArenaReader,
    Malformed,
    counters_size,
    default_size,
)
from unison.channel.shm import (
    _DESC,
    _ENTRY,
    _INDIRECT,
    _MORE,
    _NDESC,
    _OOB,
    _WRAP,
    CMD_RING,
    REPLY_RING,
    ShmChannel,
    ShmWorkerChannel,
)

pytestmark = pytest.mark.timeout(240)

U64 = (1 << 64) - 1
CI_EXAMPLES = 200
"""Examples per target and ring in CI: each ring runs every target in one child, ~8 s
on 2 busy cores (the whole file ~25 s)."""
RECV_BOUND = 5.0
"""Seconds one read may take, whatever it reads (they take micro- to milliseconds)."""
HANG = 20.0
"""Seconds one example may take before the child dumps its stacks and exits (a loop in C
holds the GIL: only faulthandler's own thread can still tell)."""
DATA_LIMIT = 6 << 30
"""The child's private memory limit (the arenas are shared mappings: not counted)."""
TARGETS = ("reply_ring", "command_ring", "arena_descriptors", "payload", "known_bad")

_REPLY_ARENA = counters_size(1) + default_size()  # the size of a worker's reply arena file
_CMD_ARENA = counters_size(2) + default_size()


# -- the pair under test: a real ShmChannel and both workers' ends, in this process ----------


class _CaughtUp(Exception):
    """The worker reached the controller's position and would sleep: legitimately."""


@contextlib.contextmanager
def _pair(cmd_start: int = 0, reply_start: int = 0
          ) -> Iterator[tuple[ShmChannel, list[ShmWorkerChannel]]]:
    """Two workers' channel, its rings' positions moved to ``*_start`` first (so that the
    entries meet a ring's end and wrap), each worker's sleep replaced by ``_CaughtUp``."""
    chan = ShmChannel(2, f"unison-fuzz-{os.getpid()}")
    workers: list[ShmWorkerChannel] = []
    try:
        q, lay = chan._q, chan._lay
        q[0] = chan._head.wpos = cmd_start
        chan._head.limit = cmd_start + CMD_RING
        for r in range(2):
            q[lay.cmd_read[r] // 8] = q[lay.done[r] // 8] = cmd_start
            q[lay.reply_write[r] // 8] = q[lay.reply_read[r] // 8] = reply_start
            chan._reply_pos[r] = reply_start
        for r in range(2):
            w = ShmWorkerChannel(chan.endpoint(r)[0])

            def caught_up(pos: int, w: ShmWorkerChannel = w) -> None:
                assert w._q[0] == pos, "a worker slept before it had read up to cmd_write"
                raise _CaughtUp

            w._wait = caught_up  # type: ignore[method-assign]
            workers.append(w)
        yield chan, workers
    finally:
        workers.clear()
        chan.close()


def _timed(fn: Callable[[], Any]) -> Any:
    start = time.monotonic()
    try:
        return fn()
    finally:
        took = time.monotonic() - start
        assert took < RECV_BOUND, f"one read took {took:.1f} s"


def _drain(chan: ShmChannel) -> list[tuple[int, bytes | Reply | None]]:
    """Everything the controller reads now; the rings are bounded, so this ends."""
    out: list[tuple[int, bytes | Reply | None]] = []
    for _ in range(50):
        got = _timed(lambda: chan.recv(0.0))
        if not got:
            return out
        out.extend(got)
    raise AssertionError("the controller kept finding replies in a ring nobody writes")


def _take(w: ShmWorkerChannel, limit: int = 300_000) -> tuple[list[Any], BaseException | None]:
    """Every command the worker reads until it catches up or refuses one."""
    out: list[Any] = []
    for _ in range(limit):
        try:
            got = _timed(w.recv)
        except _CaughtUp:
            return out, None
        except OSError as exc:  # Malformed, or a mapping the kernel refused
            return out, exc
        assert got is not None
        out.append(got)
    raise AssertionError("the worker kept finding commands in a ring nobody writes")


def _touch(view: Any) -> None:
    """Read the first and last byte: a mapping past the file's end raises SIGBUS here."""
    mv = memoryview(view).cast("B")
    if mv.nbytes:
        _ = mv[0] + mv[-1]


def _as_bytes(item: bytes | Reply | None) -> Any:
    if isinstance(item, Reply):
        return ("reply", bytes(item.data), [bytes(b) for b in item.buffers])
    return item


def _router_decode(item: bytes | Reply | None) -> None:
    """What the session does with a reply: unpickle it; garbage must raise an Exception."""
    if item:
        with contextlib.suppress(Exception):
            protocol.loads(item)


# -- strategies --------------------------------------------------------------------------------


def _starts(ring: int) -> st.SearchStrategy[int]:
    near_end = st.tuples(st.integers(1, 4), st.sampled_from([8, 16, 64, 512, 4096, 300_000]))
    return st.one_of(
        st.just(0),
        near_end.map(lambda t: t[0] * ring - t[1]),
        st.integers(0, 1 << 58).map(lambda x: x * 8),
    )


u64 = st.one_of(
    st.integers(0, U64),
    st.integers(0, 1 << 21),
    st.sampled_from([0, 8, 24, REPLY_RING - 8, REPLY_RING, CMD_RING, (1 << 32) - 1, 1 << 32,
                     1 << 63, U64 - 7, U64]),
)
delta = st.one_of(st.integers(-64, 64).map(lambda d: d * 8), st.integers(-(1 << 21), 1 << 22))


def _descs(arena_size: int, low: int) -> st.SearchStrategy[tuple[int, int, int]]:
    offset = st.one_of(u64, st.integers(low - 4096, low + (1 << 20)),
                       st.integers(arena_size - (1 << 17), arena_size + 4096))
    length = st.one_of(st.integers(0, 1 << 17), u64, st.sampled_from([arena_size, 4096]))
    slot = st.one_of(st.integers(0, SLOTS + 2), u64, st.integers(0, 8).map(lambda s: s | WRITABLE))
    return st.tuples(offset, length, slot)


reply_desc = _descs(_REPLY_ARENA, counters_size(1))
cmd_desc = _descs(_CMD_ARENA, counters_size(2))

reply_op = st.one_of(
    st.tuples(st.just("reply"), st.binary(max_size=200)),
    st.tuples(st.just("plain"), st.integers(0, U64 >> 1),
              st.one_of(st.none(), st.integers(), st.text(max_size=50), st.binary(max_size=200))),
    st.tuples(st.just("ack"), st.just(b"")),
    st.tuples(st.just("part"), st.binary(max_size=100)),
    st.tuples(st.just("buffers"), st.binary(max_size=50),
              st.lists(st.binary(max_size=100), min_size=1, max_size=3)),
    st.tuples(st.just("indirect"), st.integers(0, 255)),
    st.tuples(st.just("chunked"), st.integers(0, 255)),
)
reply_bad = st.one_of(
    st.tuples(st.just("none")),
    st.tuples(st.just("head"), u64, st.binary(max_size=64), delta),
    st.tuples(st.just("end"), u64),
    st.tuples(st.just("descs"),
              st.sampled_from([1 << _NDESC, 2 << _NDESC, 3 << _NDESC, _INDIRECT,
                               _INDIRECT | 1 << _NDESC, _INDIRECT | _MORE, 1 << 34,
                               (1 << 24 - 1) << _NDESC]),
              st.lists(reply_desc, min_size=1, max_size=3), st.binary(max_size=40),
              st.one_of(st.none(), delta)),
    st.tuples(st.just("wrap"), delta),
)

cmd_op = st.tuples(
    st.sampled_from(["send", "bufs", "big"]), st.binary(max_size=300),
    st.lists(st.binary(max_size=100), min_size=1, max_size=3),
    st.sampled_from([(0,), (1,), (0, 1)]),
)
cmd_bad = st.one_of(
    st.tuples(st.just("head"), u64, u64, st.binary(max_size=64), delta),
    st.tuples(st.just("end"), u64),
    st.tuples(st.just("descs"), st.sampled_from([0, _OOB, 2, 0xFFFF]), st.integers(0, 3),
              st.lists(cmd_desc, min_size=1, max_size=4), st.binary(max_size=40), u64,
              st.one_of(st.none(), delta)),
    st.tuples(st.just("wrap"), delta),
)

_leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20),
                    st.binary(max_size=50))


def _arrays() -> st.SearchStrategy[Any]:
    import numpy as np

    return st.tuples(st.sampled_from(["int64", "float32", "uint8", "complex128"]),
                     st.sampled_from([0, 1, 7, 10_000])).map(
        lambda t: np.arange(t[1]).astype(t[0]))


values = st.recursive(_leaves | _arrays(), lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.tuples(kids, kids),
    st.dictionaries(st.text(max_size=5), kids, max_size=3)), max_leaves=8)


# -- the targets -------------------------------------------------------------------------------


def _reply_plain(w: ShmWorkerChannel, msg: tuple[Any, ...]) -> bool:
    """Send ``msg`` as worker.serve sends run's plain value: in one step where the channel
    can (True), else through ``reply`` (False)."""
    if w.reply_plain(msg, protocol.PLAIN):
        return True
    w.reply(protocol.dumps_plain(msg, protocol.PLAIN))
    return False


def _apply_reply_op(chan: ShmChannel, w: ShmWorkerChannel, op: tuple[Any, ...]) -> None:
    kind = op[0]
    if kind == "reply":
        w.reply(op[1])
    elif kind == "plain":
        _reply_plain(w, (op[1], protocol.OK, op[2]))
    elif kind == "ack":
        w.ack()
    elif kind == "part":
        w._put(op[1], _MORE)
    elif kind == "buffers":
        w.reply(op[1], [pickle.PickleBuffer(b) for b in op[2]])
    elif kind == "indirect":
        w.reply(bytes([op[1]]) * (shm_mod._REPLY_INLINE + 1 + op[1]))
    else:  # w._chunked, a part at a time: a worker waits for the controller between parts
        data = bytes([op[1]]) * (REPLY_RING // 2 + op[1])
        step = REPLY_RING // 2 - 8
        w._put(data[:step], _MORE)
        assert _drain(chan) == [], "a part alone was taken as a reply"
        w._put(data[step:], 0)


def _expect_reply(op: tuple[Any, ...], parts: list[bytes]) -> list[Any] | None:
    """What the controller reads after a legitimate op (None: the stream ends, as a reply
    with buffers inside a chunked one is no writer's)."""
    kind = op[0]
    if kind == "part":
        parts.append(op[1])
        return []
    if kind in ("buffers", "indirect") and parts:
        return None
    if kind == "buffers":
        return [("reply", op[1], list(op[2]))]
    if kind == "indirect":
        return [("reply", bytes([op[1]]) * (shm_mod._REPLY_INLINE + 1 + op[1]), [])]
    if kind == "plain":
        data = protocol.dumps_plain((op[1], protocol.OK, op[2]), protocol.PLAIN)
    elif kind in ("reply", "ack"):
        data = op[1]
    else:
        data = bytes([op[1]]) * (REPLY_RING // 2 + op[1])
    joined = b"".join([*parts, data])
    parts.clear()
    return [joined]


def _corrupt_reply(chan: ShmChannel, w: ShmWorkerChannel, bad: tuple[Any, ...]) -> None:
    """Write what a rogue worker 0 would, at its ring's head, and publish a position."""
    q, buf = chan._q, chan._buf
    pos = w._q[w._rw_idx]  # the worker's reply position, written by it alone
    base = chan._lay.reply_ring[0]
    off = pos & (REPLY_RING - 1)
    room = REPLY_RING - off - 8  # body bytes up to the ring's end: never into rank 1's ring
    kind = bad[0]
    if kind == "none":
        return
    if kind == "head":
        q[(base + off) // 8] = bad[1]
        body = bad[2][:room]
        buf[base + off + 8 : base + off + 8 + len(body)] = body
        q[chan._lay.reply_write[0] // 8] = (pos + bad[3]) & U64
    elif kind == "end":
        q[chan._lay.reply_write[0] // 8] = bad[1]
    elif kind == "descs":
        _, flags, descs, payload, moved = bad
        body = shm_mod._pack_descs([tuple(d & U64 for d in x) for x in descs])
        body = (body + payload)[:room]
        q[(base + off) // 8] = len(body) | flags
        buf[base + off + 8 : base + off + 8 + len(body)] = body
        size = shm_mod._align8(8 + len(body)) if moved is None else moved
        q[chan._lay.reply_write[0] // 8] = (pos + size) & U64
    else:
        q[(base + off) // 8] = _WRAP
        q[chan._lay.reply_write[0] // 8] = (pos + bad[1]) & U64


_NOBODY = 0x5EED_5EED_5EED
"""A request id no reply here carries: run's quick path (C values) must read nothing."""


def _no_quick_values(chan: ShmChannel) -> None:
    """run's quick path over whatever the rings hold: no crash, no hang, nothing read (the
    recv that follows checks that)."""
    for ranks in ((0,), (0, 1)):
        assert _timed(lambda ranks=ranks: chan.plain_values(ranks, _NOBODY, 0.0)) is None


def reply_ring(start: int, ops: list[tuple[Any, ...]], bad: tuple[Any, ...]) -> None:
    """The controller reads worker 0's ring: valid replies exactly, then whatever a rogue
    writer put there without a crash or a hang, ending its stream at most once; worker 1's
    ring is not disturbed. Run's quick path looks at each state first, reading nothing."""
    with _pair(reply_start=start) as (chan, (w0, w1)):
        parts: list[bytes] = []
        ended = False
        for op in ops:
            _apply_reply_op(chan, w0, op)
            want = _expect_reply(op, parts)
            _no_quick_values(chan)
            got = _drain(chan)
            if want is None:
                assert got == [(0, None)], (op, got)
                ended = True
                break
            assert [_as_bytes(d) for _, d in got] == want and all(r == 0 for r, _ in got)
        if not ended:
            _corrupt_reply(chan, w0, bad)
        w1.ack()
        _no_quick_values(chan)
        got = _drain(chan)
        assert [(r, d) for r, d in got if r == 1] == [(1, b"")], "worker 1's ring was disturbed"
        mine = [d for r, d in got if r == 0]
        for d in mine:
            assert d is None or isinstance(d, (bytes, Reply))
            if isinstance(d, Reply):
                _touch(d.data)
                for b in d.buffers:
                    _touch(b)
            _router_decode(d)
        if None in mine:
            assert mine.index(None) == len(mine) - 1, "data after the end of a stream"
            assert not ended, "a stream ended twice"
        if ended or None in mine:
            outcomes["reply: stream ended"] += 1
            assert chan.ended() == 0 and "break the format" in chan.where(0)
        else:
            outcomes["reply: read as replies" if mine else "reply: nothing read"] += 1
            assert chan.ended() is None and chan.where(0) == ""
        assert not chan.pending(), "a broken ring still looks like it holds replies"
        assert _drain(chan) == []
        w1.ack()  # worker 1 goes on
        assert _drain(chan) == [(1, b"")]


def _corrupt_command(chan: ShmChannel, bad: tuple[Any, ...]) -> None:
    q, buf = chan._q, chan._buf
    pos = chan._head.wpos
    off = pos & (CMD_RING - 1)
    start = chan._lay.cmd_ring + off
    room = CMD_RING - off - _ENTRY
    kind = bad[0]
    if kind == "head":
        if off + _ENTRY <= CMD_RING:
            q[start // 8], q[start // 8 + 1] = bad[1], bad[2]
            body = bad[3][: max(room, 0)]
            buf[start + _ENTRY : start + _ENTRY + len(body)] = body
        q[0] = (pos + bad[4]) & U64
    elif kind == "end":
        q[0] = bad[1]
    elif kind == "descs":
        _, flags, nbufs, descs, payload, mask, moved = bad
        packed = shm_mod._pack_descs([tuple(d & U64 for d in x) for x in descs])
        oob = flags & _OOB
        body = (packed[:_DESC] if oob else payload) + packed[_DESC if oob else 0 :]
        n = _DESC if oob else len(payload)
        body = body[: max(room, 0)]
        q[start // 8] = n | (nbufs | flags << 16) << 32
        q[start // 8 + 1] = mask | 1  # for worker 0 at least
        buf[start + _ENTRY : start + _ENTRY + len(body)] = body
        size = shm_mod._entry_size(n, nbufs) if moved is None else moved
        q[0] = (pos + size) & U64
    else:
        q[start // 8] = _WRAP
        q[0] = (pos + bad[1]) & U64


def command_ring(start: int, ops: list[tuple[Any, ...]], bad: tuple[Any, ...]) -> None:
    """Both workers read the command ring: valid commands exactly, then whatever a rogue
    controller put there without a crash or a hang, refusing it with Malformed."""
    with _pair(cmd_start=start) as (chan, workers):
        for kind, data, bufs, ranks in ops:
            if kind == "big":
                data = data * (CMD_RING // 4 // max(len(data), 1) + 1) + b"!"
            buffers = [pickle.PickleBuffer(b) for b in bufs] if kind == "bufs" else []
            chan.send(data, ranks, buffers, deadline=time.monotonic() + RECV_BOUND)
            for r, w in enumerate(workers):
                got, err = _take(w)
                assert err is None, err
                want = [(data, bufs if kind == "bufs" else [])] if r in ranks else []
                assert [(bytes(p), [bytes(b) for b in bs]) for p, bs in got] == want
        _corrupt_command(chan, bad)
        for w in workers:
            got, err = _take(w)
            assert err is None or isinstance(err, OSError)
            outcomes[f"command: {'refused' if err else 'read'}"] += 1
            for payload, bs in got:
                _touch(payload)
                for b in bs:
                    _touch(b)


def arena_descriptors(which: str, valid: bool, desc: tuple[int, int, int],
                      jitter: tuple[int, int]) -> None:
    """A descriptor maps exactly its bytes inside the arena, or is refused before anything
    is mapped or counted."""
    n, rank = (1, 0) if which == "reply" else (2, 1)
    arena = Arena(f"unison-fuzz-{os.getpid()}", n)
    try:
        placed = arena.place([b"x" * 100], (rank,))[0]
        reader = ArenaReader(arena.fd, rank, n, shared=which == "reply")
        if valid:  # near a real block
            desc = ((placed[0] + jitter[0]) & U64, (placed[1] + jitter[1]) & U64, placed[2])
        offset, length, slot_flags = desc
        inside = (slot_flags & 0xFFFFFFFF < SLOTS and not slot_flags >> 33
                  and counters_size(n) <= offset and offset + length <= arena.size)
        try:
            mv = reader.view(desc)
        except Malformed:
            assert not inside, desc
            outcomes["descriptor: refused"] += 1
            return
        except OSError:  # the kernel refused a mapping that fits: a clean error too
            assert inside, desc
            outcomes["descriptor: mapping refused by the kernel"] += 1
            return
        assert inside, desc
        outcomes["descriptor: mapped"] += 1
        assert mv.nbytes == length
        _touch(mv)
        if valid and jitter == (0, 0):
            assert bytes(mv) == b"x" * 100
        del mv
    finally:
        arena.close()


def payload(value: Any, status: int, cut: int | None, flips: list[tuple[int, int]],
            drop: int | None, raw: bytes | None) -> None:
    """protocol.loads of a truncated or mutated envelope (and of its nested error pickle),
    with missing or shortened out-of-band buffers: it returns or raises an Exception."""
    if status == protocol.ERR:
        value = protocol.pack_error(ValueError(repr(value)[:100]), "fuzz")
    bufs: list[pickle.PickleBuffer] = []
    data = bytearray(protocol.dumps((7, status, value), bufs))
    if cut is not None:
        del data[cut % (len(data) + 1) :]
    for at, byte in flips:
        if data:
            data[at % len(data)] = byte
    views = [bytes(b.raw()) for b in bufs]
    if drop is not None and views:
        i = drop % len(views)
        views[i] = views[i][: len(views[i]) // 2] if drop % 2 else b""
        if drop > 3:
            del views[i]
    for blob in (bytes(data), raw):
        if blob is None:
            continue
        try:
            got = protocol.loads(Reply(blob, [memoryview(v) for v in views]))
        except Exception:
            outcomes["payload: raised"] += 1
            continue
        outcomes["payload: loaded"] += 1
        if isinstance(got, tuple) and len(got) == 3 and got[1] == protocol.ERR:
            try:
                exc = protocol.unpack_error(got[2])
            except Exception:
                continue
            assert isinstance(exc, BaseException)


# -- known bad inputs: each one crashed, hung or misread before the checks --------------------


class _Mkdir:
    """Pickles as a call that makes a directory: code run by an unpickler, visibly."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.path,))


def _reply_case(setup: Callable[[ShmChannel, ShmWorkerChannel, int], None],
                evil: bool = True) -> None:
    """Worker 0 writes one malformed entry (with a pickle that would run code inside, where
    ``evil``): its stream ends, nothing of it is delivered or unpickled."""
    with tempfile.TemporaryDirectory(prefix="unison-fuzz-") as tmp, _pair() as (chan, (w0, _)):
        marker = os.path.join(tmp, "ran")
        w0.reply(b"before")
        assert _drain(chan) == [(0, b"before")]
        base = chan._lay.reply_ring[0] + (w0._q[w0._rw_idx] & (REPLY_RING - 1))
        if evil:
            blob = pickle.dumps((1, 0, _Mkdir(marker)), protocol=5)
            chan._buf[base + 8 : base + 8 + len(blob)] = blob
        setup(chan, w0, base)
        got = _drain(chan)
        for _, d in got:
            _router_decode(d)
        assert got == [(0, None)], got
        assert "break the format" in chan.where(0) and chan.ended() == 0
        assert not os.path.exists(marker), "a malformed entry was unpickled"


def _bad_reply(head: int | None, end: int, desc: tuple[int, int, int] | None = None
               ) -> Callable[[ShmChannel, ShmWorkerChannel, int], None]:
    """A malformed entry at worker 0's head: its ``head`` word (or a reply with one buffer
    descriptor ``desc``), published up to ``end`` bytes past the head."""

    def setup(chan: ShmChannel, w: ShmWorkerChannel, base: int) -> None:
        if desc is not None:
            chan._buf[base + 8 : base + 32] = shm_mod._pack_descs([desc])
            chan._q[base // 8] = 24 | 1 << _NDESC
        elif head is not None:
            chan._q[base // 8] = head
        chan._q[chan._lay.reply_write[0] // 8] = (w._q[w._rw_idx] + end) & U64

    return setup


KNOWN_REPLY = {
    # C: a copy of 4 GiB from past the mapping (SIGSEGV); Python: a hang (past the end)
    "reply_size_4GiB": _bad_reply(0xFFFFFFF0, 24),
    # both: a hang, reading 2**40 bytes of stale ring as replies
    "reply_position_far_ahead": _bad_reply(None, 1 << 40),
    "reply_position_backwards": _bad_reply(None, -8),
    # both: a hang (the entry ends past the published position, which is never met)
    "reply_entry_past_position": _bad_reply(100, 16),
    "reply_wrap_past_position": _bad_reply(_WRAP, 8),
    "reply_unknown_flags": _bad_reply(60 | 1 << 34, 72),
    # both: SIGBUS at the first touch of a block mapped past the reply arena's end
    "reply_desc_past_arena": _bad_reply(None, 32, (1 << 45, 4096, 0)),
    "reply_desc_straddles_arena_end": _bad_reply(None, 32, (_REPLY_ARENA - 4096, 8192, 0)),
    # both: IndexError in a finalizer (a slot past the counters)
    "reply_desc_bad_slot": _bad_reply(None, 32, (1 << 20, 0, 1 << 31)),
    "reply_desc_in_counters": _bad_reply(None, 32, (0, 4096, 0)),
    "reply_ndesc_past_body": _bad_reply(24 | 5 << _NDESC, 32),
    "reply_indirect_short": _bad_reply(8 | _INDIRECT, 16),
}


def _buffers_inside_a_chunked_reply() -> None:
    with _pair() as (chan, (w0, _)):
        w0._put(b"part", _MORE)
        w0.reply(b"x", [pickle.PickleBuffer(b"buf")])
        assert _drain(chan) == [(0, None)]  # was: a Reply, and "part" glued to a later one


def _command_case(setup: Callable[[ShmChannel, int, int], None]) -> None:
    """The controller writes one malformed command: each worker refuses it (Malformed),
    or (an entry that is not its own) skips it, without a crash or a hang."""
    with _pair() as (chan, workers):
        chan.send(b"before", (0, 1))
        for w in workers:
            assert _take(w) == ([(b"before", [])], None)
        pos = chan._head.wpos
        setup(chan, chan._lay.cmd_ring + (pos & (CMD_RING - 1)), pos)
        got, err = _take(workers[0])
        assert got == [] and isinstance(err, Malformed), (got, err)
        assert "break the format" in str(err) or "outside the arena" in str(err), err


_CommandSetup = Callable[[ShmChannel, int, int], None]


def _bad_command(head: int | None, mask: int, end: int,
                 desc: tuple[int, int, int] | None = None) -> _CommandSetup:
    """A malformed command at the ring's head: ``head`` and rank ``mask`` (or one with a
    buffer descriptor ``desc``), cmd_write ``end`` bytes past it."""

    def setup(chan: ShmChannel, base: int, pos: int) -> None:
        word = head
        if desc is not None:
            chan._buf[base + 16 : base + 40] = shm_mod._pack_descs([desc])
            word = 1 << 32  # no payload, one buffer
        if word is not None:
            chan._q[base // 8], chan._q[base // 8 + 1] = word, mask
        chan._q[0] = (pos + end) & U64

    return setup


KNOWN_COMMAND = {
    # C: a hang (a copy of 4 GiB from past the mapping); Python: 4 MiB of garbage run
    "command_size_4GiB": _bad_command(0xFFFFFFF0, 1, 32),
    # both: the previous command run again (the ring's stale entry, a lap later)
    "command_position_far_ahead": _bad_command(None, 0, 1 << 40),
    "command_position_backwards": _bad_command(None, 0, -16),
    "command_wrap_past_position": _bad_command(_WRAP, 0, 16),
    # both: a hang (an entry for another worker skipped past cmd_write, never met again)
    "command_skip_past_position": _bad_command(48, 2, 16),
    "command_unknown_flags": _bad_command(8 | 1 << 49, 1, 24),
    # both: SIGBUS at the first touch of a buffer mapped past the arena's end
    "command_desc_past_arena": _bad_command(None, 1, 40, (_CMD_ARENA, 4096, 0)),
}


def known_bad() -> int:
    """Every known bad input, once: the number run."""
    count = 0
    for name, setup in KNOWN_REPLY.items():
        _record("known_bad", name)
        _reply_case(setup)
        count += 1
    _record("known_bad", "buffers_inside_a_chunked_reply")
    _buffers_inside_a_chunked_reply()
    for cname, csetup in KNOWN_COMMAND.items():
        _record("known_bad", cname)
        _command_case(csetup)
        count += 1
    return count + 1


# -- running the targets (in a child: this file is a script too) -------------------------------

_last: Any = None
_count = 0
outcomes: collections.Counter[str] = collections.Counter()
"""How the examples ended (a stream ended, a command refused, ...): that the fuzzing
reaches the checks, not only the happy paths."""
_unraisable: list[str] = []


def _record(target: str, example: object) -> None:
    """Keep the input about to run where the parent finds it if this process dies, and
    (re)arm the watchdog for it."""
    if _last is not None:
        faulthandler.dump_traceback_later(HANG, exit=True)
        _last.seek(0)
        _last.write(f"{target}: {example!r}"[:4000])
        _last.truncate()
        _last.flush()


HYPOTHESIS_TARGETS: dict[str, tuple[Callable[..., None], dict[str, Any]]] = {
    "reply_ring": (reply_ring, dict(start=_starts(REPLY_RING),
                                    ops=st.lists(reply_op, max_size=5), bad=reply_bad)),
    "command_ring": (command_ring, dict(start=_starts(CMD_RING),
                                        ops=st.lists(cmd_op, max_size=5), bad=cmd_bad)),
    "arena_descriptors": (arena_descriptors, dict(
        which=st.sampled_from(["reply", "command"]), valid=st.booleans(),
        desc=st.one_of(reply_desc, cmd_desc), jitter=st.tuples(delta, delta))),
    "payload": (payload, dict(
        value=values, status=st.sampled_from([protocol.OK, protocol.ERR]),
        cut=st.one_of(st.none(), st.integers(0, 1 << 20)),
        flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=4),
        drop=st.one_of(st.none(), st.integers(0, 5)), raw=st.one_of(st.none(), st.binary()))),
}
"""Each target: its property (a plain function) and the strategies of its arguments."""


def _counted(target: str, fn: Callable[..., None]) -> Callable[..., None]:
    """``fn``, counting its examples, keeping each one's input first (for a crash), and
    failing one that leaves an exception nobody catches (in a finalizer)."""

    def run(**kwargs: Any) -> None:
        global _count
        _record(target, kwargs)
        _count += 1
        fn(**kwargs)
        if _unraisable:
            text = _unraisable[0]
            _unraisable.clear()
            raise AssertionError(f"an exception was raised where nobody catches it: {text}")

    return run


def run_target(target: str, examples: int, seconds: float, seed: int | None) -> int:
    """Run one target: ``examples`` examples (derandomized, when ``seed`` is None: the same
    ones every run), or rounds of them with seeds from ``seed`` on until ``seconds`` are
    spent. Returns the number of examples run."""
    global _count
    _count = 0
    end = time.monotonic() + seconds
    if target == "known_bad":
        while True:
            _count += known_bad()
            if time.monotonic() >= end:
                return _count
    fn, strategies = HYPOTHESIS_TARGETS[target]
    while True:
        test = settings(max_examples=examples, deadline=None, database=None,
                        derandomize=seed is None, print_blob=True,
                        suppress_health_check=list(HealthCheck))(
            given(**strategies)(_counted(target, fn)))
        if seed is not None:
            test = hypothesis.seed(seed)(test)
            seed += 1
        test()
        gc.collect()
        if time.monotonic() >= end:
            return _count


def main(argv: list[str] | None = None) -> int:
    global _last
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="*", default=list(TARGETS))
    ap.add_argument("--out", required=True, help="a folder for results.jsonl and last-input")
    ap.add_argument("--examples", type=int, default=CI_EXAMPLES)
    ap.add_argument("--seconds", type=float, default=0.0,
                    help="per target: rounds of --examples with fresh seeds until spent")
    ap.add_argument("--seed", type=int, default=None, help="random, from this seed on "
                    "(default: derandomized, the same examples every run)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    # a garbage pickle may ask CPython's unpickler for gigabytes (a memo index of 2**28):
    # MemoryError here, rather than a shared machine's memory
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (min(DATA_LIMIT, hard % (1 << 64)), hard))
    sys.unraisablehook = lambda u: _unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}")
    ring = "native" if shm_mod.NATIVE else "pure"
    _last = open(out / "last-input", "w")  # noqa: SIM115 (kept open: rewritten per example)
    for target in args.targets:
        start = time.monotonic()
        error = ""
        count = 0
        try:
            count = run_target(target, args.examples, args.seconds, args.seed)
        except BaseException as exc:  # reported, with hypothesis's example
            error = "".join(traceback.format_exception(exc))
            count = _count
        finally:
            faulthandler.cancel_dump_traceback_later()
        result = {"target": target, "ring": ring, "examples": count, "error": error,
                  "seconds": round(time.monotonic() - start, 2), "outcomes": dict(outcomes)}
        outcomes.clear()
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"{ring} {target}: {count} examples in {result['seconds']} s"
              + (" FAILED" if error else "") + f" {result['outcomes']}", flush=True)
    return 0


def run_child(ring: str, out: Path, timeout: float, extra: list[str]) -> dict[str, Any]:
    """Run targets in a child with the given ring; what came back, crash or not."""
    env = {**os.environ, "UNISON_PURE": "1" if ring == "pure" else ""}
    cmd = [sys.executable, __file__, "--out", str(out), *extra]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        rc: int | None = proc.returncode
        text = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:  # the child is killed and reaped by now
        rc = None
        text = f"(killed after {timeout} s: a hang?)\n" + _text(exc.stdout) + _text(exc.stderr)
    results: dict[str, dict[str, Any]] = {}
    path = out / "results.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            got = json.loads(line)
            results[got["target"]] = got
    last = (out / "last-input").read_text() if (out / "last-input").exists() else ""
    if rc is not None and rc < 0:
        text = f"(killed by {signal.Signals(-rc).name})\n" + text
    return {"rc": rc, "text": text[-6000:], "results": results, "last": last}


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def describe_missing(child: dict[str, Any], target: str) -> str:
    return (f"the child never finished {target!r} (exit {child['rc']}): a crash or a hang in "
            f"a decoder.\nLast input: {child['last']}\nIts output:\n{child['text']}")


# -- the tests ---------------------------------------------------------------------------------


def _c_here() -> str:
    """Why this process's channels do not take the C ring (built and fresh, and UNISON_PURE
    not set), or "": for the cases that run it here. Those that start a child with their
    own UNISON_PURE ask only _native.built("_ring")."""
    if not _native.built("_ring"):
        return "the C ring is not built here, or is stale"
    return "UNISON_PURE is set" if _native.pure_asked() else ""


@pytest.fixture(scope="module", params=["native", "pure"])
def child(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One child per ring runs every target (it is reaped before this returns)."""
    ring: str = request.param
    if ring == "native" and not _native.built("_ring"):
        pytest.skip("the C ring is not built here, or is stale")
    out = tmp_path_factory.mktemp(f"ring-fuzz-{ring}")
    got = run_child(ring, out, 200.0, ["--examples", str(CI_EXAMPLES)])
    got["ring"] = ring
    return got


def test_buffers_of_one_message_get_blocks_of_their_own() -> None:
    """Found by this fuzzing: Arena.place allocated every block of a message before it
    counted any, so when no free block of a size was left, the next buffer's alloc
    reclaimed the block just taken (sent == done) and both buffers shared it: the last
    one's bytes arrived for both (``sess.put((np.ones(n), np.zeros(n)))``: zeros twice)."""
    arena = Arena(f"unison-fuzz-{os.getpid()}", 1)
    try:
        data = [b"a" * 100, b"b" * 100, b"c" * 70_000, b"d" * 70_000, b"e" * 100]
        descs = arena.place(data, (0,))
        assert len({d[0] for d in descs}) == len(data)
        reader = ArenaReader(arena.fd, 0, 1, shared=True)
        assert [bytes(reader.view(d)) for d in descs] == data
    finally:
        arena.close()


def test_a_message_that_does_not_fit_gives_its_blocks_back() -> None:
    """The same fix on the MemoryError path: the blocks taken before the one that did not
    fit go back, unheld, and the next message reuses them."""
    fd = os.memfd_create("unison-fuzz-small", os.MFD_CLOEXEC)
    os.ftruncate(fd, counters_size(1) + 2 * MIN_BLOCK)
    arena = Arena("", 1, fd=fd)
    try:
        with pytest.raises(MemoryError):
            arena.place([b"a", b"b", b"c"], (0,))
        descs = arena.place([b"x", b"y"], (0,))
        assert len({d[0] for d in descs}) == 2
    finally:
        arena.close()


@pytest.mark.parametrize("pure", [False, True], ids=["c", "python"])
def test_a_plain_reply_in_one_step_keeps_its_place_at_the_rings_end_and_when_full(
        pure: bool) -> None:
    """worker.serve's reply of a plain value (``reply_plain``): C's, where it would cross the
    ring's end, or the ring is full, or the value is over a quarter of the ring, writes
    nothing and says so, and ``reply`` then sends it (a wrap marker, the reply arena).
    Python's is ``_put``'s, which wraps and waits for room itself: it refuses only a value
    for the arena. Every reply reads back in order either way."""
    if not pure and _c_here():
        pytest.skip(_c_here())
    with _pair(reply_start=REPLY_RING - 40) as (chan, (w0, _)):
        if pure:
            w0._taker = None
            w0.__dict__.pop("reply_plain", None)

        def send(req: int, value: Any) -> bool:
            return _reply_plain(w0, (req, protocol.OK, value))

        def values() -> list[Any]:  # a reply over a quarter of the ring: from the arena
            return [protocol.loads_plain(bytes(d.data) if isinstance(d, Reply) else d)[2]
                    for _, d in _drain(chan)]

        # 40 bytes to the ring's end: an entry of 24 fits, the next crosses it
        assert [send(i, i) for i in range(3)] == [True, pure, True]
        assert values() == [0, 1, 2]
        big = b"x" * (shm_mod._REPLY_INLINE + 1)
        assert not send(3, big)
        assert values() == [big]
        if pure:  # a full ring: Python's waits for the controller, as reply() does
            return
        fill = b"f" * 4000  # the ring filled, the controller reading nothing meanwhile
        entry = (8 + len(protocol.dumps_plain((0, protocol.OK, fill), protocol.PLAIN)) + 7) & ~7
        sent = 0
        while True:
            msg = (sent, protocol.OK, fill)
            pos = w0._q[w0._rw_idx]
            if w0.reply_plain(msg, protocol.PLAIN):
                sent += 1
                continue
            assert w0._q[w0._rw_idx] == pos, "a refused reply moved the ring's position"
            if pos + entry - w0._q[w0._rr_idx] > REPLY_RING:
                break  # full: reply() would wait for the controller now
            assert not _reply_plain(w0, msg)  # the ring's end: reply() wraps
            sent += 1
        assert sent >= REPLY_RING // entry - 1
        assert values() == [fill] * sent
        assert send(sent, "after") and values() == ["after"]


def test_replies_and_commands_with_several_buffers_arrive_whole() -> None:
    """The fix seen through both rings: two buffers of one size, each way."""
    with _pair() as (chan, (w0, w1)):
        bufs = [b"1" * 80_000, b"2" * 80_000]
        chan.send(b"cmd", (0, 1), [pickle.PickleBuffer(b) for b in bufs])
        for w in (w0, w1):
            got, err = _take(w)
            assert err is None and [[bytes(b) for b in bs] for _, bs in got] == [bufs]
        w0.reply(b"reply", [pickle.PickleBuffer(b) for b in bufs])
        [(rank, reply)] = _drain(chan)
        assert rank == 0 and _as_bytes(reply) == ("reply", b"reply", bufs)


SESSION_SCRIPT = r"""
import gc, time, unison
from unison.channel import shm

def corrupt():
    w = next(o for o in gc.get_objects() if isinstance(o, shm.ShmWorkerChannel))
    pos = w._q[w._rw_idx]
    base = w._rbase + (pos & (shm.REPLY_RING - 1))
    w._q[base // 8] = 0xFFFFFFF0  # a reply of 4 GiB, published as 16 bytes
    w._q[w._rw_idx] = pos + 24
    w._wake_controller()
    time.sleep(60)

with unison.Session(2) as sess:
    start = time.monotonic()
    try:
        sess[0].run(corrupt)
    except unison.WorkerDied as exc:
        print("WorkerDied", exc.worker, time.monotonic() - start, "|", exc)
    try:
        sess.run(unison.rank)
    except unison.SessionClosed:
        print("then SessionClosed")
print("native", shm.NATIVE)
"""


@pytest.mark.parametrize("ring", ["native", "pure"])
def test_a_worker_that_corrupts_its_reply_ring_is_reported_dead(ring: str) -> None:
    """Through a whole session: the controller neither crashes nor waits for the worker
    (which sleeps on): WorkerDied names it and says why, at once; the session closes."""
    if ring == "native" and not _native.built("_ring"):
        pytest.skip("the C ring is not built here, or is stale")
    env = {**os.environ, "UNISON_PURE": "1" if ring == "pure" else ""}
    proc = subprocess.run([sys.executable, "-c", SESSION_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    died = next(line for line in out.splitlines() if line.startswith("WorkerDied"))
    _, rank, seconds, _ = died.split(" ", 3)
    assert rank == "0" and float(seconds) < 10, died
    assert "break the format" in died, died
    assert "then SessionClosed" in out and f"native {ring == 'native'}" in out, out


@pytest.mark.parametrize("target", TARGETS)
def test_decoders_survive_malformed_input(child: dict[str, Any], target: str) -> None:
    result = child["results"].get(target)
    assert result is not None, describe_missing(child, target)
    assert result["ring"] == child["ring"], "UNISON_PURE did not pick the ring asked for"
    assert not result["error"], result["error"]
    assert result["examples"] >= (len(KNOWN_REPLY) + len(KNOWN_COMMAND)
                                  if target == "known_bad" else CI_EXAMPLES // 2)


if __name__ == "__main__":
    sys.exit(main())
