"""Collectives through shared memory, between the workers of one host.

    worker r                                  collective segment (memfd, made by the session)
    ---------                                 ------------------------------------------------
    write x into slot[r]  ------------------> slot[0] | slot[1] | ... | slot[N-1]
    publish what it calls (kind, op, root,    per worker: gen (world), gen (group), left, pid,
      shape), then arrive: gen[r]               what it called (per scope, two deep)
    wait until every peer arrived  <--------- (yield-spin, then short sleeps)
    check the peers called the same thing
    read what it needs from the peers' slots
    depart: the slots may be reused           result[g]: a shared area per group (world: 0)
                                              ring[s][d]: one queue per ordered pair, for send

Synchronisation is by generations: each worker publishes, per scope (world or its group),
the last barrier it reached as ``(call id << 26) | (index in call << 2) | phase``: one
64-bit word, so a call may run at most 2**24 (16,777,216) collectives in each scope and call
ids stay below 2**38. A collective that would take a generation past either raises
CollectiveError before it publishes anything: an index that spilled into the call bits
would count a stale peer as arrived, and reduce its previous data. Tying the
generation to the controller's call id makes every call start aligned, even after a call
that failed half-way through a collective on some workers.

Before it arrives, a worker also publishes what it is calling (allreduce with op "sum",
broadcast from root 2, ...). Every participant compares that with the peers' once all have
arrived, so a program whose ranks call different collectives raises CollectiveError on
every rank instead of mixing their data. The record is kept per scope and per parity of the
collective's index: within a call a peer can be at most one collective ahead in a scope.

Nothing a peer may still read is overwritten under it. Within a call, the parities and the
depart phases see to that. Across calls they cannot: the index starts again at 0, and the
controller queues the next call before this one ends, so a worker may begin it while a
peer is still preempted after a barrier's wait, or still reads its slot after the worker
gave up on a third one. So each worker remembers, per scope, what its last collective left
readable (``_owe``: the phase its peers must reach), and its next call's first collective
waits until each peer reached it or left that call, before it writes anything. A collective
that failed leaves its peers anywhere in it; the rest of that call raises at once.

A waiter never hangs on a peer that will not come, nor takes a later call's data for this
one's: a peer that finished the current call (``left >= call id``) without arriving, or
that shows a later call's generation at a meeting (one that met us there would be waiting
for us, as above), makes the collective raise CollectiveError, within milliseconds; so
does the controller's abort flag, set when a worker dies. So does a peer that waits at a
meeting of the other scope that includes this worker, which it has not reached, the same in
two looks _LOOK apart: ranks that disagree on group= (with one group, the group holds every
rank but keeps its own counter), which would wait for each other for good. A segment the
controller cannot reach (made by a worker on another host: collective/rendezvous.py) has
no abort flag that anyone sets, so its waiters watch their peers' pids instead
(``watch_peers``: a pidfd per peer, looked at every _LOOK seconds of a wait). A cycle of
waits, sends, recvs and meetings alike (a worker in a barrier, its peer in a recv from it),
raises too (_Waiting).

Reductions run in rank order on every element, so every rank gets bit-identical results.
Large reductions among 3 or more split the work: each worker reduces one share into the
group's result area (reduce-scatter), then everyone copies the whole result (allgather).
The others (whole, up to SMALL or between 2) run in one C call where unison/_coll.c was
built and takes their op and dtype: copy, meet, check, reduce and depart, writing what the
numpy path writes and computing its bits (see _allreduce_c).

Point to point is eager. Each ordered pair has a queue of RING entries; a message that fits
the entry's inline area is copied there, a larger one goes into a memfd of its own (named
"unison-send") that the receiver opens through /proc/<sender pid>/fd/<n>. ``send`` returns
once the data is copied out; it waits only when RING messages to that peer are still
untaken. The sender closes a spill once it is taken, or once the receiver left that call (a
message is only ever received in the call that sent it), when it next sends to that peer or
begins or ends a call; memfds die with the processes.

Every object a collective moves is encoded by unison.protocol, as calls and results are:
anything a call can return, a collective can carry.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from unison import _native, protocol
from unison._fdwait import readable
from unison.channel.arena import sealed_memfd
from unison.collective.base import Collectives
from unison.collective.checks import (
    PYTHON_SIGNATURES,
    CallScope,
    array_signature,
    check_op,
    check_peer,
    check_scatter_values,
    describe,
    descriptor,
    into,
    member,
    op_ufunc,
    reduce_python,
)
from unison.errors import CollectiveError
from unison.pacing import LONG_YIELD, Pacer, cores, crowd

SLOT = 32 << 20  # bytes per worker slot and per result area; larger data goes in rounds
SMALL = 64 << 10  # reductions up to this size (any size between 2 workers): every worker
# reduces all of it itself. Above, with 3 or more, a reduce-scatter then an allgather moves
# less memory; between 2 it moves more (5.5 against 5 times the size per worker, and a third
# barrier: a 1.9 MB allreduce between 2 workers took 538 against 487 us)
RING = 64  # messages in flight per ordered pair before a send waits for the receiver
_LINE = 64
_REC = 2 * _LINE  # one worker's record: see Layout
_NEVER = 1 << 64  # above any generation
# a generation: call << _CALL_SHIFT | index << 2 | phase (as _coll.c's CALL_SHIFT, MAX_INDEX,
# MAX_CALL; checked at import)
_INDEX_BITS = 24
_CALL_SHIFT = _INDEX_BITS + 2
_MAX_INDEX = 1 << _INDEX_BITS  # collectives per call and scope
_MAX_CALL = 1 << (64 - _CALL_SHIFT)  # call ids below this
LEFT_WHY = "it raised, returned early, or ran a different collective"
"""Why a peer left a call without joining a collective, as far as a waiter can tell."""
_SPIN = 1e-3
_CHECK = 0.002  # while sleeping, re-check the peers this often (s)
_LOOK = 0.05  # with watch_peers, look whether the awaited peers still live this often (s)

# words of a worker's record
_GEN_W, _GEN_G, _LEFT, _PID, _NBYTES, _SIG, _DESC = range(7)  # _DESC: 8 words, see _desc_at
_WAIT, _WAIT_CALL = 14, 15  # a send, recv or meeting that waits (see _Waiting), and its call
_GAVE_UP = 1 << 63  # in _WAIT_CALL: this worker left that call over a deadlock (_Waiting)
_SENDING, _RECEIVING, _MEETING = 0, 1, 2  # what a _WAIT word waits in (its low 2 bits)
# words of a ring entry (one cache line each); _E_IDX is the message's index + 1, 0 = being written
_E_IDX, _E_CALL, _E_TOTAL, _E_WHERE, _E_TAG = range(5)
TAG_SEND, TAG_SCATTER, TAG_GATHER = 0, 1, 2
_TAG_NAMES = ("send", "scatter", "gather")

# a small allreduce in C (unison/_coll.c): its statuses; how its waits spin before this
# module's Pacer takes over: checks a pause apart (only where every participant can hold a
# core: at N=4 on 2 cores 256 of them doubled a 4 KiB allreduce's time, and at N=2 saved 1 us
# of 7), then yields for at most _C_SPIN_NS; and which (op, dtype) it reduces, by code
_C_MEET, _C_MISMATCH, _C_DEPART, _C_PASS, _C_FULL, _C_LONG = 1, 2, 3, 4, 5, 16  # and 0: done
_C_PAUSES = 128
_C_SPIN_NS = 100_000
_CORES = cores()
_C_LONG_NS = int(LONG_YIELD * 1e9)
_C_TYPES = tuple(np.dtype(t).str for t in ("f4", "f8", "i4", "i8", "u4", "u8"))  # native
# byte order; as _coll.c's T_F32 .. T_U64
_C_OPS = ("sum", "prod", "min", "max")  # as _coll.c's OP_SUM .. OP_MAX
_C_CODES = {  # no float min or max: numpy's NaN rules stay numpy's
    (op, t): _C_OPS.index(op) << 4 | i
    for i, t in enumerate(_C_TYPES) for op in _C_OPS if t[1] != "f" or op in ("sum", "prod")
}
_C_CODES.update({("mean", t): _C_CODES["sum", t] for t in _C_TYPES[:2]})  # then / N


Plan = tuple[int, int, int, int, tuple[int, ...], int, int]
"""What the C steps reduce how among whom: (code, signature, descriptor, which counter,
ranks, pauses, long_ns), as _coll.c's Plan."""

_BUG = ("this is a bug in unison: please report it with the collectives this call ran "
        "(UNISON_PURE=1 runs them without the C steps meanwhile)")


def _plan(code: int, sig: int, desc: int, which: int, ranks: tuple[int, ...]) -> Plan:
    """A Plan for the C steps: their waits check a pause apart only where every
    participant can hold a core (see _C_PAUSES)."""
    return (code, sig, desc, which, ranks, _C_PAUSES if len(ranks) <= _CORES else 0,
            _C_LONG_NS)


def _steps_in_c() -> Any:
    """The C steps of a small allreduce (unison/_coll.c), unless they did not build,
    UNISON_PURE=1 is set, or they were built for another record layout or generation word
    (a stale build, refused with a warning, as _ring's): then numpy and Python."""
    return _native.load("_coll", {
        "RECORD": (_GEN_W, _GEN_G, _LEFT, _PID, _NBYTES, _SIG, _DESC),
        "GENERATION": (_CALL_SHIFT, _MAX_INDEX, _MAX_CALL)})


_coll = _steps_in_c()


def _p2p_bytes(n: int) -> int:
    """Inline bytes per ordered pair, over all its ring entries."""
    return max(64 << 10, min(4 << 20, (256 << 20) // max(1, n * n)))


class Layout:
    """Where everything lives in the segment. Word 0 is the controller's abort flag.

    A worker's record (two cache lines): generation (world), generation (group), the last
    call it left, pid, nbytes and signature of its reduction input, then what it calls:
    (descriptor, signature) for each scope and each parity of the collective's index."""

    def __init__(self, n: int, groups: int) -> None:
        self.n, self.groups = n, groups
        self.worker = [_LINE + _REC * r for r in range(n)]
        ring0 = _LINE + _REC * n
        per_pair = 2 * _LINE + RING * _LINE  # head line, tail line, one line per entry
        self.head = [[ring0 + per_pair * (s * n + d) for d in range(n)] for s in range(n)]
        self.tail = [[o + _LINE for o in row] for row in self.head]
        self.entries = [[o + 2 * _LINE for o in row] for row in self.head]
        data = ring0 + per_pair * n * n
        data = (data + 4095) & ~4095
        self.slot = [data + SLOT * r for r in range(n)]
        self.result = [data + SLOT * (n + g) for g in range(groups)]
        self.inline = _p2p_bytes(n) // RING  # bytes a message may take inline
        pair_data = self.inline * RING
        p2p_data = data + SLOT * (n + groups)
        self.mailbox = [[p2p_data + pair_data * (s * n + d) for d in range(n)] for s in range(n)]
        self.size = p2p_data + pair_data * n * n


def create(name: str, n: int, groups: int) -> tuple[int, Layout]:
    """The controller's part: the segment, as an fd for the workers to inherit."""
    lay = Layout(n, groups)
    return sealed_memfd(f"{name}-coll", lay.size), lay


def abort(fd: int, dead: int) -> None:
    """The controller's part, when a worker died: wake every waiter with an error."""
    with mmap.mmap(fd, _LINE) as mm:
        mv = memoryview(mm).cast("Q")
        mv[0] = dead + 1
        mv.release()


class ShmCollectives(CallScope, Collectives):
    """One worker's end of the shared-memory collectives. Besides the Collectives interface
    it offers ``scope`` and ``arrive`` (a barrier that checks what every rank calls), on
    which the torch backend builds. ``watch_peers``: peers' deaths are seen through their
    pids, where no controller sets the abort flag."""

    def __init__(self, fd: int, rank: int, n: int, groups: int, *,
                 watch_peers: bool = False) -> None:
        CallScope.__init__(self, rank, n, groups)
        self.lay = lay = Layout(n, groups)
        self._mm = mmap.mmap(fd, lay.size)
        self._buf = memoryview(self._mm)
        self._q = self._buf.cast("Q")
        self._w = [o // 8 for o in lay.worker]
        me = self._w[rank]
        self._q[me + _PID] = os.getpid()
        self._left = me + _LEFT  # our "left" word: the last call we finished
        self._index = [0, 0]  # collectives so far in this call: world, group
        # per scope, what peers may still read of ours: (call, the generation they must
        # reach, ranks, whether the collective failed here); see _next
        self._owe: list[tuple[int, int, tuple[int, ...], bool] | None] = [None, None]
        self._spills: dict[int, deque[tuple[int, int, int]]] = {}  # dst -> (index, call, fd)
        self.held = self._spills  # what begin (and end) let go of once peers took it
        self._views: dict[tuple[int, str, int], np.ndarray] = {}
        self._watch = watch_peers
        self._pidfds: dict[int, tuple[int, int]] = {}  # rank -> (pid, its pidfd)
        self._next_look = 0.0
        self._c = _coll.Reducer(self._mm, rank, self._w, lay.slot, SLOT, self) if _coll else None
        if self._c is not None:  # the worker loop's end after every call: one C call
            self.end = self._c.end  # type: ignore[method-assign]
        self._small: dict[tuple[str, np.dtype[Any], tuple[int, ...], bool],
                          Plan | tuple[()]] = {}

    def close(self) -> None:
        """Let go of the peers' pidfds (``watch_peers``; each call's end does too); the
        mapping goes with the object."""
        for _, pidfd in self._pidfds.values():
            os.close(pidfd)
        self._pidfds.clear()

    def release(self) -> None:
        """Unmap now (worker 0 inline in the controller, whose process goes on): the
        mapping's copy of the segment's fd closes here, not whenever this object goes (a
        kept traceback's frame may hold it for long). A view someone still holds keeps it
        mapped until that goes."""
        self.close()
        if self._c is not None:  # it holds a view, and a kept frame may hold it (its end)
            self._c.release()
        self._c = None
        self.__dict__.pop("end", None)
        self._views.clear()
        self._small.clear()
        self._q.release()
        self._buf.release()
        with contextlib.suppress(BufferError):
            self._mm.close()

    # -- called by the worker loop around each call ------------------------------------------

    def begin(self, call_id: int, ranks: tuple[int, ...] | None) -> None:
        self._call, self._call_ranks = call_id, ranks
        self._index[0] = self._index[1] = 0
        if self._spills:
            self._reclaim_all()

    def end(self, call_id: int) -> None:
        """(_coll.c's Reducer.end in its place where that built: the same steps.)"""
        self._q[self._left] = call_id  # peers waiting for us in this call give up
        if self._spills or self._pidfds:
            self._tidy()

    def _tidy(self) -> None:
        """At a call's end: close the spills peers took, and the pidfds of the call's long
        waits (watch_peers): none outlives it."""
        if self._spills:
            self._reclaim_all()
        if self._pidfds:
            self.close()

    def _reclaim_all(self) -> None:
        """Close the spills taken since the last look (at most RING per peer stay open)."""
        for dst in list(self._spills):
            self._reclaim(dst)

    # -- scopes and barriers -----------------------------------------------------------------

    def _next(self, which: int, ranks: tuple[int, ...], last: int, desc: int) -> int:
        """The generation of this scope's next collective, whose last phase is ``last`` (1,
        or 3 for a large reduction among 3 or more), once nothing of ours that a peer may
        still read stands in the way (see _settle)."""
        owe, call = self._owe, self._call
        if owe[0] is not None:  # two tests, not a loop: a small allreduce's hot path
            self._settle(0, owe[0], desc)
        if owe[1] is not None:
            self._settle(1, owe[1], desc)
        index = self._index
        i = index[which]
        if i >= _MAX_INDEX or call >= _MAX_CALL:
            raise self._full(which, desc)
        index[which] = i + 1
        gen = (call << _CALL_SHIFT) | (i << 2)
        owe[which] = (call, gen | last, ranks, True)  # until it succeeds
        return gen

    def _full(self, which: int, desc: int) -> CollectiveError:
        """The error for a collective whose generation would not fit its word (see the
        module's docstring): nothing of it was published."""
        if self._call >= _MAX_CALL:
            why = (f"this session ran {_MAX_CALL:,} calls, as many as its collectives can "
                   "tell apart: open a new Session")
        else:
            why = (f"a call may run at most {_MAX_INDEX:,} collectives in each scope (world, "
                   "group): split the loop across several calls")
        return CollectiveError(f"{describe(desc)} on worker {self.rank} "
                               f"({'group' if which else 'world'}): {why}")

    def _settle(self, scope: int, owe: tuple[int, int, tuple[int, ...], bool],
                desc: int) -> None:
        """What peers may still read of ours, from the last collective in ``scope``:
        - it succeeded, in this call: nothing to do. Records alternate by parity, and a
          peer reached every meeting we passed after it.
        - it failed, in this call: raise. Its peers may be anywhere in it (still reading
          our slot, or gone), so what follows in this call cannot be in step.
        - it ran in an earlier call: wait until each peer reached its last phase or left
          that call. The next call starts again at index 0, and our writes would land
          under a peer preempted after a barrier's wait (which would read the next call's
          record), or one still reading our slot after we gave up on another peer."""
        call, need, ranks, failed = owe
        if call == self._call:
            if failed:
                raise CollectiveError(
                    f"{describe(desc)} on worker {self.rank}: an earlier collective of this "
                    "call failed, so this worker is out of step with its peers until the "
                    "call ends; let that CollectiveError end the call instead of going on"
                )
            return
        self._await_readers(scope, call, need, ranks, desc)
        self._owe[scope] = None

    def _arrive(self, which: int, gen: int) -> None:
        self._q[self._w[self.rank] + which] = gen

    def _finish(self, which: int, ranks: tuple[int, ...], last: int, desc: int) -> None:
        """A collective's last phase: arrive at ``last``, wait for every peer. Then each has
        read all this worker showed in it, so nothing is owed (see _settle)."""
        self._arrive(which, last)
        self._await(which, ranks, last, desc)
        self._owe[which] = None

    def _await(self, which: int, ranks: Sequence[int], gen: int, what: str | int) -> None:
        """Wait until every rank in ``ranks`` reached ``gen`` on counter ``which``. ``what``
        names the collective in errors: a name, or its descriptor (named only to raise).
        At a meeting (phase 0) a peer counts only at a generation of this call (below
        ``top``): one already in a later call left this one without joining (a peer that
        met us there waits, in _next, until we passed), and what it shows is that call's.
        At a later phase a peer in a later call passed it."""
        q, w = self._q, self._w
        top = _NEVER if gen & 3 else (self._call + 1) << _CALL_SHIFT
        waiting = [j for j in ranks if not gen <= q[w[j] + which] < top]
        if not waiting:
            return
        pacer = _Pacer()
        look, seen = time.monotonic() + _LOOK, None
        meeting: _Waiting | None = None  # this wait, in the graph of waits, past its first look
        try:
            while True:
                waiting = [j for j in waiting if not gen <= q[w[j] + which] < top]
                if not waiting:
                    return
                self._check(waiting, which, gen, what)
                if meeting is not None:
                    meeting.check(_named(what))
                if not gen & 3 and time.monotonic() >= look:
                    look = time.monotonic() + _LOOK
                    crossed = self._crossed(waiting, which, gen)
                    if crossed and crossed == seen:
                        raise self._crossed_error(crossed[0], which, what)
                    seen = crossed
                    if meeting is None:  # a peer in recv from us, or in a send to us that
                        # waits, would never come: say we wait here (see _Waiting)
                        meeting = _Waiting(self, _MEETING, which)
                pacer.pause()
        finally:
            if meeting is not None:
                meeting.close()

    def _crossed(self, waiting: Sequence[int], which: int,
                 gen: int) -> tuple[tuple[int, int, int], ...]:
        """The peers of ``waiting`` that wait at a meeting of the other scope that includes
        this worker, which it has not reached (one rank called with group=True, another
        without): neither can go on. (peer, its generation there, ours there), each."""
        q, w, other = self._q, self._w, 1 - which
        mine = q[w[self.rank] + other]
        out = []
        for j in waiting:
            theirs = q[w[j] + other]  # before the word of ``which``: a peer arrives there first
            if (not theirs & 3 and theirs >> _CALL_SHIFT == self._call and mine < theirs
                    and (other == 0 or j // self.gsize == self.rank // self.gsize)
                    and q[w[j] + which] < gen):
                out.append((j, theirs, mine))
        return tuple(out)

    def _crossed_error(self, crossed: tuple[int, int, int], which: int,
                       what: str | int) -> CollectiveError:
        j, theirs, _ = crossed
        called = describe(self._q[self._desc_at(j, 1 - which, theirs)])
        scopes = ("the world (group=False)", "its group (group=True)")
        return CollectiveError(
            f"mismatched collectives: worker {self.rank} called {_named(what)} in "
            f"{scopes[which]} but worker {j} called {called} in {scopes[1 - which]}, so each "
            "waited for the other; every worker must call the same collectives, with the same "
            "group=, in the same order", peer=j)

    def _check_abort(self, what: str | int, peers: Sequence[int] = ()) -> None:
        """The controller saw a worker die, or (``watch_peers``) one of ``peers`` is gone:
        every wait gives up."""
        dead = self._q[0]
        if dead:
            raise CollectiveError(f"{_named(what)} gave up: worker {dead - 1} died", peer=dead - 1)
        if self._watch and peers:
            now = time.monotonic()
            if now >= self._next_look:
                self._next_look = now + _LOOK
                for j in peers:
                    if self._gone(j):
                        raise CollectiveError(f"{_named(what)} gave up: worker {j} died",
                                              peer=j)
                if self.give_up_at is not None and now >= self.give_up_at:
                    raise CollectiveError(
                        f"{_named(what)} on worker {self.rank} gave up at the deadline of the "
                        f"call: it runs inline in the controller, which can wait no longer, "
                        f"and worker(s) {sorted(peers)} had not come (busy, stopped or "
                        "stuck). Give the call a longer timeout, or see where they are "
                        "with sess.stacks()")
                if self.hang is not None:  # (a key per wait: its count, on our record)
                    stuck = self.hang((self._call, self._q[self._w[self.rank] + _WAIT] >> 32),
                                      peers)
                    if stuck is not None:
                        raise CollectiveError(
                            f"{_named(what)} on worker {self.rank} gave up: worker(s) "
                            f"{sorted(peers)} made no progress for hang_timeout (none used "
                            "CPU), and worker 0 runs inline in the controller, which would "
                            f"wait for ever.\n{stuck}")

    def _gone(self, j: int) -> bool:
        """Whether peer ``j``'s process has ended (False while it has not said its pid)."""
        pid = self._q[self._w[j] + _PID]
        if not pid or j == self.rank:
            return False
        known = self._pidfds.get(j)
        if known is None or known[0] != pid:
            if known is not None:
                del self._pidfds[j]  # before the close: never closed twice
                os.close(known[1])
            try:
                known = self._pidfds[j] = (pid, os.pidfd_open(pid))
            except ProcessLookupError:
                return True
        return bool(readable([known[1]]))

    def _check(self, waiting: Sequence[int], which: int, gen: int, what: str | int) -> None:
        q, w = self._q, self._w
        self._check_abort(what, waiting)
        top = _NEVER if gen & 3 else (self._call + 1) << _CALL_SHIFT
        for j in waiting:
            left = q[w[j] + _LEFT]  # before its generation: a peer arrives, then leaves
            reached = q[w[j] + which]
            if reached >= top or (left >= self._call and reached < gen):
                crossed = () if gen & 3 else self._crossed((j,), which, gen)
                if crossed:  # it gave up on us first, over the same mismatch: name it
                    raise self._crossed_error(crossed[0], which, what)
                raise self._left_error(_named(what), j, "joining it")

    def _left_error(self, what: str, j: int, without: str) -> CollectiveError:
        """The error for a wait whose peer ``j`` left the call ``without`` doing what it
        waited for. Where ``j`` gave up on a deadlock, this worker says so too (passed on
        to its own waiters: _gave_up)."""
        why = self._gave_up(j)
        if why:
            self._q[self._w[self.rank] + _WAIT_CALL] = self._call | _GAVE_UP
        return CollectiveError(f"{what} on worker {self.rank} gave up: worker {j} left the "
                               f"call without {without} ({why or LEFT_WHY})", peer=j)

    def _gave_up(self, j: int) -> str:
        """Why peer ``j`` left this call, where it gave up on a deadlock (_Waiting): what it
        waited in; "" otherwise."""
        q, w = self._q, self._w
        if q[w[j] + _WAIT_CALL] != self._call | _GAVE_UP:
            return ""
        on, kind = _waits_on(q[w[j] + _WAIT])  # kept by a wait that gave up
        if kind == _MEETING and 0 <= on <= 1:
            waited = f" (it waited in {describe(q[self._desc_at(j, on, q[w[j] + on])])})"
        elif kind in (_SENDING, _RECEIVING) and 0 <= on < self.n:
            waited = (f" (it waited to {'send to' if kind == _SENDING else 'receive from'} "
                      f"worker {on})")
        else:
            waited = ""
        return (f"it gave up on a deadlock{waited} that this worker is in or waits on; the "
                "worker that found it says what it is")

    def _await_readers(self, which: int, call: int, need: int, ranks: Sequence[int],
                       what: int) -> None:
        """Wait until each peer of ``ranks`` reached generation ``need`` or left ``call``."""
        q, w = self._q, self._w
        lingering = [j for j in ranks
                     if j != self.rank and q[w[j] + which] < need and q[w[j] + _LEFT] < call]
        if not lingering:
            return
        pacer = _Pacer()
        while True:
            lingering = [j for j in lingering if q[w[j] + which] < need and q[w[j] + _LEFT] < call]
            if not lingering:
                return
            self._check_abort(what, lingering)
            pacer.pause()

    def _desc_at(self, rank: int, which: int, gen: int) -> int:
        """Index of ``rank``'s (descriptor, signature) words for the collective at ``gen``."""
        return self._w[rank] + _DESC + 4 * which + 2 * ((gen >> 2) & 1)

    def _meet(self, which: int, ranks: tuple[int, ...], gen: int, desc: int, sig: int) -> None:
        """Publish what this rank calls, arrive at ``gen``, wait for the peers, and raise
        CollectiveError on every rank if any of them called something else."""
        q = self._q
        at = self._desc_at(self.rank, which, gen)
        q[at] = desc
        q[at + 1] = sig
        self._arrive(which, gen)
        self._await(which, ranks, gen, desc)
        self._check_records(which, ranks, gen, desc, sig)

    def _check_records(self, which: int, ranks: tuple[int, ...], gen: int, desc: int,
                       sig: int) -> None:
        """Raise CollectiveError on every rank if a peer called something else at ``gen``."""
        q = self._q
        for j in ranks:
            theirs = self._desc_at(j, which, gen)
            if q[theirs] != desc:
                raise CollectiveError(
                    f"mismatched collectives: worker {self.rank} called {describe(desc)} but "
                    f"worker {j} called {describe(q[theirs])}; every worker must call the "
                    "same collectives, with the same op and root, in the same order"
                )
            if q[theirs + 1] != sig:
                raise CollectiveError(
                    f"{describe(desc)}: worker {j} passed data of another shape, dtype or "
                    f"device than worker {self.rank}: every worker must pass data of the same "
                    "shape and dtype, on the same kind of device"
                )

    def arrive(self, group: bool, kind: str, op: str | None = None, root: int | None = None,
               sig: int = 0) -> tuple[int, ...]:
        """A barrier that also checks that every participant calls the same collective
        (``kind``, ``op``, ``root``) on data of the same ``sig`` (see shape_signature).
        Returns the participating ranks."""
        which, ranks = self.scope(group)
        desc = descriptor(kind, op, root)
        gen = self._next(which, ranks, 1, desc)
        self._meet(which, ranks, gen, desc, sig)
        # peers may still read our record: the next call's first collective waits for them
        self._owe[which] = (self._call, gen | 1, ranks, False)
        return ranks

    def barrier(self, group: bool = False) -> None:
        self.arrive(group, "barrier")

    # -- reductions ----------------------------------------------------------------------------

    def allreduce(self, x: Any, op: str, group: bool, out: Any = None) -> Any:
        """(``out``: as unison.allreduce's; a numpy array that fits takes the C steps'
        result directly, with no array made per call.)"""
        if (type(x) is np.ndarray and type(op) is str and self._c is not None
                and self._call_ranks is None):  # the common case, kept short: in C
            shape, dtype = x.shape, x.dtype
            plan = self._small.get((op, dtype, shape, group))
            if plan is None:
                plan = self._small_plan(op, x, group)
            if plan:
                res = np.empty(shape, dtype) if out is None else _result(out, op, shape, dtype)
                status = self._c.small(x, res, plan, self._call,
                                       0 if time.perf_counter() < crowd.until else _C_SPIN_NS)
                if status:  # (_allreduce_c, inlined)
                    self._c_rest(x, res, plan, status)
                if op == "mean":
                    res = _mean(res, len(plan[4]))
                return res if out is None or res is out else into(out, res)  # (no call: hot)
        check_op(op)
        if type(x) is int or type(x) is bool:
            result: Any = self._allreduce_python(x, op, group)
        else:
            result = self._allreduce(x, op, group, descriptor("allreduce", op), out)
        return result if out is None else into(out, result)

    def _allreduce_python(self, x: int, op: str, group: bool) -> int | float:
        """An allreduce of Python ints (or bools): Python's own sum, product, min, max or
        mean of every rank's value, exact at any size, where numpy's int64 would wrap (and
        sum bools as a logical or). The values move as objects; their signature tells an int
        from a bool and from any other data, so a rank that passes another kind raises on
        every rank."""
        which, ranks = self.scope(group)
        got = self._exchange(which, ranks, _encode(x), ranks, descriptor("allreduce", op),
                             PYTHON_SIGNATURES[type(x)])
        return reduce_python([_decode(got[j]) for j in ranks], op)

    def _small_plan(self, op: str, x: np.ndarray, group: bool) -> Plan | tuple[()]:
        """How the C steps reduce ``x`` by ``op`` in ``group``'s scope (see _plan), or ()
        where they do not (another dtype or op, or larger than SMALL). Kept per (op, dtype,
        shape, group), for calls that every worker runs: working it out costs more than
        the C steps."""
        code = _C_CODES.get((op, x.dtype.str))
        plan: Plan | tuple[()] = ()
        if code is not None and x.nbytes <= SMALL:
            which, ranks = self.scope(group)
            plan = _plan(code, array_signature(x), descriptor("allreduce", op), which, ranks)
        if len(self._small) >= 256:
            self._small.clear()
        self._small[op, x.dtype, x.shape, group] = plan
        return plan

    def _allreduce(self, x: Any, op: str, group: bool, desc: int, dest: Any = None,
                   sig: int | None = None) -> Any:
        """``dest``: allreduce's out=, written in place where it fits (else the caller
        copies the result into it). ``sig``: the signature to check, where the caller
        converted its input (reduce_scatter's mean)."""
        arr, restore = _as_array(x)
        _check_reducible(arr, "allreduce")
        ufunc = op_ufunc(op)
        which, ranks = self.scope(group)
        if sig is None:  # (the input's, before a mean converts it: a peer's of another
            sig = array_signature(arr)  # dtype must not pass)
        back = None
        if op == "mean":
            arr, back = _mean_input(arr)
            if back is not None:
                dest = None  # (the caller copies the result into it)
        out = _result(dest, op, arr.shape, arr.dtype)
        code = _C_CODES.get((op, arr.dtype.str)) if self._c is not None else None
        if code is not None and (arr.nbytes <= SMALL or (len(ranks) <= 2 and arr.nbytes <= SLOT)):
            self._allreduce_c(arr, out, _plan(code, sig, desc, which, ranks))
        elif arr.nbytes <= SLOT:
            flat = arr.ndim == 1
            self._allreduce_flat(arr if flat else arr.reshape(-1),
                                 out if flat else out.reshape(-1), ufunc, which, ranks, sig,
                                 desc)
        else:
            if out is not arr and np.may_share_memory(out, arr):
                # each round writes its share of out before the next copies its share of
                # arr: an out over arr at an offset would feed results back as inputs
                out = np.empty_like(out)  # (the caller copies the result into dest)
            flat_in, flat_out = arr.reshape(-1), out.reshape(-1)
            step = SLOT // arr.itemsize
            for lo in range(0, flat_in.size, step):
                self._allreduce_flat(flat_in[lo : lo + step], flat_out[lo : lo + step], ufunc,
                                     which, ranks, sig, desc)
        if op == "mean":
            out = _mean(out, len(ranks), back)
        return restore(out)

    def _allreduce_flat(self, a: np.ndarray, out: np.ndarray, ufunc: Callable[..., Any],
                        which: int, ranks: tuple[int, ...], sig: int, desc: int) -> None:
        whole = a.nbytes <= SMALL or len(ranks) <= 2  # each reduces all of it
        gen = self._next(which, ranks, 1 if whole else 3, desc)
        slots = self._publish(a, sig, which, ranks, gen, desc)
        if whole:
            _reduce_into(out, slots, ufunc)
            self._finish(which, ranks, gen | 1, desc)
            return
        k = ranks.index(self.rank)
        lo, hi = _share(a.size, len(ranks), k)
        g = self.rank // self.gsize if which else 0
        result = self._view(self.lay.result[g], a)
        _reduce_into(result[lo:hi], [s[lo:hi] for s in slots], ufunc)
        self._arrive(which, gen | 1)
        self._await(which, ranks, gen | 1, desc)
        np.copyto(out, result)
        self._finish(which, ranks, gen | 3, desc)

    def _allreduce_c(self, a: np.ndarray, out: np.ndarray, plan: Plan) -> None:
        """_allreduce_flat's "whole" case in C, which every rank takes for this (op, dtype)
        and size (``plan``: see _plan): take the generation, publish, meet, check, reduce,
        depart (unison/_coll.c). C waits only briefly; a wait it gives up continues in
        _c_rest, with every check that _await makes. Same bits as numpy's path, same
        errors."""
        c = self._c
        assert c is not None
        status = c.small(a, out, plan, self._call,
                         0 if time.perf_counter() < crowd.until else _C_SPIN_NS)
        if status:
            self._c_rest(a, out, plan, status)

    def _c_rest(self, a: np.ndarray, out: np.ndarray, plan: Plan, status: int) -> None:
        """What the C steps left to Python: what _next settles, a copy of an input that is
        not C-contiguous (PASS: C did nothing), a crowded machine, a wait it gave up, a
        mismatch (raised here)."""
        c = self._c
        assert c is not None
        _, sig, desc, which, ranks, _, _ = plan
        if status == _C_PASS:
            for scope in (0, 1):  # raises where one failed in this call
                owe = self._owe[scope]
                if owe is not None:
                    self._settle(scope, owe, desc)
            a = _contiguous(a)
            status = c.small(a, out, plan, self._call,
                             0 if time.perf_counter() < crowd.until else _C_SPIN_NS)
            if status == _C_PASS:
                raise CollectiveError(f"{describe(desc)} on worker {self.rank}: the C steps "
                                      f"refused it twice; {_BUG}")
        if status == _C_FULL:
            raise self._full(which, desc)
        gen = c.last_gen
        if status & _C_LONG:
            crowd.met_long_yield(time.perf_counter())
            status &= ~_C_LONG
        if status == _C_MEET:
            self._await(which, ranks, gen, desc)
            status = c.after_meet(a, out, plan, gen)
        if status == _C_MISMATCH:
            self._check_records(which, ranks, gen, desc, 0)
            self._check_sizes(ranks, a.nbytes, sig, desc)
            raise CollectiveError(  # the checks above raise first: only a bug gets here
                f"{describe(desc)} on worker {self.rank}: a peer's record changed under the "
                f"meeting; {_BUG}")
        if status == _C_DEPART:
            self._await(which, ranks, gen | 1, desc)
        self._owe[which] = None

    def reduce_scatter(self, x: Any, op: str, group: bool) -> Any:
        arr, restore = _as_array(x)
        _check_reducible(arr, "reduce_scatter")
        ufunc = op_ufunc(op)
        which, ranks = self.scope(group)
        desc = descriptor("reduce_scatter", op)
        sig = array_signature(arr)  # (the input's, as allreduce's)
        back = None
        if op == "mean":
            arr, back = _mean_input(arr)
        if arr.ndim == 0:
            raise ValueError("reduce_scatter needs an array with a first axis to split")
        if arr.nbytes > SLOT:
            full = self._allreduce(arr, "sum" if op == "mean" else op, group, desc, sig=sig)
            part = np.array_split(full, len(ranks))[ranks.index(self.rank)]
            return restore(_mean(part, len(ranks), back) if op == "mean" else part.copy())
        gen = self._next(which, ranks, 1, desc)
        slots = self._publish(arr.reshape(-1), sig, which, ranks, gen, desc)
        first, last = _share(arr.shape[0], len(ranks), ranks.index(self.rank))
        row = int(np.prod(arr.shape[1:], dtype=np.int64))
        lo, hi = first * row, last * row
        out = np.empty((last - first, *arr.shape[1:]), arr.dtype)
        _reduce_into(out.reshape(-1), [s[lo:hi] for s in slots], ufunc)
        self._finish(which, ranks, gen | 1, desc)
        if op == "mean":
            out = _mean(out, len(ranks), back)
        return restore(out)

    def _publish(self, a: np.ndarray, sig: int, which: int, ranks: tuple[int, ...], gen: int,
                 desc: int) -> list[np.ndarray]:
        """Copy ``a`` into our slot, arrive, wait for the peers, check that they called the
        same reduction (``desc``) on the same shape and dtype (``sig``), and return every
        participant's slot as an array like ``a``, in rank order."""
        me = self._w[self.rank]
        self._q[me + _NBYTES] = a.nbytes
        self._q[me + _SIG] = sig
        mine = self._view(self.lay.slot[self.rank], a)
        np.copyto(mine, a)
        self._meet(which, ranks, gen, desc, 0)
        self._check_sizes(ranks, a.nbytes, sig, desc)
        return [mine if j == self.rank else self._view(self.lay.slot[j], a) for j in ranks]

    def _check_sizes(self, ranks: tuple[int, ...], nbytes: int, sig: int, desc: int) -> None:
        """Raise CollectiveError if a peer's reduction input differs in size or signature."""
        q, w = self._q, self._w
        for j in ranks:
            if q[w[j] + _NBYTES] != nbytes or q[w[j] + _SIG] != sig:
                raise CollectiveError(
                    f"{describe(desc)}: worker {j} passed an array of another shape or dtype "
                    f"({q[w[j] + _NBYTES]} bytes) than worker {self.rank} ({nbytes} bytes): "
                    "every worker must pass the same shape and dtype"
                )

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
        got = self._exchange(which, ranks, _encode(x), ranks, descriptor("allgather"))
        return [_decode(got[j]) for j in ranks]

    def broadcast(self, x: Any, src: int, group: bool, *, kind: str = "broadcast",
                  sig: int = 0) -> Any:
        """``kind`` names the collective this broadcast serves and ``sig`` what it moves, for
        the mismatch check (a plain broadcast: 0)."""
        which, ranks = self.scope(group)
        src_rank = member(ranks, src, group, "src")
        payload = _encode(x) if self.rank == src_rank else []
        got = self._exchange(which, ranks, payload, (src_rank,), descriptor(kind, root=src),
                             sig)
        return _decode(got[src_rank])

    def scatter(self, xs: Sequence[Any] | None, src: int, group: bool) -> Any:
        _, ranks = self.scope(group)
        src_rank = member(ranks, src, group, "src")
        if self.rank == src_rank:
            xs = check_scatter_values(xs, len(ranks))
        self.arrive(group, "scatter", root=src)
        if self.rank == src_rank:
            assert xs is not None
            for j, item in zip(ranks, xs):
                if j != self.rank:
                    self._send(item, j, TAG_SCATTER)
            return _decode(_join(_encode(xs[ranks.index(self.rank)])))
        return self._recv(src_rank, TAG_SCATTER)

    def gather(self, x: Any, dst: int, group: bool) -> list[Any] | None:
        _, ranks = self.scope(group)
        dst_rank = member(ranks, dst, group, "dst")
        self.arrive(group, "gather", root=dst)
        if self.rank != dst_rank:
            self._send(x, dst_rank, TAG_GATHER)
            return None
        return [_decode(_join(_encode(x))) if j == self.rank else self._recv(j, TAG_GATHER)
                for j in ranks]

    def _exchange(self, which: int, ranks: tuple[int, ...], payload: list[Any],
                  wanted: Sequence[int], desc: int, sig: int = 0) -> dict[int, bytearray]:
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
            gen = self._next(which, ranks, 1, desc)
            self._q[me + _NBYTES] = total
            chunk = stream.read(cap)
            base = self.lay.slot[self.rank]
            self._buf[base : base + len(chunk)] = chunk
            self._meet(which, ranks, gen, desc, sig)
            if r == 0:
                rounds = max(1, max(-(-self._q[self._w[j] + _NBYTES] // cap) for j in ranks))
                for j in wanted:
                    got[j] = bytearray(self._q[self._w[j] + _NBYTES])
            for j in wanted:
                size = len(got[j])
                n = min(cap, size - done)
                if n > 0:
                    base = self.lay.slot[j]
                    got[j][done : done + n] = self._buf[base : base + n]
            done += cap
            self._finish(which, ranks, gen | 1, desc)
            r += 1
        return got

    # -- point to point ------------------------------------------------------------------------

    def send(self, x: Any, dst: int) -> None:
        dst = check_peer(dst, self.rank, self.n, "send")
        self._check_peer(dst)
        self._send(x, dst, TAG_SEND)

    def recv(self, src: int) -> Any:
        src = check_peer(src, self.rank, self.n, "recv")
        self._check_peer(src)
        return self._recv(src, TAG_SEND)

    def _check_peer(self, peer: int) -> None:
        if self._call == 0:
            raise RuntimeError("unison send/recv only work inside a function a worker runs")
        if self._call_ranks is not None and peer not in self._call_ranks:
            raise CollectiveError(
                f"worker {peer} does not run this call (it runs on {list(self._call_ranks)}), "
                "so it can never answer: call on a view that includes it"
            )

    def _entry(self, src: int, dst: int, index: int) -> int:
        """Word index of ring entry ``index`` of the pair (src, dst)."""
        return (self.lay.entries[src][dst] + _LINE * (index % RING)) // 8

    def _send(self, x: Any, dst: int, tag: int) -> None:
        """Queue x for ``dst``: inline if it fits, else in a memfd of its own. Waits only
        while RING earlier messages to ``dst`` are untaken."""
        q, w = self._q, self._w
        if q[w[dst] + _LEFT] >= self._call:
            return  # it finished this call already: nobody will ever take the message
        payload = _encode(x)
        total = sum(len(memoryview(p).cast("B")) for p in payload)
        head, tail = self.lay.head[self.rank][dst] // 8, self.lay.tail[self.rank][dst] // 8
        self._reclaim(dst)
        h = q[head]
        if h >= RING:
            old = self._entry(self.rank, dst, h - RING)
            waiting: _Waiting | None = None
            try:
                # the entry RING back must be taken, or stale: its call is over for the receiver
                while q[tail] <= h - RING and q[w[dst] + _LEFT] < q[old + _E_CALL]:
                    if waiting is None:  # the first miss: a wait from here on (as _recv's)
                        what = f"send to worker {dst}"
                        pacer, waiting = _Pacer(), _Waiting(self, _SENDING, dst)
                    else:
                        waiting.check(what)
                    self._check_abort(what, (dst,))
                    pacer.pause()
                if (waiting is not None and q[tail] <= h - RING
                        and q[w[dst] + _WAIT_CALL] == self._call | _GAVE_UP):
                    raise self._left_error(what, dst, "receiving")  # over this send's deadlock
            finally:
                if waiting is not None:
                    waiting.close()
        where = 0
        if total > self.lay.inline:  # first what can fail (no memory, no fds): the entry
            fd = _spill(payload, total)  # is untouched if it does
            self._spills.setdefault(dst, deque()).append((h, self._call, fd))
            where = fd + 1
        e = self._entry(self.rank, dst, h)
        q[e + _E_IDX] = 0  # being written: a receiver reading this stale entry looks later
        if not where:
            box = self.lay.mailbox[self.rank][dst] + self.lay.inline * (h % RING)
            for part in payload:
                part = memoryview(part).cast("B")
                self._buf[box : box + len(part)] = part
                box += len(part)
        q[e + _E_CALL] = self._call
        q[e + _E_TOTAL] = total
        q[e + _E_WHERE] = where
        q[e + _E_TAG] = tag
        q[e + _E_IDX] = h + 1
        q[head] = h + 1  # publish

    def _reclaim(self, dst: int) -> None:
        """Close the spills ``dst`` took, or will never take (it left their call)."""
        spills = self._spills.get(dst)
        if not spills:
            return
        q = self._q
        taken = q[self.lay.tail[self.rank][dst] // 8]
        left = q[self._w[dst] + _LEFT]
        while spills and (spills[0][0] < taken or spills[0][1] <= left):
            os.close(spills.popleft()[2])
        if not spills:
            del self._spills[dst]

    def _recv(self, src: int, tag: int) -> Any:
        q = self._q
        waiting: _Waiting | None = None
        try:
            while True:
                left = q[self._w[src] + _LEFT]  # read before looking: a sender posts, then leaves
                got = self._take(src, tag)
                if got is not None:
                    return _decode(got)
                if waiting is None:  # the first miss: a wait from here on
                    what = f"{'recv' if tag == TAG_SEND else _TAG_NAMES[tag]} from worker {src}"
                    pacer, waiting = _Pacer(), _Waiting(self, _RECEIVING, src)
                else:
                    waiting.check(what)
                self._check_abort(what, (src,))
                if left >= self._call:
                    raise self._left_error(what, src, "sending")
                pacer.pause()
        finally:
            if waiting is not None:
                waiting.close()

    def _take(self, src: int, tag: int) -> bytearray | None:
        """The next message from ``src`` in this call, or None if there is none yet.
        Messages of earlier calls are skipped: they can never be received."""
        q = self._q
        head, tail = self.lay.head[src][self.rank] // 8, self.lay.tail[src][self.rank] // 8
        while True:
            t = q[tail]
            if q[head] <= t:
                return None
            e = self._entry(src, self.rank, t)
            idx = q[e + _E_IDX]
            call, total, where, their_tag = (q[e + _E_CALL], q[e + _E_TOTAL], q[e + _E_WHERE],
                                             q[e + _E_TAG])
            if idx == 0 or q[e + _E_IDX] != idx:
                return None  # the sender is reusing a stale entry's place: _recv looks again
                # (pacing itself, and raising if the sender died or left the call meanwhile)
            if idx > t + 1:  # the sender reused the places of stale messages: skip them
                q[tail] = idx - RING
                continue
            if call < self._call:
                q[tail] = t + 1
                continue
            if call > self._call:
                return None  # the sender is in a later call already: ours sent nothing more
            if their_tag != tag:
                raise CollectiveError(
                    f"{_TAG_NAMES[tag]} on worker {self.rank} got a message that worker {src} "
                    f"sent with {_TAG_NAMES[their_tag]}: every worker must call the same "
                    "collectives in the same order, and receive what it is sent"
                )
            if where == 0:
                box = self.lay.mailbox[src][self.rank] + self.lay.inline * (t % RING)
                out = bytearray(self._buf[box : box + total])
            else:
                out = self._read_spill(src, where - 1, total)
            q[tail] = t + 1  # taken: the sender may reuse the place and close the spill
            return out

    def _read_spill(self, src: int, fd: int, total: int) -> bytearray:
        pid = self._q[self._w[src] + _PID]
        try:
            mine = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            self._check_abort(f"recv from worker {src}")
            raise CollectiveError(
                f"recv on worker {self.rank} could not open the message worker {src} "
                f"spilled into memory of its own ({exc}); workers must be able to open each "
                "other's /proc/<pid>/fd (same user, not hardened against ptrace reads)"
            ) from exc
        try:
            out = bytearray(total)
            view = memoryview(out)
            got = 0
            while got < total:
                n = os.preadv(mine, [view[got:]], got)
                if n <= 0:
                    raise CollectiveError(f"recv on worker {self.rank}: message from worker "
                                          f"{src} is shorter than announced")
                got += n
            return out
        finally:
            os.close(mine)


# -- helpers -----------------------------------------------------------------------------------


class _Waiting:
    """A send, recv or collective's meeting that waits, said on this worker's record, so
    that a cycle of them is raised instead of hung on: two workers that each send RING
    messages to the other before receiving, or each receive from the other first, wait for
    ever (MPI's hang); so do a worker in a collective and its peer in a recv from it. Each
    such wait in the cycle can end only by the next worker's take, send or arrival, and that
    worker waits too. Shared memory shows it all: the record of who waits on whom (``_WAIT``:
    a count that grows with each wait, the peer, or the scope of a meeting, and the kind;
    ``_WAIT_CALL``: the call), the rings' positions, the generations, the peers' left words.
    A meeting waits on each peer of its scope that has not arrived. A cycle back to this
    worker, each wait in it unable to end, seen the same in two looks ``_LOOK`` apart
    (nothing moved in between, so no store on its way was missed) raises CollectiveError on
    the worker that sees it; it then leaves the call, which ends the others' waits on it. A
    meeting says it waits only past its first look (_await): one that meets at once costs
    nothing."""

    __slots__ = ("_at", "_coll", "_next", "_seen")

    def __init__(self, coll: ShmCollectives, kind: int, on: int) -> None:
        """``on``: the peer (a send, a recv), or the scope (a meeting: 0 world, 1 group)."""
        self._coll = coll
        self._at = me = coll._w[coll.rank]
        q = coll._q
        count = (q[me + _WAIT] >> 32) + 1
        q[me + _WAIT_CALL] = coll._call
        q[me + _WAIT] = count << 32 | (on + 1) << 2 | kind
        self._next = time.monotonic() + _LOOK
        self._seen: tuple[tuple[int, int, int, int], ...] | None = None

    def check(self, what: str) -> None:
        """Raise CollectiveError if a cycle of waits through this one is stuck (at most
        one look per ``_LOOK``)."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + _LOOK
        cycle = self._cycle()
        if cycle is not None and cycle == self._seen:
            coll = self._coll
            coll._q[self._at + _WAIT_CALL] = coll._call | _GAVE_UP  # for the others' errors
            raise CollectiveError(f"{what} on worker {coll.rank} gave up: " + _deadlock(cycle))
        self._seen = cycle

    def _cycle(self) -> tuple[tuple[int, int, int, int], ...] | None:
        """(rank, wait word, and two words that show it has not moved: a ring's head and
        tail, or a meeting's generation and descriptor) of each wait from ours around to
        ours, where each can end only by the next one's worker; None where there is none."""
        path: list[tuple[int, int, int, int]] = []
        return tuple(path) if self._reaches(self._coll.rank, path, set()) else None

    def _reaches(self, r: int, path: list[tuple[int, int, int, int]], tried: set[int]) -> bool:
        """Whether worker ``r``'s wait leads back to this worker's, depth first (at most one
        visit per rank), its waits appended to ``path``. A method, not a closure: a closure
        that calls itself is a reference cycle, which kept the collectives' mapping (its
        fd) alive past the session's close until the collector ran."""
        node = self._node(r)
        if node is None:
            return False
        path.append(node[0])
        if self._coll.rank in node[1]:
            return True
        tried.add(r)
        if any(j not in tried and self._reaches(j, path, tried) for j in node[1]):
            return True
        path.pop()
        return False

    def _node(self, r: int) -> tuple[tuple[int, int, int, int], list[int]] | None:
        """Worker ``r``'s wait, as in _cycle, and the workers whose progress alone can end
        it (a meeting: any that has not arrived); None where it is not waiting in this call,
        or its wait can end otherwise (a peer it waits on left the call: it raises)."""
        coll = self._coll
        q, w, call, lay = coll._q, coll._w, coll._call, coll.lay
        word = q[w[r] + _WAIT]
        on, kind = _waits_on(word)
        if on < 0 or q[w[r] + _WAIT_CALL] != call:
            return None
        if kind == _MEETING:
            if on > 1:
                return None
            gen = q[w[r] + on]
            if gen & 3 or gen >> _CALL_SHIFT != call:
                return None  # past the meeting (or the word is not a meeting's)
            first = r // coll.gsize * coll.gsize if on else 0
            missing = []
            for j in range(first, first + coll.gsize) if on else range(coll.n):
                if q[w[j] + _LEFT] >= call:  # before its generation, as _check reads them
                    if q[w[j] + on] < gen:
                        return None
                elif q[w[j] + on] < gen:
                    missing.append(j)
            return (r, word, gen, q[coll._desc_at(r, on, gen)]), missing
        if not 0 <= on < coll.n or on == r or q[w[on] + _LEFT] >= call:
            return None  # its peer left: it ends
        src, dst = (r, on) if kind == _SENDING else (on, r)
        h, t = q[lay.head[src][dst] // 8], q[lay.tail[src][dst] // 8]
        if kind == _SENDING:  # RING untaken, the oldest of them of this call
            stuck = h - t >= RING and q[coll._entry(src, dst, h - RING) + _E_CALL] == call
        else:
            stuck = h == t  # nothing sent and untaken, of any call
        return ((r, word, h, t), [on]) if stuck else None

    def close(self) -> None:
        """The wait ended: the count stays (the next wait's grows), and so does all of a
        wait that gave up on a deadlock, for its peers' errors (_gave_up)."""
        coll, me = self._coll, self._at
        q = coll._q
        if q[me + _WAIT_CALL] != coll._call | _GAVE_UP:
            q[me + _WAIT] = q[me + _WAIT] >> 32 << 32


def _waits_on(word: int) -> tuple[int, int]:
    """What a ``_WAIT`` word waits on (-1: nothing; a peer, or a meeting's scope) and its
    kind (_SENDING, _RECEIVING, _MEETING)."""
    return ((word & 0xFFFFFFFF) >> 2) - 1, word & 3


def _deadlock(cycle: tuple[tuple[int, int, int, int], ...]) -> str:
    """What the cycle of waits is, and what to do."""
    said = []
    kinds = set()
    for i, (r, word, _, desc) in enumerate(cycle):
        on, kind = _waits_on(word)
        kinds.add(kind)
        if kind == _MEETING:
            scope = "its group, group=True" if on else "the world, group=False"
            said.append(f"worker {r} waits in {describe(desc)} ({scope}) for worker "
                        f"{cycle[(i + 1) % len(cycle)][0]}, which has not called it")
        elif kind == _SENDING:
            said.append(f"worker {r} waits to send to worker {on} ({RING} messages to it are "
                        "untaken)")
        else:
            said.append(f"worker {r} waits to receive from worker {on}")
    if _MEETING in kinds:
        fix = ("A collective waits until every worker of its scope calls it; a worker that "
               "waits to receive from one of them (or to send to one, with "
               f"{RING} messages to it untaken) never does: have every worker call the "
               "collectives at the same point among its sends and receives")
    else:
        fix = (f"A send waits while {RING} earlier messages to its peer are untaken: receive "
               "between sends, or have one side send first where each waits to receive")
    return "a deadlock: " + "; ".join(said) + ", and none of them can go on. " + fix


class _Pacer(Pacer):
    """How a collective's wait passes time (unison.pacing): yield the core for its first
    millisecond, then sleep in naps growing to 2 ms, so a long wait costs little CPU but
    still checks its peers."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(spin=_SPIN, cap=_CHECK)


def _named(what: str | int) -> str:
    """A collective's name for an error: as given, or named from its descriptor."""
    return what if isinstance(what, str) else describe(what)


def _as_array(x: Any) -> tuple[np.ndarray, Callable[[np.ndarray], Any]]:
    """``x`` as a contiguous numpy array, and how to turn a result back into x's kind."""
    if type(x) is np.ndarray:
        return _contiguous(x), _same
    if type(x).__module__.startswith("torch"):
        import torch

        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                raise TypeError(
                    "the shared-memory backend takes CPU tensors; use collectives='torch'"
                )
            # (numpy() refuses a tensor with its negative or conjugate bit set)
            arr = _contiguous(x.detach().resolve_conj().resolve_neg().numpy())
            return arr, torch.from_numpy
    if isinstance(x, np.ndarray):
        return _contiguous(x), _same
    if isinstance(x, (int, float, complex, bool, np.generic)):
        return np.asarray(x), lambda r: r[()].item() if not isinstance(x, np.generic) else r[()]
    raise TypeError(
        f"reductions take numpy arrays, CPU torch tensors or numbers, not {type(x).__name__}"
    )


def _check_reducible(arr: np.ndarray, name: str) -> None:
    """Refuse arrays of strings, bytes, objects and records: numpy's add of strings joins
    them into wider ones, which the result, of the input's dtype, cut to the input's width
    with no error; the others cannot be reduced from raw memory at all."""
    if arr.dtype.kind in "USOVT":
        raise TypeError(
            f"{name} reduces numbers, not arrays of dtype {arr.dtype} (strings, bytes, "
            "objects or records): use allgather and combine the values yourself")


def _same(r: np.ndarray) -> np.ndarray:
    return r


def _contiguous(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array (np.ascontiguousarray would turn 0-d into 1-d)."""
    return a if a.flags.c_contiguous else a.copy(order="C")


def _reduce_into(out: np.ndarray, parts: Sequence[np.ndarray], ufunc: Callable[..., Any]) -> None:
    """out = parts[0] op parts[1] op ... in rank order, so every rank gets the same bits."""
    if len(parts) == 1:
        np.copyto(out, parts[0])
        return
    if out.size == 1 and len(parts) > 2:
        # numpy multiplies one complex in place on another path than out of place (other
        # rounding, and inf where the product is finite): fold as numpy's own a * b * c does
        out[...] = functools.reduce(ufunc, parts)
        return
    ufunc(parts[0], parts[1], out=out)
    for p in parts[2:]:
        ufunc(out, p, out=out)


def _result(out: Any, op: str, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """Where a reduction by ``op`` writes its result: allreduce's ``out`` where it can go
    straight there (a plain numpy array of that shape and dtype, C-contiguous, aligned and
    writeable; not for a mean, divided afterwards), else a new array (``into`` then copies
    it to ``out``)."""
    if (out is not None and op != "mean" and type(out) is np.ndarray and out.shape == shape
            and out.dtype == dtype and out.flags.carray):
        return out
    return np.empty(shape, dtype)


def _mean_input(arr: np.ndarray) -> tuple[np.ndarray, np.dtype[Any] | None]:
    """What a mean sums, as numpy's mean does: integers as float64 (and the mean stays
    float64), float16 as float32 (and the mean goes back to float16: summed in float16, two
    ranks' 60000 made inf); and the dtype to go back to, if any."""
    if arr.dtype.kind in "biu":
        return arr.astype(np.float64), None
    if arr.dtype == np.float16:
        return arr.astype(np.float32), arr.dtype
    return arr, None


def _mean(total: np.ndarray, n: int, back: np.dtype[Any] | None = None) -> np.ndarray:
    """The sum divided by n, as ``back`` where the sum was made in a wider dtype
    (``_mean_input``: float16's in float32; integers' stay float64, as numpy's mean). The
    count is an intp, as numpy's mean divides by: complex64 is then divided in complex128
    and rounded once (in complex64 it came out 1 ulp off numpy's; an audit, issue 9,
    forty-ninth pass)."""
    out = np.empty_like(total)
    np.true_divide(total, np.intp(n), out=out, casting="unsafe")  # out=: 0-d stays an array
    return out if back is None else out.astype(back)


def _share(size: int, parts: int, k: int) -> tuple[int, int]:
    base, extra = divmod(size, parts)
    lo = k * base + min(k, extra)
    return lo, lo + base + (1 if k < extra else 0)


def _encode(x: Any) -> list[Any]:
    """The session's codec (unison.protocol), as parts: a header of lengths, the pickle,
    then each out-of-band buffer."""
    bufs: list[Any] = []
    data = protocol.dumps(x, bufs)
    raws = [pb.raw() for pb in bufs]
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
    return protocol.loads(pickled, buffers)


def _spill(payload: list[Any], total: int) -> int:
    """A memfd holding the payload, for a message too large to go inline."""
    fd = os.memfd_create("unison-send", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, total)
        pos = 0
        for part in payload:
            view = memoryview(part).cast("B")
            while view:
                n = os.pwrite(fd, view, pos)
                view = view[n:]
                pos += n
    except BaseException:
        os.close(fd)
        raise
    return fd


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
