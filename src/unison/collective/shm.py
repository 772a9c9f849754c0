"""Collectives through shared memory, between the workers of one host.

    worker r                                  collective segment (memfd, made by the session)
    ---------                                 ------------------------------------------------
    write x into slot[r]  ------------------> slot[0] | slot[1] | ... | slot[N-1]
    arrive: gen[r] = (call, i, phase)         per worker: gen (world), gen (group), left, pid
    wait until every peer arrived  <--------- (yield-spin, then short sleeps)
    read what it needs from the peers' slots
    depart: the slots may be reused           result[g]: a shared area per group (world: 0)
                                              mailbox[s][d]: one per ordered pair, for send

Synchronisation is by generations: each worker publishes, per scope (world or its group),
the last barrier it reached as ``(call id << 24) | (index in call << 2) | phase``. Tying the
generation to the controller's call id makes every call start aligned, even after a call
that failed half-way through a collective on some workers.

A waiter never hangs on a peer that will not come: a peer that finished the current call
(``left >= call id``) without arriving makes the collective raise CollectiveError, within
milliseconds; so does the controller's abort flag, set when a worker dies.

Reductions run in rank order on every element, so every rank gets bit-identical results.
Large reductions split the work: each worker reduces one share into the group's result area
(reduce-scatter), then everyone copies the whole result (allgather).
"""

from __future__ import annotations

import mmap
import os
import pickle
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from unison.errors import UnisonError

SLOT = 32 << 20  # bytes per worker slot and per result area; larger data goes in rounds
SMALL = 64 << 10  # reductions up to this size: every worker reduces all of it itself
_LINE = 64
_SPIN = 1e-3
_CHECK = 0.002  # while sleeping, re-check the peers this often (s)

OPS: dict[str, Callable[..., Any]] = {
    "sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "mean": np.add,
}


class CollectiveError(UnisonError):
    """A collective could not complete: a peer left the call without joining it (it raised,
    returned early, or called a different collective), a peer died, or the workers passed
    arrays that do not match. The message names the peer and what to fix."""


def _p2p_slot(n: int) -> int:
    return max(64 << 10, min(4 << 20, (256 << 20) // max(1, n * n)))


class Layout:
    def __init__(self, n: int, groups: int) -> None:
        self.n, self.groups = n, groups  # word 0 of the segment: the controller's abort flag
        self.worker = [_LINE * (1 + r) for r in range(n)]  # gen_w, gen_g, left, pid, nbytes, dt
        p2p0 = _LINE * (1 + n)
        self.sent = [[p2p0 + 2 * _LINE * (s * n + d) for d in range(n)] for s in range(n)]
        self.acked = [[o + _LINE for o in row] for row in self.sent]
        data = p2p0 + 2 * _LINE * n * n
        data = (data + 4095) & ~4095
        self.slot = [data + SLOT * r for r in range(n)]
        self.result = [data + SLOT * (n + g) for g in range(groups)]
        self.p2p = _p2p_slot(n)
        p2p_data = data + SLOT * (n + groups)
        self.mailbox = [[p2p_data + self.p2p * (s * n + d) for d in range(n)] for s in range(n)]
        self.size = p2p_data + self.p2p * n * n


def create(name: str, n: int, groups: int) -> tuple[int, Layout]:
    """The controller's part: the segment, as an fd for the workers to inherit."""
    lay = Layout(n, groups)
    fd = os.memfd_create(f"{name}-coll", os.MFD_CLOEXEC)
    os.ftruncate(fd, lay.size)
    return fd, lay


def abort(fd: int, dead: int) -> None:
    """The controller's part, when a worker died: wake every waiter with an error."""
    with mmap.mmap(fd, _LINE) as mm:
        mv = memoryview(mm).cast("Q")
        mv[0] = dead + 1
        mv.release()


class ShmCollectives:
    """One worker's end of the shared-memory collectives."""

    def __init__(self, fd: int, rank: int, n: int, groups: int) -> None:
        self.lay = lay = Layout(n, groups)
        self.rank, self.n, self.groups = rank, n, groups
        self.gsize = n // groups
        self._mm = mmap.mmap(fd, lay.size)
        self._buf = memoryview(self._mm)
        self._q = self._buf.cast("Q")
        self._w = [o // 8 for o in lay.worker]
        me = self._w[rank]
        self._q[me + 3] = os.getpid()
        self._call = 0  # the controller's id of the call this worker runs now
        self._call_ranks: tuple[int, ...] | None = None
        self._index = [0, 0]  # collectives so far in this call: world, group
        self._sends: dict[int, int] = {}
        self._recvs: dict[int, int] = {}
        first = rank // self.gsize * self.gsize
        self._scopes = {False: tuple(range(n)), True: tuple(range(first, first + self.gsize))}
        self._views: dict[tuple[int, str, int], np.ndarray] = {}

    # -- called by the worker loop around each call ------------------------------------------

    def begin(self, call_id: int, ranks: tuple[int, ...] | None) -> None:
        self._call, self._call_ranks = call_id, ranks
        self._index[0] = self._index[1] = 0
        self._sends.clear()
        self._recvs.clear()

    def end(self, call_id: int) -> None:
        self._q[self._w[self.rank] + 2] = call_id  # "left": peers waiting for us give up

    # -- scopes and barriers -----------------------------------------------------------------

    def scope(self, group: bool) -> tuple[int, tuple[int, ...]]:
        """(which generation counter, the ranks taking part) for a collective."""
        if self._call == 0:
            raise RuntimeError("unison collectives only work inside a function a worker runs")
        ranks = self._scopes[group]
        if self._call_ranks is not None and not set(ranks) <= set(self._call_ranks):
            raise CollectiveError(
                f"this call runs on workers {list(self._call_ranks)}, but a "
                f"{'group' if group else 'world'} collective needs workers {list(ranks)}: "
                "call it on the whole session (or the whole group with group=True)"
            )
        return (1 if group else 0), ranks

    def _next(self, which: int) -> int:
        i = self._index[which]
        self._index[which] = i + 1
        return (self._call << 24) | (i << 2)

    def _arrive(self, which: int, gen: int) -> None:
        self._q[self._w[self.rank] + which] = gen

    def _await(self, which: int, ranks: Sequence[int], gen: int, what: str) -> None:
        """Wait until every rank in ``ranks`` reached ``gen`` on counter ``which``."""
        q, w = self._q, self._w
        waiting = [j for j in ranks if q[w[j] + which] < gen]
        if not waiting:
            return
        pacer = _Pacer()
        while True:
            waiting = [j for j in waiting if q[w[j] + which] < gen]
            if not waiting:
                return
            self._check(waiting, which, gen, what)
            pacer.pause()

    def _check_abort(self, what: str) -> None:
        """The controller saw a worker die: every wait gives up."""
        dead = self._q[0]
        if dead:
            raise CollectiveError(f"{what} gave up: worker {dead - 1} died")

    def _check(self, waiting: Sequence[int], which: int, gen: int, what: str) -> None:
        q, w = self._q, self._w
        self._check_abort(what)
        for j in waiting:
            if q[w[j] + 2] >= self._call and q[w[j] + which] < gen:
                raise CollectiveError(
                    f"{what} on worker {self.rank} gave up: worker {j} left the call without "
                    "joining it (it raised, returned early, or ran a different collective)"
                )

    def barrier(self, group: bool = False) -> None:
        which, ranks = self.scope(group)
        gen = self._next(which)
        self._arrive(which, gen)
        self._await(which, ranks, gen, "barrier")

    # -- reductions ----------------------------------------------------------------------------

    def allreduce(self, x: Any, op: str, group: bool) -> Any:
        arr, restore = _as_array(x)
        ufunc = _op(op)
        which, ranks = self.scope(group)
        if op == "mean" and arr.dtype.kind in "biu":
            arr = arr.astype(np.float64)  # as numpy's mean does
        out = np.empty_like(arr)
        if arr.nbytes <= SLOT:
            self._allreduce_flat(arr.reshape(-1), out.reshape(-1), ufunc, which, ranks,
                                 _signature(arr))
        else:
            flat_in, flat_out = arr.reshape(-1), out.reshape(-1)
            step = SLOT // arr.itemsize
            for lo in range(0, flat_in.size, step):
                self._allreduce_flat(flat_in[lo : lo + step], flat_out[lo : lo + step], ufunc,
                                     which, ranks, _signature(arr))
        if op == "mean":
            out = _mean(out, len(ranks), arr.dtype)
        return restore(out)

    def _allreduce_flat(self, a: np.ndarray, out: np.ndarray, ufunc: Callable[..., Any],
                        which: int, ranks: tuple[int, ...], sig: int) -> None:
        gen = self._next(which)
        slots = self._publish(a, sig, which, ranks, gen, "allreduce")
        if a.nbytes <= SMALL or len(ranks) == 1:
            _reduce_into(out, slots, ufunc)
            self._arrive(which, gen | 1)
            self._await(which, ranks, gen | 1, "allreduce")
            return
        result = self._view(self.lay.result[ranks[0] // self.gsize if which else 0], a)
        lo, hi = _share(a.size, len(ranks), ranks.index(self.rank))
        _reduce_into(result[lo:hi], [s[lo:hi] for s in slots], ufunc)
        self._arrive(which, gen | 2)
        self._await(which, ranks, gen | 2, "allreduce")
        np.copyto(out, result)
        self._arrive(which, gen | 3)
        self._await(which, ranks, gen | 3, "allreduce")

    def reduce_scatter(self, x: Any, op: str, group: bool) -> Any:
        arr, restore = _as_array(x)
        ufunc = _op(op)
        which, ranks = self.scope(group)
        if op == "mean" and arr.dtype.kind in "biu":
            arr = arr.astype(np.float64)
        if arr.ndim == 0:
            raise ValueError("reduce_scatter needs an array with a first axis to split")
        if arr.nbytes > SLOT:
            full = self.allreduce(arr, "sum" if op == "mean" else op, group)
            part = np.array_split(full, len(ranks))[ranks.index(self.rank)]
            return restore(_mean(part, len(ranks), arr.dtype) if op == "mean" else part.copy())
        gen = self._next(which)
        slots = self._publish(arr.reshape(-1), _signature(arr), which, ranks, gen,
                              "reduce_scatter")
        first, last = _share(arr.shape[0], len(ranks), ranks.index(self.rank))
        row = int(np.prod(arr.shape[1:], dtype=np.int64))
        lo, hi = first * row, last * row
        out = np.empty((last - first, *arr.shape[1:]), arr.dtype)
        _reduce_into(out.reshape(-1), [s[lo:hi] for s in slots], ufunc)
        self._arrive(which, gen | 1)
        self._await(which, ranks, gen | 1, "reduce_scatter")
        if op == "mean":
            out = _mean(out, len(ranks), arr.dtype)
        return restore(out)

    def _publish(self, a: np.ndarray, sig: int, which: int, ranks: tuple[int, ...], gen: int,
                 what: str) -> list[np.ndarray]:
        """Copy ``a`` into our slot, arrive, wait for the peers, check that they passed the
        same shape and dtype (``sig``), and return every participant's slot as an array like
        ``a``, in rank order."""
        me = self._w[self.rank]
        self._q[me + 4] = a.nbytes
        self._q[me + 5] = sig
        mine = self._view(self.lay.slot[self.rank], a)
        np.copyto(mine, a)
        self._arrive(which, gen)
        self._await(which, ranks, gen, what)
        q, w = self._q, self._w
        for j in ranks:
            if q[w[j] + 4] != a.nbytes or q[w[j] + 5] != sig:
                raise CollectiveError(
                    f"{what}: worker {j} passed an array of another shape or dtype "
                    f"({q[w[j] + 4]} bytes) than worker {self.rank} ({a.nbytes} bytes): every "
                    "worker must pass the same shape and dtype"
                )
        return [mine if j == self.rank else self._view(self.lay.slot[j], a) for j in ranks]

    def _view(self, offset: int, like: np.ndarray) -> np.ndarray:
        key = (offset, like.dtype.str, like.size)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 256:
                self._views.clear()
            view = self._views[key] = np.frombuffer(self._buf, like.dtype, like.size, offset)
        return view

    # -- moving objects ------------------------------------------------------------------------

    def allgather(self, x: Any, group: bool) -> list[Any]:
        which, ranks = self.scope(group)
        got = self._exchange(which, ranks, _encode(x), ranks)
        return [_decode(got[j]) for j in ranks]

    def broadcast(self, x: Any, src: int, group: bool) -> Any:
        which, ranks = self.scope(group)
        src_rank = _member(ranks, src, group, "src")
        got = self._exchange(which, ranks, _encode(x) if self.rank == src_rank else [], (src_rank,))
        return _decode(got[src_rank])

    def scatter(self, xs: Sequence[Any] | None, src: int, group: bool) -> Any:
        _, ranks = self.scope(group)
        src_rank = _member(ranks, src, group, "src")
        if self.rank == src_rank:
            if xs is None or len(xs) != len(ranks):
                raise ValueError(f"scatter on the source needs one value per worker ({len(ranks)})")
            for j, item in zip(ranks, xs):
                if j != self.rank:
                    self.send(item, j)
            return _decode(_join(_encode(xs[ranks.index(self.rank)])))
        return self.recv(src_rank)

    def gather(self, x: Any, dst: int, group: bool) -> list[Any] | None:
        _, ranks = self.scope(group)
        dst_rank = _member(ranks, dst, group, "dst")
        if self.rank != dst_rank:
            self.send(x, dst_rank)
            return None
        return [_decode(_join(_encode(x))) if j == self.rank else self.recv(j) for j in ranks]

    def _exchange(self, which: int, ranks: tuple[int, ...], payload: list[Any],
                  wanted: Sequence[int]) -> dict[int, bytearray]:
        """Every participant offers bytes; each gets those of ``wanted``. Rounds of one slot."""
        total = sum(len(memoryview(p).cast("B")) for p in payload)
        stream = _Stream(payload)
        me = self._w[self.rank]
        cap = SLOT
        got: dict[int, bytearray] = {}
        done = 0
        rounds = 1
        r = 0
        while r < rounds:
            gen = self._next(which)
            self._q[me + 4] = total
            chunk = stream.read(cap)
            base = self.lay.slot[self.rank]
            self._buf[base : base + len(chunk)] = chunk
            self._arrive(which, gen)
            self._await(which, ranks, gen, "collective")
            if r == 0:
                rounds = max(1, max(-(-self._q[self._w[j] + 4] // cap) for j in ranks))
                for j in wanted:
                    got[j] = bytearray(self._q[self._w[j] + 4])
            for j in wanted:
                size = len(got[j])
                n = min(cap, size - done)
                if n > 0:
                    base = self.lay.slot[j]
                    got[j][done : done + n] = self._buf[base : base + n]
            done += cap
            self._arrive(which, gen | 1)
            self._await(which, ranks, gen | 1, "collective")
            r += 1
        return got

    # -- point to point ------------------------------------------------------------------------

    def send(self, x: Any, dst: int) -> None:
        if not 0 <= dst < self.n or dst == self.rank:
            raise ValueError(
                f"send needs a destination rank in 0..{self.n - 1} other than {self.rank}"
            )
        self._check_peer(dst)
        q = self._q
        sent, acked = self.lay.sent[self.rank][dst] // 8, self.lay.acked[self.rank][dst] // 8
        box, cap = self.lay.mailbox[self.rank][dst], self.lay.p2p
        payload = _encode(x)
        total = sum(len(memoryview(p).cast("B")) for p in payload)
        stream = _Stream(payload)
        k = self._sends.get(dst, 0)
        self._sends[dst] = k + 1
        off = 0
        part = 0
        while True:
            seq = _seq(self._call, k, part)
            self._await_ack(dst, sent, acked)
            chunk = stream.read(cap)
            self._buf[box : box + len(chunk)] = chunk
            q[sent + 1] = total
            q[sent] = seq  # publish the chunk
            off += len(chunk)
            part += 1
            if off >= total:
                return

    def _check_peer(self, peer: int) -> None:
        if self._call == 0:
            raise RuntimeError("unison send/recv only work inside a function a worker runs")
        if self._call_ranks is not None and peer not in self._call_ranks:
            raise CollectiveError(
                f"worker {peer} does not run this call (it runs on {list(self._call_ranks)}), "
                "so it can never answer: call on a view that includes it"
            )

    def _await_ack(self, dst: int, sent: int, acked: int) -> None:
        """The mailbox is free once the receiver took the last chunk, or left its call."""
        q = self._q
        pacer = _Pacer()
        while q[acked] < q[sent]:
            self._check_abort(f"send to worker {dst}")
            if q[self._w[dst] + 2] >= q[sent] >> _CALL_SHIFT:  # it left that call: drop it
                return
            pacer.pause()

    def recv(self, src: int) -> Any:
        if not 0 <= src < self.n or src == self.rank:
            raise ValueError(f"recv needs a source rank in 0..{self.n - 1} other than {self.rank}")
        self._check_peer(src)
        q = self._q
        sent, acked = self.lay.sent[src][self.rank] // 8, self.lay.acked[src][self.rank] // 8
        box, cap = self.lay.mailbox[src][self.rank], self.lay.p2p
        k = self._recvs.get(src, 0)
        self._recvs[src] = k + 1
        out = bytearray()
        part = 0
        while True:
            want = _seq(self._call, k, part)
            self._await_message(src, sent, acked, want)
            total = q[sent + 1]
            if part == 0:
                out = bytearray(total)
            n = min(cap, total - part * cap)
            out[part * cap : part * cap + n] = self._buf[box : box + n]
            q[acked] = want
            part += 1
            if part * cap >= total:
                return _decode(out)

    def _await_message(self, src: int, sent: int, acked: int, want: int) -> None:
        q = self._q
        pacer = _Pacer()
        while q[sent] != want:
            stale = q[sent]
            if stale > q[acked] and stale < want:  # left over from an earlier, failed call
                q[acked] = stale
            self._check_abort(f"recv from worker {src}")
            if q[self._w[src] + 2] >= self._call and q[sent] != want:
                raise CollectiveError(
                    f"recv on worker {self.rank} gave up: worker {src} left the call without "
                    "sending (it raised or returned early)"
                )
            pacer.pause()


# -- helpers -----------------------------------------------------------------------------------


class _Pacer:
    """How a wait passes time: yield the core for its first millisecond, then sleep in
    naps growing to 2 ms, so a long wait costs little CPU but still checks its peers."""

    __slots__ = ("_nap", "_spin_end")

    def __init__(self) -> None:
        self._spin_end = time.perf_counter() + _SPIN
        self._nap = 20e-6

    def pause(self) -> None:
        if time.perf_counter() < self._spin_end:
            os.sched_yield()
        else:
            time.sleep(self._nap)
            self._nap = min(self._nap * 2, _CHECK)


_CALL_SHIFT = 28


def _seq(call: int, k: int, part: int) -> int:
    """A mailbox sequence number: the call, the k-th message of this pair in it, its chunk."""
    return (call << _CALL_SHIFT) | (k << 14) | (part + 1)


def _member(ranks: tuple[int, ...], r: int, group: bool, what: str) -> int:
    """``r`` is a rank in the scope (group-local with group=True): its global rank."""
    if not isinstance(r, int) or not 0 <= r < len(ranks):
        scope = "group" if group else "world"
        raise ValueError(f"{what}={r!r} is not a rank of the {scope} (0..{len(ranks) - 1})")
    return ranks[r]


def _op(op: str) -> Callable[..., Any]:
    try:
        return OPS[op]
    except (KeyError, TypeError):
        raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}") from None


def _as_array(x: Any) -> tuple[np.ndarray, Callable[[np.ndarray], Any]]:
    """``x`` as a contiguous numpy array, and how to turn a result back into x's kind."""
    if type(x).__module__.startswith("torch"):
        import torch

        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                raise TypeError(
                    "the shared-memory backend takes CPU tensors; use collectives='torch'"
                )
            arr = _contiguous(x.detach().numpy())
            return arr, torch.from_numpy
    if isinstance(x, np.ndarray):
        return _contiguous(x), lambda r: r
    if isinstance(x, (int, float, complex, bool, np.generic)):
        return np.asarray(x), lambda r: r[()].item() if not isinstance(x, np.generic) else r[()]
    raise TypeError(
        f"reductions take numpy arrays, CPU torch tensors or numbers, not {type(x).__name__}"
    )


def _signature(a: np.ndarray) -> int:
    """Shape and dtype as one number, the same in every process (unlike hash())."""
    sig = zlib.crc32(a.dtype.str.encode())  # byte order and datetime units count too
    for d in a.shape:
        sig = (sig * 1_000_003 + d + 1) & 0xFFFF_FFFF_FFFF
    return (sig << 8) | a.dtype.num


def _contiguous(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array (np.ascontiguousarray would turn 0-d into 1-d)."""
    return a if a.flags.c_contiguous else a.copy(order="C")


def _reduce_into(out: np.ndarray, parts: Sequence[np.ndarray], ufunc: Callable[..., Any]) -> None:
    """out = parts[0] op parts[1] op ... in rank order, so every rank gets the same bits."""
    if len(parts) == 1:
        np.copyto(out, parts[0])
        return
    ufunc(parts[0], parts[1], out=out)
    for p in parts[2:]:
        ufunc(out, p, out=out)


def _mean(total: np.ndarray, n: int, dtype: np.dtype[Any]) -> np.ndarray:
    """The sum divided by n; integers were summed as float64 already, as numpy's mean does."""
    out = np.empty_like(total)
    np.true_divide(total, n, out=out)  # out=: a 0-d input stays an array
    return out


def _share(size: int, parts: int, k: int) -> tuple[int, int]:
    base, extra = divmod(size, parts)
    lo = k * base + min(k, extra)
    return lo, lo + base + (1 if k < extra else 0)


def _encode(x: Any) -> list[Any]:
    """Pickle-5 parts: a header of lengths, the pickle, then each raw buffer."""
    bufs: list[pickle.PickleBuffer] = []
    data = pickle.dumps(x, protocol=5, buffer_callback=bufs.append)
    raws = [b.raw() for b in bufs]
    head = np.array([len(data), len(raws), *(r.nbytes for r in raws)], np.uint64).tobytes()
    return [head, data, *raws]


def _join(parts: list[Any]) -> bytearray:
    out = bytearray()
    for p in parts:
        out += p
    return out


def _decode(data: bytearray) -> Any:
    head = np.frombuffer(data, np.uint64, 2)
    n_data, n_bufs = int(head[0]), int(head[1])
    sizes = np.frombuffer(data, np.uint64, n_bufs, 16).tolist() if n_bufs else []
    pos = 16 + 8 * n_bufs
    view = memoryview(data)
    pickled = view[pos : pos + n_data]
    pos += n_data
    buffers = []
    for s in sizes:
        buffers.append(view[pos : pos + int(s)])
        pos += int(s)
    return pickle.loads(pickled, buffers=buffers)


class _Stream:
    """Reads consecutive windows of a list of byte-like parts without joining them."""

    def __init__(self, parts: list[Any]) -> None:
        self._parts = [memoryview(p).cast("B") for p in parts]
        self._i = 0
        self._off = 0

    def read(self, n: int) -> bytes:
        out = bytearray()
        while n > 0 and self._i < len(self._parts):
            part = self._parts[self._i]
            take = part[self._off : self._off + n]
            out += take
            n -= len(take)
            self._off += len(take)
            if self._off >= len(part):
                self._i += 1
                self._off = 0
        return bytes(out)
