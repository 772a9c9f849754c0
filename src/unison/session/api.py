"""Session and View: the controller's face. They turn calls into messages and replies into
values; the rooms next door do the rest.

    sess.call(fn, *args) -> checks.py (arguments) -> fncache.py (is fn on the workers?)
                         -> protocol.py (one message) -> channel.send(msg, ranks) -> workers
                            returns a Ref at once; frees of dropped Refs ride along
    ref.gather()         -> GET to each rank -> router.py waits (one thread reads the channel
                            and hands each reply to its request) -> values, or WorkerError
    a death              -> resources.py describes it (launcher) and stops peers in
                            collectives; the session closes; WorkerDied, then SessionClosed
    close()              -> SHUTDOWN (workers answer with errors nobody fetched:
                            unreported.py warns) -> resources.close()
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import errno
import importlib.util
import itertools
import math
import os
import pickle
import resource
import secrets
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from unison import _native, _proctree, collective, placement, protocol
from unison import channel as channels
from unison import trace as _trace
from unison.cancel import _RESIGNAL, SIGNAL_NAME, Cancelled, refusal
from unison.deadline import deadline as _deadline
from unison.deadline import seconds as _seconds
from unison.debug import stacks as _debug_stacks
from unison.debug.hang import Watchdog
from unison.errors import (
    CancelledError,
    CollectiveError,
    SessionClosed,
    WorkerDied,
    WorkerError,
    note_warning,
    shortened,
)
from unison.launch import Launcher
from unison.launch import create as create_launcher
from unison.pacing import crowd
from unison.protocol import (
    OK,
    call_msg,
    define_msg,
    get_msg,
    is_plain,
    nop_msg,
    put_msg,
    shutdown_msg,
    sync_msg,
)
from unison.refs import Ref
from unison.session import checks
from unison.session.aio import Waits
from unison.session.fncache import FunctionCache
from unison.session.resources import Resources, open_std_fds
from unison.session.router import WHOLE, OutOfStep, Reentered, Request, Router, reentered
from unison.session.signals import raised_by_a_signal
from unison.session.unreported import UnreportedErrors, warn_each
from unison.trace import Stats, Trace
from unison.worker import check_not_loading

__all__ = ["Session", "View"]

_NO_BUFFERS: list[pickle.PickleBuffer] = []
_PICKLED = object()  # arguments _send_quick found that only a pickle carries
_FN_CACHE = 512  # functions kept defined on the workers; older ones are freed
_CLOSED_LOOK_S = 0.1
"""How often a thread waiting for the send lock looks whether the session was closed."""
_ASK_AFTER_DEATH_S = 0.5
"""A death closes the session: how long the survivors known to hold errors nobody fetched
have to hand them over first (as __exit__'s grace after an exception)."""
_COLLECT_S = 30.0
"""How long a trace's end waits for idle workers' events (they answer at once)."""
_BUSY_COLLECT_S = 1.0
"""How long it waits where a worker is still in a call: the collect queues behind that call,
which may never end (one that timed out), so the controller's half is written without them."""
_FAILED_COLLECT_S = 0.1
"""The same where the trace's block is left on an error: the error is not held up."""
_WHERE_S = 0.1
"""How long a TimeoutError's report waits for the workers' stacks, past the deadline. A
worker answers within milliseconds (faulthandler writes from its C signal handler, even in
a long C call); one that blocks the signal or sleeps in the kernel never does, and with 1 s
a ``timeout=0.2`` took 1.2 s: ten times the usual answer, a small overrun of any timeout."""
_GRACE_MAX = threading.TIMEOUT_MAX / 2
"""The longest grace close() waits (some 146 years): a longer one would overflow the lock's
and the relay thread's waits (``OverflowError`` past threading.TIMEOUT_MAX), after the
session was marked closed; half of it, as the waits add the time spent."""
_names = itertools.count()
_live: weakref.WeakSet[Session] = weakref.WeakSet()


class View:
    """A set of workers of a session, addressed by global rank: ``sess[i]``, ``sess[a:b]``,
    ``sess.group(g)``, or the whole session. A view is not indexed again."""

    def __init__(self, session: Session, ranks: tuple[int, ...]) -> None:
        self._session = session
        self.workers = ranks
        """The global ranks in this view, ascending."""

    def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Ref:
        """Run ``fn(*args, **kwargs)`` on every worker of the view; return a Ref at once."""
        session, ranks = self._session, self.workers
        return Ref(session, session._send_quick(ranks, fn, args, kwargs, None), ranks)

    def run(
        self, fn: Callable[..., Any], /, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """``call`` then ``gather``: every worker's result, in rank order."""
        # a bad timeout is refused before anything is sent
        deadline = None if timeout is None else _deadline(timeout)
        return self._session._run(self.workers, fn, args, kwargs, deadline)

    async def run_async(
        self, fn: Callable[..., Any], /, *args: Any, timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """``run`` for asyncio: the event loop goes on while the workers run ``fn``.
        Cancelling the awaiting task (or ``timeout``) abandons only the wait."""
        session = self._session
        deadline = _deadline(timeout)
        req = Request(next(session._ids), len(self.workers))  # its ref id: when sent
        fut = session._waits.prepare(req)
        try:
            session._send_quick(self.workers, fn, args, kwargs, req, deadline)
        except BaseException:
            session._waits.cancel(req)
            raise
        return await session._results_async(req, fut, self.workers, timeout, "running a call")

    async def sync_async(self, timeout: float | None = None) -> None:
        """``sync`` for asyncio."""
        await self._session._sync_async(self.workers, timeout)

    def put(self, value: Any) -> Ref:
        """The same value on every worker of the view."""
        return self._session._put(self.workers, [value])

    def scatter(self, values: Sequence[Any]) -> Ref:
        """One value per worker of the view, in rank order."""
        values = checks.values_per_worker(values, "scatter")
        if len(values) != len(self.workers):
            raise ValueError(
                f"scatter needs one value per worker: got {len(values)} values for "
                f"{len(self.workers)} workers {list(self.workers)}"
            )
        return self._session._put(self.workers, values)

    def sync(self, timeout: float | None = None) -> None:
        """Wait until every worker of the view has done all it was sent; raise any error from
        those calls that nobody fetched yet (each error is reported once)."""
        self._session._sync(self.workers, timeout)

    def stacks(self, timeout: float = 2.0) -> _debug_stacks.Stacks:
        """The Python stack of every thread on each worker of the view, even one stuck in a
        C call (see docs/debugging.md): {rank: WorkerStacks}, frames innermost first. A
        worker that cannot be asked or does not answer within ``timeout`` s says why.
        Asking signals each worker: a sleep, poll or select its C code is in then ends early
        (EINTR or a short sleep; Python's own calls resume theirs, PEP 475)."""
        return self._session._stacks(self.workers, timeout)

    def __len__(self) -> int:
        return len(self.workers)

    def __iter__(self) -> Iterator[View]:
        """One view per worker, in rank order."""
        session = self._session
        return iter([View(session, (r,)) for r in self.workers])

    def __getitem__(self, key: object) -> View:
        raise TypeError(
            "a view is not indexed again: index the session itself with global ranks, "
            "e.g. sess[2] or sess[1:3]"
        )

    def __repr__(self) -> str:
        return f"<unison view of workers {list(self.workers)}>"

    def __reduce__(self) -> Any:
        """A session (or a view) captured by a worker's function: pickle's own error named
        a lock inside it, not the session."""
        raise TypeError(
            f"{self!r} cannot travel to the workers (a function or argument of a call holds "
            "it): a worker cannot drive the session. Inside worker code use unison.rank(), "
            "the collectives and the Refs passed as arguments; put data on the workers with "
            "sess.put or sess.scatter"
        )


class Session(View):
    """One controller driving ``num_workers`` worker processes in lockstep.

    Usable from several threads at once; closed by ``close()``, by leaving a ``with`` block,
    at garbage collection and at interpreter exit.
    """

    def __init__(
        self,
        num_workers: int,
        num_groups: int = 1,
        *,
        launcher: str | Launcher = "local",
        channel: str = "auto",
        env: Mapping[int, Mapping[str, str]] | None = None,
        cpu_affinity: bool | Mapping[int, Iterable[int]] | None = None,
        collectives: str = "shm",
        start_timeout: float = 60.0,
        send_timeout: float | None = None,
        trace: str | os.PathLike[str] | None = None,
        hang_timeout: float | None = None,
        inline_worker0: bool = False,
    ) -> None:
        """Start the workers.

        num_workers: how many worker processes (ranks 0..num_workers-1).
        num_groups: split them into this many equal groups (it must divide num_workers),
            for ``group=True`` collectives (tensor parallel inside a group, data parallel
            across them).
        launcher: "local" (processes on this host), "ray" (Ray actors, docs/cluster.md),
            "connect" (workers started with ``unison worker --connect``), or a
            unison.launch.Launcher instance.
        channel: "auto" (shared memory where the platform has it, else pipes), "shm" or
            "pipe".
        env: {rank: {"NAME": "value"}}, environment variables set for those workers.
        cpu_affinity: True pins worker r to one CPU, round robin (not worker 0 inline);
            {rank: [cpus]} as given; False never; None holds local workers one to a CPU
            only where the session's processes outnumber the CPUs, until the machine looks
            crowded (unison.placement), and never moves a thread the user's code moved.
        collectives: "shm" (shared memory) or "torch" (torch.distributed: gloo, NCCL for
            CUDA tensors; across hosts, the only ones).
        start_timeout: seconds the workers may take to start (TimeoutError; what started
            is stopped).
        send_timeout: how long ``call``, ``put`` and ``scatter`` may block when the workers
            fall behind and the command queue is full (TimeoutError; nothing of that
            message was sent). A message that streams (a pipe or TCP worker taking a large
            one part by part) waits that long for each part: one that stops moving half
            sent closes the session.
        trace: a path: a timeline of every call from now until close(), written there in
            the Chrome/Perfetto trace format (see ``trace()``).
        hang_timeout: a wait whose workers make no progress (use no CPU, as /proc shows it
            for the workers on this host) for that many seconds raises unison.HangError,
            saying where each worker is (docs/debugging.md).
        inline_worker0: run worker 0's share in this process, in the thread that sends each
            call, as Disco does: one process fewer on the cores (the fastest round trip),
            for worker 0's failure isolation (unison.launch.inline says what it gives up)."""
        check_not_loading()  # a module that opens a session at import, in a worker
        num_workers, num_groups = checks.check_sizes(num_workers, num_groups)
        if not isinstance(inline_worker0, bool):  # "no" would be true
            raise TypeError(f"inline_worker0 must be True or False, not {inline_worker0!r}")
        if inline_worker0:
            checks.inline_worker0(num_workers, launcher, channel, collectives)
        if collectives not in ("shm", "torch"):
            raise ValueError(f"unknown collectives backend {collectives!r}: use 'shm' or 'torch'")
        if collectives == "torch" and importlib.util.find_spec("torch") is None:
            raise ImportError(  # (before, the first collective's ModuleNotFoundError)
                "collectives='torch' needs torch: pip install 'unison[torch]'")
        start_deadline = _deadline(start_timeout, "start_timeout")
        # the checked floats from here on, not the values given: 10**400 is inf, and a
        # Fraction formats as no float does (an audit of timeouts, issue 9, 48th pass)
        send_s = None if send_timeout is None else _seconds(send_timeout, "send_timeout")
        hang_s = None if hang_timeout is None else _seconds(hang_timeout, "hang_timeout")
        if hang_s is not None and not hang_s > 0:
            raise ValueError(f"hang_timeout must be a number of seconds > 0, got {hang_timeout}")
        open_std_fds()  # before any fd of ours: none may take the number of a closed one
        the_launcher = create_launcher(launcher)
        the_launcher.start_deadline = start_deadline  # (it may place the workers first)
        cpus = checks.cpu_plan(num_workers, cpu_affinity, children=the_launcher.children,
                               inline=inline_worker0)
        spread = cpu_affinity is None  # unison.placement's policy: held only while calm
        envs = checks.check_env(num_workers, env)
        self.num_workers = num_workers
        self.num_groups = num_groups
        self.name = f"unison-{os.getpid()}-{next(_names)}-{secrets.token_hex(3)}"
        self.workers = tuple(range(num_workers))
        self._closed = True  # until the workers are up
        self._placed: Callable[[], None] | None = None  # unregisters unison.placement's hooks
        self._owner = os.getpid()
        self._stopping = False
        self._dead: BaseException | None = None
        self._send_timeout = None if send_s == math.inf else send_s
        self._tracer: Trace | None = None
        self._tracing = False  # the trace slot is claimed (set before _tracer, which the
        # hot paths test, is)
        self._ids = itertools.count(1)
        self._unsent = 0  # the id of a call still on its way out (taken under the send lock)
        self._frees: collections.deque[int] = collections.deque()
        self._fns = FunctionCache(_FN_CACHE)
        self._errors = UnreportedErrors()
        self._send_lock = threading.RLock()
        # re-entrant: a signal handler's close() may land in the thread inside _shutdown's
        # first lines (a SIGTERM as a with-block exits): whichever sets _stopping closes
        self._state_lock = threading.RLock()
        try:
            self._res = Resources(self.name, num_workers, num_groups, channel, collectives,
                                  the_launcher)  # on failure, it releases what it made
        except OSError as exc:
            _too_many_files(exc, num_workers)
            raise
        try:
            self._chan = self._res.chan
            self._pump = self._res.inline_worker0() if inline_worker0 else None
            owner = weakref.proxy(self)  # a strong one made a cycle: a dropped session
            # stayed open, its workers running and its fds held, until the cycle collector ran
            self._router = Router(num_workers, self._chan, self._errors, owner, watched=False)
            self._waits = Waits(owner, self._chan, self._router)
            ready = Request(protocol.READY_REQ, num_workers)
            self._router.expect(ready, self.workers)
            self._closed = False
            self._res.start(self._res.specs(num_workers, num_groups, cpus, spread), envs,
                            start_deadline)
            self._router.set_watched(self._res.watched)
            self._router.wait(ready, start_deadline, "starting")
            crowd.forget()  # the workers' start was no crowd of strangers
            self._pids = [pid for _, pid in self._router.decode(ready, self.workers)]
            # with the pids, their start times: a pid signalled later must still be ours
            self._starts = [_proctree.started(pid) if the_launcher.children else None
                            for pid in self._pids]
            if spread:
                self._placed = placement.keep(self._pids, self._starts, cpus,
                                              inline=inline_worker0,
                                              children=the_launcher.children)
            if hang_s is not None and hang_s != math.inf:
                self._router.hang = Watchdog(hang_s, self._pids, self._starts)
                if inline_worker0:
                    self._res.watch_hangs(self._router.hang)
            if collectives == "torch":  # on every worker, first (see start_torch)
                self.call(collective.start_torch)
            self._last_trace: Trace | None = None
            if trace is not None:
                self._start_trace(trace)
        except BaseException as exc:
            self._shutdown_beside(exc)
            _too_many_files(exc, num_workers)
            raise
        _live.add(self)

    @property
    def _session(self) -> Session:  # type: ignore[override]
        """A session is the view of all its workers (a property: no reference cycle, so the
        session is closed as soon as the last reference to it goes)."""
        return self

    # View's call, run and sync, without the property above: the hot path of dispatch and
    # gather_small (the property costs about as much as a call; a plain attribute would be
    # a reference cycle)
    def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Ref:
        """Run ``fn(*args, **kwargs)`` on every worker; return a Ref at once."""
        ranks = self.workers
        return Ref(self, self._send_quick(ranks, fn, args, kwargs, None), ranks)

    def run(
        self, fn: Callable[..., Any], /, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """``call`` then ``gather``: every worker's result, in rank order."""
        deadline = None if timeout is None else _deadline(timeout)  # refused before a send
        return self._run(self.workers, fn, args, kwargs, deadline)

    def sync(self, timeout: float | None = None) -> None:
        """Wait until every worker has done all it was sent; raise any error from those
        calls that nobody fetched yet (each error is reported once)."""
        self._sync(self.workers, timeout)

    # -- views ---------------------------------------------------------------------------------

    def __getitem__(self, key: object) -> View:
        self.check_open()
        if isinstance(key, slice):
            ranks = tuple(range(self.num_workers)[key])
            if len(ranks) > 1 and ranks[0] > ranks[1]:
                written = ":".join("" if v is None else str(v)
                                   for v in (key.start, key.stop, key.step))
                raise ValueError(
                    f"sess[{written}] would list workers in falling order, but a view's "
                    "workers, results and scatter go in rank order: take the view with a "
                    "positive step and reverse its results yourself"
                )
            if not ranks:
                raise ValueError(
                    f"sess[{key.start}:{key.stop}] selects no worker of {self.num_workers}"
                )
            return View(self, ranks)
        rank = checks.as_rank(key, "index a session with an int rank or a slice")
        if not -self.num_workers <= rank < self.num_workers:
            raise IndexError(
                f"worker index {rank} is out of range for a session of {self.num_workers} workers"
            )
        return View(self, (rank % self.num_workers,))

    def group(self, g: int) -> View:
        """The workers of group ``g``: ranks g*size .. (g+1)*size - 1."""
        self.check_open()
        g = checks.as_rank(g, "a group is named by an int")
        if not 0 <= g < self.num_groups:
            raise ValueError(f"group must be an int in 0..{self.num_groups - 1}, got {g!r}")
        size = self.num_workers // self.num_groups
        return View(self, tuple(range(g * size, (g + 1) * size)))

    # -- Disco's idioms: data through one worker, then over the collectives --------------------

    def broadcast_from(self, value: Any, src: int = 0) -> Ref:
        """Send ``value`` to worker ``src`` alone, then broadcast it from there to every worker
        over the collectives (NCCL for CUDA tensors with collectives="torch")."""
        src = self._check_rank(src)
        return self.call(collective.broadcast, self._one_on(src, value), src)

    def scatter_from(self, values: Sequence[Any], src: int = 0) -> Ref:
        """Send the list ``values`` to worker ``src`` alone, then scatter it from there:
        worker r ends up with ``values[r]``."""
        src = self._check_rank(src)
        values = checks.values_per_worker(values, "scatter_from")
        if len(values) != self.num_workers:
            raise ValueError(f"scatter_from needs one value per worker ({self.num_workers})")
        return self.call(collective.scatter, self._one_on(src, values), src)

    def gather_to(self, ref: Ref, dst: int = 0) -> Ref:
        """Gather every worker's object of ``ref`` to worker ``dst``, as a list in rank
        order (None on the others); fetch it with ``.get(worker=dst)``."""
        return self.call(collective.gather, ref, self._check_rank(dst))

    def _one_on(self, rank: int, value: Any) -> Ref:
        return self.scatter([value if r == rank else None for r in self.workers])

    # -- shared memory -------------------------------------------------------------------------

    def empty(self, shape: int | tuple[int, ...], dtype: Any = float) -> Any:
        """A numpy array in the session's shared memory.

        Passing it, or any contiguous slice of it, to ``call``, ``put`` or ``scatter`` sends
        no copy: each worker maps the same memory, so workers can also fill it in place for
        the controller to read, at any size. (Other large arrays reach the workers after
        one copy, as private copy-on-write pages.) The pipe channel shares it too; where
        there is no memfd to share it with, this raises rather than hand out a copy."""
        import numpy as np

        self.check_open()
        dt = np.dtype(dtype)
        if dt.hasobject:  # numpy's own error ("cannot create an OBJECT array from memory
            raise TypeError(  # buffer") gave no way on
                f"sess.empty(..., {dt}) cannot be: shared memory holds bytes, not Python "
                "objects (each worker has its own). Use a numeric dtype, or send objects "
                "with sess.put / sess.scatter")
        shape_t = checks.shape(shape)
        count = math.prod(shape_t)  # (exact: numpy's int64 product wraps, past 2**63)
        if count * dt.itemsize > sys.maxsize:
            raise ValueError(
                f"sess.empty({shape_t}, {dt}) would take {count * dt.itemsize:,} bytes, more "
                f"than any array can ({sys.maxsize:,}): ask for a smaller shape")
        if count * dt.itemsize == 0:
            return np.empty(shape_t, dt)
        arena = self._chan.arena
        if arena is None:
            raise RuntimeError(
                "sess.empty needs shared memory that every worker maps, which this session "
                "lacks (its platform has no memfd, or some of its workers join over TCP): "
                "send the array with put/scatter and fetch the workers' results instead"
            )
        self._lock_send(None)
        try:
            self.check_open()
            memory = arena.shared_array(count * dt.itemsize)
        finally:
            self._send_lock.release()
        return np.frombuffer(memory, dt, count).reshape(shape_t)

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float = 3.0) -> None:
        """Let calls in flight finish for up to ``timeout`` seconds, then stop every worker.
        Errors of calls that nobody fetched are not lost: each becomes a RuntimeWarning.
        A worker stopped before it could hand them over (still busy at the end of the
        grace, or ``timeout=0``) cannot say them; where the channel shows that it held some
        (shared memory; the pipe and TCP channels' last reports), one RuntimeWarning says
        so. A death closes the session too: survivors known to hold such errors get 0.5 s
        to hand them over first. Idempotent."""
        grace = _seconds(timeout, "timeout", none=False)
        if grace == math.inf:
            raise ValueError("close(timeout=...) needs a finite number of seconds")
        grace = min(grace, _GRACE_MAX)
        if (self._tracer is not None and not self._closed and self._dead is None
                and not (_owned(self._send_lock) or _owned(self._router.recv_lock))):
            # Session(trace=...): the workers' events, then the file; bounded by the grace
            # (at least 1 s), so a stuck call does not stretch the close (half of it where a
            # call is in flight: the other half is for idle workers' goodbye, their errors).
            # Not nested in this thread's own send or read (a signal handler's close): its
            # CALL would land amid theirs; the close writes the controller's half then
            start = time.monotonic()
            try:
                self._stop_trace(max(grace, _BUSY_COLLECT_S), grace / 2)
            except BaseException as exc:  # also where the file could not be written (a full
                # disk): the workers stop all the same, then its error goes on
                self._shutdown_beside(exc, max(0.0, grace - (time.monotonic() - start)))
                raise
            grace = max(0.0, grace - (time.monotonic() - start))
        self._shutdown(grace)

    def _shutdown_beside(self, exc: BaseException, grace: float = 0.0) -> None:
        """Close while ``exc`` (a death, Ctrl-C, a failed start or close) is on its way to
        the user. Where warnings are errors (-W error) the close's warnings become notes on
        ``exc``: raised, they would replace it (a death read as a RuntimeWarning, which
        ``except WorkerDied`` misses)."""
        try:
            self._shutdown(grace)
        except Warning as warning:
            note_warning(exc, warning)

    def _shutdown(self, grace: float) -> None:
        with self._state_lock:
            self._closed = True
            # looked at and set in one statement: no call between them where a signal
            # handler's close (the lock is re-entrant for it) could run
            stopping, self._stopping = self._stopping, True
            if stopping:
                return
        router = getattr(self, "_router", None)
        if router is not None:
            router.closed = True
        placed, self._placed = getattr(self, "_placed", None), None
        if placed is not None:
            placed()
        if os.getpid() != self._owner:
            return  # a forked child's copy: the workers belong to the parent, leave them be
        dropped = self._drop_trace()  # (written once the workers are stopped, below)
        res = getattr(self, "_res", None)
        if res is None:
            return  # the resources' own creation failed, and released what it made
        if router is None:  # failed right after: nothing was started, release the rest
            res.close(0.0)
            return
        # a close inside this thread's own send or read (a signal handler's: the locks let
        # it through) sends no SHUTDOWN amid the message half written, and reads nothing amid
        # the read it cut short (the channel's rx lock, not re-entrant, would wait for ever)
        # (a death found in this thread's own send too; one found in a read was found after
        # the channel's read let go, so its drain may read, as a close of grace 0 never does)
        sending = _owned(self._send_lock)
        reading = grace > 0 and _owned(router.recv_lock)
        dead = self._dead
        ranks = self.workers if dead is None else tuple(
            r for r in self.workers if r != getattr(dead, "worker", None))  # its survivors
        # where the channel shows it, which workers hold errors nobody fetched: if they are
        # stopped before they hand them over, say so rather than lose them in silence
        try:
            if self._chan.settles:  # (pipe, TCP: as of the last report read) the reports
                self._chan.settled(ranks, 0.0)  # waiting unread, e.g. of workers gone busy
            holding = self._chan.holding(ranks)
        except (OSError, ValueError):  # the channel is closed already
            holding = []
        if dead is not None and holding and not sending:  # (no goodbye amid a send)
            # a death closes at once, but the errors survivors hold may be its cause: they
            # are asked for them, briefly (idle ones answer at once; WorkerDied waits)
            grace = _ASK_AFTER_DEATH_S
        deadline = time.monotonic() + (0.0 if sending else grace)  # (no SHUTDOWN: no exit)
        goodbye = None
        # a thread blocked sending (to busy workers) holds the send lock: don't wait past grace
        if grace > 0 and ranks and not sending and self._send_lock.acquire(timeout=grace):
            try:
                # the workers answer SHUTDOWN with their unreported errors, read below
                goodbye = Request(next(self._ids), len(ranks))
                goodbye.abandoned = True
                router.expect_goodbye(goodbye, ranks)
                self._chan.send(shutdown_msg(None, goodbye.req_id), ranks, deadline=deadline)
            except OSError:  # TimeoutError too: the workers are stopped all the same
                goodbye = None
            finally:
                self._send_lock.release()
        # a thread inside worker 0's inline call holds the send lock for that call's length;
        # it is in no send (its message went), and raises SessionClosed once its call returns
        locks = _Both(self._send_lock, router.recv_lock, None if self._pump is None else
                      self._res.launcher.in_call_elsewhere)  # type: ignore[attr-defined]
        self._waits.close()  # an event loop stops watching fds that are about to close
        # once the workers are gone, a sender still inside the channel fails out at once
        said: list[str] = []  # the warnings, issued last: under -W error each one raises,
        stopped: Warning | None = None  # and a close cut short would leave the rest undone
        try:
            # the replies left in the rings once the workers are gone are read, SHUTDOWN's
            # answers and, without one, what came before it (a SYNC's answers before a
            # Ctrl-C carry the errors their workers no longer hold: they were lost with no
            # warning); never amid a read or send this thread cut short
            drains = (not reading if goodbye is not None
                      else not sending and not _owned(router.recv_lock))
            res.close(max(0.0, deadline - time.monotonic()),
                      router.drain if drains else None, locks)
        except Warning as exc:  # the launcher's, under -W error, raised once it had stopped
            stopped = exc  # everything: the other warnings still go out, after it
        finally:  # a done callback that raised in drain: every other wait still ends
            try:
                router.fail_all(self._dead if self._dead is not None else SessionClosed(
                    "the session was closed while this wait was pending"))
            finally:
                _live.discard(self)
                if dropped is not None:
                    said.append(self._write_dropped(dropped))
        said += self._errors.take_warnings(self.name)
        lost = [r for r in holding if goodbye is None or r in router.pending(goodbye)]
        if lost:
            why = (f"close's grace: {grace:g} s" if dead is None else
                   f"after worker {getattr(dead, 'worker', '?')} died, {grace:g} s to answer")
            said.append(
                f"worker(s) {lost} held errors of calls nobody fetched, and {self.name} was "
                f"closed before they could hand them over ({why}): get or gather the Refs, "
                "or call sess.sync(), before closing to see them")
        warn_each(said, stacklevel=4, raised=stopped)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        # after an exception, a short grace: enough for idle workers to answer SHUTDOWN with
        # the errors nobody fetched (none at all lost them), not enough to keep the user
        error = exc[1]
        if not isinstance(error, BaseException):
            self.close(timeout=3.0)
            return
        try:
            self.close(timeout=0.5)
        except Warning as warning:  # -W error: the block's exception goes on, not the close's
            note_warning(error, warning)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            # the cycle collector clears weak references before it calls __del__: the router
            # and the waits hold the session itself while it closes (a trace's events were
            # lost, the router's looks at the workers failing on the dead proxy)
            router, waits = self._router, self._waits
            weak = router._owner, waits._owner
            router._owner = waits._owner = self
            try:
                self.close(timeout=1.0)
            finally:  # no cycle left: the session is freed as this returns
                router._owner, waits._owner = weak

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<unison.Session {self.name} workers={self.num_workers} {state}>"

    # -- the calls behind Session, View and Ref ------------------------------------------------

    def _send_quick(
        self, ranks: tuple[int, ...], fn: Callable[..., Any], args: tuple[Any, ...],
        kwargs: dict[str, Any], req: Request | None, send_by: float | None = None,
    ) -> int:
        """``_send_call``, by ``send_by`` (None: the session's send timeout, if any). The
        usual case (a function the workers hold, a few plain arguments, no deadline or
        trace) is sent from this one frame: on a core shared with a worker the steps a round
        touches cost more than their own time (docs/benchmarks.md, "Issue 9, fourth pass",
        and the fifth on what a bare call costs). Refs among plain arguments go by id."""
        blob: Any = args or None
        if kwargs or (args and not checks.plain_args(args)):
            blob = self._ref_args(ranks, args, kwargs)
            if blob is None:
                blob = _PICKLED  # (for _send_call: no second look at them)
        if not (send_by is not None or self._send_timeout is not None
                or self._tracer is not None or blob is _PICKLED):
            # Ctrl-C anywhere in here (or any signal handler's exception: session/signals.py)
            # closes the session, as during a wait: whether the workers got the message is
            # not known. (One that lands between the acquire and the try leaves the lock
            # held: then waiters see the close, see _lock_send.)
            try:
                lock = self._send_lock
                if lock._is_owned():  # type: ignore[attr-defined]  # (_owned, inlined)
                    raise self._reentered()
                if not lock.acquire(False):
                    self._lock_send(None)
                try:
                    pump = self._pump  # (read once: both looks below cost one attribute)
                    if pump is not None:
                        self._res.launcher.check_free()  # type: ignore[attr-defined]
                    fns = self._fns
                    plan = fns.last_plan  # see FunctionCache.last
                    fn_id = (0 if self._closed  # closed: under the lock
                             else fns.last_id if fn is fns.last and (plan is None or plan.holds())
                             else fns.lookup(fn)[0])
                    everyone = ranks == self.workers
                    if fn_id and (everyone or not self._frees):
                        ref_id = next(self._ids)  # under the send lock: see _send_call
                        if req is not None:
                            req.ref_id = ref_id
                        # frees must reach every worker: a call to some leaves any that came
                        # in since the test above to the next send (the slow way: a NOP to all)
                        frees = None
                        if everyone and self._frees:  # _take_frees, inlined: each dispatch
                            # round frees the Ref before (benchmarks/session_parts.py)
                            pop, waiting, taken = self._frees.popleft, self._frees, []
                            while waiting:
                                taken.append(pop())
                            frees = tuple(taken)
                        try:
                            if req is not None:
                                self._router.expect(req, ranks)
                            msg = call_msg(frees, ref_id, fn_id, blob,
                                           None if everyone else ranks,
                                           0 if req is None else req.req_id)
                            if not self._chan.send_plain(msg, ranks):  # room to wait for:
                                self._unsent = ref_id  # not sent yet (see _sent_below)
                                try:
                                    self._chan.send(msg, ranks)
                                finally:
                                    self._unsent = 0
                            if pump is not None:
                                self._run_inline()
                        except BaseException as exc:
                            if req is not None:
                                self._router.forget(req, ranks)
                            self._closed_under(exc)
                            raise self._send_failed(exc, frees, ranks)  # noqa: B904 (there)
                        return ref_id
                finally:
                    lock.release()
            except BaseException as exc:
                self._close_if_signalled(exc)
                raise
        return self._send_call(ranks, fn, args, kwargs,
                               self._send_deadline() if send_by is None else send_by, req,
                               blob)

    def _send_call(
        self, ranks: tuple[int, ...], fn: Callable[..., Any], args: tuple[Any, ...],
        kwargs: dict[str, Any], deadline: float | None, req: Request | None,
        blob: Any,
    ) -> int:
        """Send a CALL; its ref id. With ``req`` (run), the workers reply with the result at
        once and keep nothing. ``blob``: the arguments as ``_send_quick`` made them for the
        CALL (None for none, plain values, Refs by id, checked), or _PICKLED where it found
        that only a pickle carries them: pickled here."""
        if self._closed:
            self.check_open()
        if not callable(fn):
            raise TypeError(f"call needs a callable first, got {type(fn).__name__}")
        bufs = _NO_BUFFERS
        if blob is _PICKLED:
            blob, bufs = self._encode_args(ranks, fn, args, kwargs)
        try:  # Ctrl-C in here closes the session (see _send_quick)
            if self._send_lock._is_owned():  # type: ignore[attr-defined]  # (_lock_send's
                raise self._reentered()  # first steps, inlined)
            if not self._send_lock.acquire(False):
                self._lock_send(deadline)
            try:
                # taken under the send lock, so that ids grow in the order calls reach the
                # workers: a worker's collectives tell calls apart by their ids, and a call that
                # overtook a lower one made its peers think they had left (several threads)
                self._unsent = ref_id = next(self._ids)  # (see _sent_below)
                if req is not None:
                    req.ref_id = ref_id
                fn_id, fresh = self._fns.lookup(fn)
                cached = True
                if not fn_id:
                    fn_id, cached = self._define(fn, fresh, deadline)
                try:
                    if req is not None:
                        self._router.expect(req, ranks)
                    self._send(call_msg, (ref_id, fn_id, blob,
                                          None if ranks == self.workers else ranks,
                                          0 if req is None else req.req_id),
                               ranks, bufs, deadline)
                except BaseException:
                    if req is not None:
                        self._router.forget(req, ranks)
                    raise
                finally:
                    if not cached:
                        self._frees.append(fn_id)  # dropped with the next message, after this call
            finally:
                self._unsent = 0  # (also where the lookup or the DEFINE raised)
                self._send_lock.release()
            return ref_id
        except BaseException as exc:
            self._close_if_signalled(exc)
            raise

    def _put(self, ranks: tuple[int, ...], values: list[Any]) -> Ref:
        if self._closed:
            self.check_open()
        deadline = self._send_deadline()
        blobs: list[tuple[Any, list[pickle.PickleBuffer]]]
        if len(values) > 1 and is_plain(values):  # a scatter in one message (put_msg)
            blobs = [(dict(zip(ranks, values)), _NO_BUFFERS)]
        else:  # inside the message where plain, or a small numpy value's array payload;
            blobs = []  # else pickled; one message a worker for scatter
            for v, what in _labelled(values):
                if is_plain(v):
                    blobs.append(((v,), _NO_BUFFERS))
                elif (array := protocol.array_payload(v)) is not None:
                    blobs.append(([array], _NO_BUFFERS))
                else:
                    blobs.append(self._encode_value(v, what))
        try:  # Ctrl-C in here closes the session (see _send_quick)
            self._lock_send(deadline)
            try:
                self._unsent = ref_id = next(self._ids)  # under the send lock, as a call's
                if len(blobs) == 1:
                    self._send(put_msg, (ref_id, blobs[0][0]), ranks, blobs[0][1], deadline)
                else:
                    for rank, (blob, bufs) in zip(ranks, blobs):
                        self._send(put_msg, (ref_id, blob), (rank,), bufs, deadline)
            except BaseException:  # a deadline, or a later rank's value refused (another
                # session's array, a full arena): the workers that got theirs drop it again
                self._frees.append(ref_id)
                raise
            finally:
                self._unsent = 0
                self._send_lock.release()
            return Ref(self, ref_id, ranks)
        except BaseException as exc:
            self._close_if_signalled(exc)
            raise

    def _run(
        self, ranks: tuple[int, ...], fn: Callable[..., Any], args: tuple[Any, ...],
        kwargs: dict[str, Any], deadline: float | None,
    ) -> list[Any]:
        """call and gather in one message each way: the workers reply with the result and
        keep nothing, so no Ref is made or freed. Sent by ``deadline`` too (None: by the
        session's send timeout, if any). ``_results``, its quick path inlined: a frame less
        on gather_small's round (0.2-0.3 µs at N=2, ``python benchmarks/result_shapes.py``)."""
        req = Request(next(self._ids), len(ranks))  # its ref id: when sent
        try:  # Ctrl-C between the send and the wait, too, closes the session (_send_quick)
            self._send_quick(ranks, fn, args, kwargs, req, deadline)
            router = self._router
            if deadline is None:
                values = router.quick(req, ranks)
                if values is not None:
                    return values
            router.wait(req, deadline, "running a call")
        except BaseException as exc:
            if raised_by_a_signal(exc):
                self.interrupted(exc)
            elif isinstance(exc, TimeoutError) and exc.args and isinstance(exc.args[0], str):
                # name the function (here: no cost unless it times out)
                exc.args = (f"run({_fn_name(fn)}): {exc.args[0]}", *exc.args[1:])
            raise
        return self._values(req, ranks)

    def _results(self, req: Request, ranks: tuple[int, ...], deadline: float | None,
                 during: str) -> list[Any]:
        """Wait for ``req`` (a GET or a run); each rank's value, or WorkerError. Without a
        deadline, the router's quick path first (Router.quick: every reply read and decoded
        in one step, where the channel can and each is a plain value)."""
        if deadline is None:
            values = self._router.quick(req, ranks)
            if values is not None:
                return values
        self._router.wait(req, deadline, during)
        return self._values(req, ranks)

    def _values(self, req: Request, ranks: tuple[int, ...]) -> list[Any]:
        """A completed GET's or run's values in rank order, or the WorkerError (or
        CancelledError) their errors make."""
        values = self._router.values(req, ranks)
        return self._decoded_values(req, ranks) if values is None else values

    def _decoded_values(self, req: Request, ranks: tuple[int, ...]) -> list[Any]:
        """``_values`` where a reply is not a plain OK value: each one decoded and judged."""
        decoded = self._decode(req, ranks, True)
        values = []
        for status, payload in decoded:
            if status != OK:
                break
            values.append(payload)
        else:
            return values
        self._errors.forget(req.ref_id, ranks)
        raise _worker_error({rank: payload for rank, (status, payload) in zip(ranks, decoded)
                             if status != OK})

    def _fetch(self, ref: Ref, ranks: tuple[int, ...], deadline: float | None) -> list[Any]:
        self._check_fetch(ref)
        try:  # Ctrl-C between the send and the wait, too, closes the session (_send_quick)
            req = self._request(get_msg, ref._id, ranks, deadline)
            return self._results(req, ranks, deadline, "fetching a value")
        except BaseException as exc:
            self._close_if_signalled(exc)
            raise

    def _check_fetch(self, ref: Ref) -> None:
        self.check_open()
        if ref._session is not self:
            raise ValueError(f"{ref!r} belongs to another session")
        if ref._freed:
            raise ValueError(f"{ref!r} was freed; its value is gone")

    # -- asyncio (aio.py) ------------------------------------------------------------------------

    async def _fetch_async(self, ref: Ref, ranks: tuple[int, ...],
                           timeout: float | None) -> list[Any]:
        self._check_fetch(ref)
        req = Request(next(self._ids), len(ranks), ref._id)
        fut = self._waits.prepare(req)
        try:
            self._request(get_msg, ref._id, ranks, _deadline(timeout), req)
        except BaseException:
            self._waits.cancel(req)
            raise
        return await self._results_async(req, fut, ranks, timeout, "fetching a value")

    async def _results_async(self, req: Request, fut: Any, ranks: tuple[int, ...],
                             timeout: float | None, during: str) -> list[Any]:
        """``_results`` for asyncio: the quick path first where the loop is idle
        (Waits.quick), else the wait through the loop."""
        values = self._waits.quick(req, ranks)
        if values is not None:
            return values
        await self._waits.wait(req, fut, timeout, during)
        return self._values(req, ranks)

    async def _sync_async(self, ranks: tuple[int, ...], timeout: float | None) -> None:
        """As _sync: where the channel shows progress without a message (done positions,
        reports) and nothing is in flight to ``ranks``, a look first; SYNC only where it
        does not say all ran with no error held (an await of SYNC cost 2.1x a blocking sync:
        ``python benchmarks/async_bench.py``)."""
        chan = self._chan
        deadline = _deadline(timeout)  # a bad timeout is refused, as sync's, whatever the look
        floor = next(self._ids)  # the calls this sync covers: those sent before it
        below = self._sent_below(floor)
        if not ((chan.tracks_progress or chan.settles) and self._router.idle(ranks)
                and not self._closed and self._waits.settled(ranks, timeout)):
            req = _sync_request(floor, ranks)
            fut = self._waits.prepare(req)
            try:
                self._request(sync_msg, 0, ranks, deadline, req)
            except BaseException:
                self._waits.cancel(req)
                raise
            await self._waits.wait(req, fut, timeout, "syncing")
            self._router.keep_answers(req)  # (where the reader has not yet)
        self._raise_held(ranks, below)

    # -- the timeline (unison.trace) ------------------------------------------------------------

    @contextlib.contextmanager
    def trace(self, path: str | os.PathLike[str] | None = None) -> Iterator[Trace]:
        """Record every message, call, collective and reply of the block, on every worker;
        at its end write them to ``path`` (Chrome/Perfetto trace JSON: ui.perfetto.dev or
        chrome://tracing open it), and keep them for ``stats()``."""
        tracer = self._start_trace(path)
        try:
            yield tracer
        except BaseException as exc:
            # left on an error: it goes on at once where a worker is still in a call (one
            # that timed out, say), as the workers' events would come after that call
            try:
                self._stop_trace(_BUSY_COLLECT_S, _FAILED_COLLECT_S, tracer)
            except Warning as warning:  # -W error: the block's error goes on, not this
                note_warning(exc, warning)
            raise
        self._stop_trace(_COLLECT_S, _BUSY_COLLECT_S, tracer)

    def stats(self) -> Stats:
        """Per-call and per-rank times of the last trace, and the rank that entered most
        collectives last (the straggler), if one did."""
        if self._last_trace is None:
            raise RuntimeError("no trace yet: record one with `with sess.trace():` or "
                               "Session(trace='run.json'), then ask for stats()")
        return self._last_trace.stats()

    def _start_trace(self, path: str | os.PathLike[str] | None) -> Trace:
        """Claim the one trace slot (under the state lock: two threads' ``trace()`` blocks
        started at once lost one trace in silence), check that ``path`` can be written
        (before the work it would record, not at the end), then start the workers'."""
        with self._state_lock:
            if self._tracing:
                raise RuntimeError("a trace is running already: one at a time")
            self._tracing = True
        try:
            if path is not None:
                _trace.check_writable(path)
            tracer = Trace(self.num_workers, path)
            sent = time.perf_counter_ns()
            clocks = self.run(_trace.begin)
            tracer.set_offsets(sent, clocks, self.workers, time.perf_counter_ns(), self._ping)
        except BaseException:
            self._tracing = False
            raise
        self._tracer = self._router.tracer = tracer
        return tracer

    def _ping(self, rank: int) -> tuple[int, int, int]:
        """(sent, worker rank's clock, back): one round trip to it alone, for a clock
        offset (Trace.set_offsets)."""
        sent = time.perf_counter_ns()
        (clock,) = self[rank : rank + 1].run(time.perf_counter_ns)
        return sent, clock, time.perf_counter_ns()

    def _stop_trace(self, idle_limit: float, busy_limit: float,
                    tracer: Trace | None = None) -> None:
        """End the trace (``tracer``, where a ``trace()`` block ends its own: never another
        thread's): the workers' events, then the file. Their events are waited for
        ``idle_limit`` seconds, or ``busy_limit`` where a call to a worker is in flight
        (they come after it)."""
        if tracer is None:
            tracer = self._tracer
        if tracer is None or tracer is not self._tracer:
            return  # ended by a close already (_drop_trace): it wrote or keeps it
        self._tracer = self._router.tracer = None
        self._tracing = False
        tracer.end_ns = time.perf_counter_ns()
        busy = self._in_call()
        limit = busy_limit if busy else idle_limit
        missing = ""
        try:
            for rank, evs in zip(self.workers, self.run(_trace.collect, timeout=limit)):
                tracer.add_worker(rank, evs)
        except TimeoutError as exc:  # the collect stays queued: it stops their recording
            why = f", worker(s) {busy} still in a call" if busy else ""
            missing = (f"the workers' trace events are missing: they did not come within "
                       f"{limit:g} s of the trace's end{why} ({exc})")
        except Exception as exc:  # a dead session: the controller's half is still worth it
            missing = f"the workers' trace events are lost ({exc})"
        self._last_trace = tracer
        if tracer.path is not None:
            tracer.write(tracer.path)
        if missing:  # last: under -W error it raises, and the trace is written already
            warnings.warn(f"{missing}; the trace holds the controller's only", RuntimeWarning,
                          stacklevel=3)

    def _drop_trace(self) -> Trace | None:
        """A close with the trace still running (a death, Ctrl-C, a close that could not
        wait for the workers): it ends here, and the controller's half is written all the
        same once the workers are stopped (``_write_dropped``), as the trace of a job that
        broke is the one worth having. The trace to write, if it has a file."""
        tracer, self._tracer = getattr(self, "_tracer", None), None
        self._tracing = False
        if tracer is None:
            return None
        self._router.tracer = None
        tracer.end_ns = time.perf_counter_ns()
        self._last_trace = tracer
        return tracer if tracer.path is not None else None

    def _write_dropped(self, tracer: Trace) -> str:
        """Write a trace the close ended (``_drop_trace``); the warning to issue, which says
        that the workers' events are missing."""
        assert tracer.path is not None
        why = f" ({self._dead})" if self._dead is not None else ""
        try:
            tracer.write(tracer.path)
        except OSError as exc:
            return f"the trace could not be written to {tracer.path}: {exc}"
        return (f"the session closed before the workers' trace events were collected{why}: "
                f"{tracer.path} holds the controller's only")

    def _in_call(self) -> list[int]:
        """The workers that may still be in a call: a request to them awaits its reply, or
        the channel (where it tells) shows they have not run all they were sent."""
        chan, router = self._chan, self._router
        mark = chan.mark() if chan.tracks_progress else None
        busy = []
        for r in self.workers:
            if not router.idle((r,)) or (
                    not chan.wait_done((r,), mark, 0.0) if mark is not None
                    else chan.settles and not chan.settled((r,), 0.0)):
                busy.append(r)
        return busy

    def watch_fds(self) -> list[int]:
        """The fds whose readability means a worker ended (for an event loop to watch):
        the launcher's, and the channel's own (a mixed session's local workers)."""
        return [*self._res.launcher.watch_fds(), *self._chan.death_fds()]

    def _sync(self, ranks: tuple[int, ...], timeout: float | None) -> None:
        """Where the channel tracks progress (and no request is in flight to these ranks,
        whose late errors a SYNC's replies would bring in), wait on the workers' done
        positions and ask for errors only if one holds some; where it ``settles`` (their
        reports come in the reply streams), wait for those up to a slice and ask if they do
        not say all is done; else send SYNC."""
        chan, router = self._chan, self._router
        deadline = None if timeout is None else _deadline(timeout)
        floor = next(self._ids)  # the calls this sync covers: those sent before it
        below = self._sent_below(floor)
        try:  # Ctrl-C in here closes the session, as in a wait (see _send_quick)
            if chan.tracks_progress and router.idle(ranks):
                # the usual case, done within one slice and no error: one call (see _send_quick)
                ask = not (deadline is None and not self._closed
                           and chan.settled(ranks, router.slice))
                if ask:  # the long way
                    if self._pump is not None:  # (worker 0 inline is never done while
                        # this thread is inside its call)
                        self._res.launcher.check_free()  # type: ignore[attr-defined]
                    self._wait_done(ranks, deadline)
                    ask = chan.unreported(ranks)
            elif chan.settles and router.idle(ranks):  # reports in the reply streams: look
                left = router.slice  # for a slice at most: SYNC's wait watches for hangs
                if deadline is not None:
                    left = min(left, deadline - time.monotonic())
                # (one look at least: timeout=0 with all done and no error held returns)
                ask = self._closed or not chan.settled(ranks, max(left, 0.0))
            else:
                ask = True
            if ask:
                req = self._request(sync_msg, 0, ranks, deadline, _sync_request(floor, ranks))
                self._router.wait(req, deadline, "syncing")
                self._router.keep_answers(req)  # (where the reader has not yet)
        except BaseException as exc:
            self._close_if_signalled(exc)
            raise
        self._raise_held(ranks, below)

    def _sent_below(self, floor: int) -> int:
        """The first id a sync taking ``floor`` does not cover: ``floor``, or lower where a
        call that took its id before it is still on its way out (pickling its function,
        waiting for ring room): that call's error is its own thread's sync's to raise."""
        unsent = self._unsent
        return unsent if unsent and unsent < floor else floor

    def _raise_held(self, ranks: tuple[int, ...], floor: int) -> None:
        """sync's end: WorkerError for the earliest errors held of ``ranks`` among the calls
        sent before the sync began (their ids below ``floor``), if any."""
        errors = self._errors.pop_earliest(ranks, floor)
        if errors is not None:
            raise _worker_error(errors)

    def _wait_done(self, ranks: tuple[int, ...], deadline: float | None) -> None:
        """Until every worker in ``ranks`` has run everything sent so far; in slices, so
        that a death, close() and the deadline are noticed."""
        if self._closed:
            self.check_open()
        chan, router = self._chan, self._router
        mark = chan.mark()
        try:
            while True:
                left = router.slice if deadline is None else deadline - time.monotonic()
                if left <= 0:  # one look first: timeout=0 with all done returns
                    busy = [r for r in ranks if not chan.wait_done((r,), mark, 0.0)]
                    if not busy:
                        return
                    raise TimeoutError(
                        f"syncing timed out: worker(s) {busy} had not finished what was sent "
                        "to them by the deadline. The work goes on: sync again, or close the "
                        "session." + self._where_they_are(busy)
                    )
                if chan.wait_done(ranks, mark, min(left, router.slice)):
                    return
                if self._closed:
                    self.check_open()
                self.check_alive("syncing")
                if router.hang is not None:
                    router.hang.poll(("sync", mark), lambda: [
                        r for r in ranks if not chan.wait_done((r,), mark, 0.0)], "syncing")
        except BaseException as exc:
            self._close_if_signalled(exc)
            raise

    def _cancel(self, ref: Ref, timeout: float | None) -> None:
        board = self._res.board
        if board is None:
            why = ("its platform has no memfd, or its workers join over TCP"
                   if _native.ordered_memory() else _native.unordered_why("the board"))
            raise RuntimeError(
                "cancelling needs a board in shared memory that every worker maps, which this "
                f"session lacks ({why}): stop the call from inside (have it return early), "
                "or close the session"
            )
        if ref._session is not self:
            raise ValueError(f"{ref!r} belongs to another session")
        # checked before the board: a refused cancel posts nothing (None: while they live)
        timeout = math.inf if timeout is None else _seconds(timeout, "timeout")
        self.check_open()
        stuck, gone = board.stop(ref._id, ref.workers, self._pids, self._starts, timeout)
        if stuck:
            self.check_alive("cancelling")  # a worker that died inside it: WorkerDied
            if gone:  # (before its launcher told: a zygote's child is reaped by the zygote)
                raise self.died("cancelling", min(gone))
            if timeout < _RESIGNAL:  # too short a wait for the signal to land: it says
                # nothing of where they are (a call in Python code ends within milliseconds)
                raise TimeoutError(
                    f"worker(s) {stuck} had not yet left the call of {ref!r} within {timeout:g} "
                    "s of its cancel: the cancellation is posted and goes on, and lands at the "
                    "call's next Python bytecode. Fetch the Ref to wait for it (CancelledError), "
                    f"or cancel with a timeout of at least {_RESIGNAL:g} s to learn whether C "
                    "code that does not return to Python holds them."
                )
            refused = {r: how for r in stuck if (how := refusal(self._pids[r]))}
            if not refused:
                raise TimeoutError(
                    f"worker(s) {stuck} are still inside the call of {ref!r} {timeout} s after "
                    "it was cancelled: they are stuck in C code that does not return to Python "
                    "(the cancellation takes effect at the next Python bytecode), or the call "
                    "caught unison.Cancelled and goes on. It ends cancelled if it returns "
                    "without having caught it; close the session to stop it now."
                )
            why = "; ".join(
                f"worker {r}'s process is stopped (SIGSTOP, Ctrl-Z or a debugger): the "
                "cancellation lands once it continues" if how == "stopped" else
                f"worker {r} {how} the cancellation signal ({SIGNAL_NAME})"
                for r, how in refused.items())
            in_c = [r for r in stuck if r not in refused]
            if in_c:
                why += f"; worker(s) {in_c} are stuck in C code that does not return to Python"
            advice = "" if set(refused.values()) == {"stopped"} else (
                f" Leave {SIGNAL_NAME} unblocked and its handler in place in the call and the "
                "libraries it uses (signal.pthread_sigmask, signal.signal).")
            raise TimeoutError(
                f"worker(s) {stuck} are still inside the call of {ref!r} {timeout} s after it "
                f"was cancelled: {why}. It ends cancelled when it returns; close the session to "
                f"stop it now.{advice}"
            )

    def _request(
        self, build: Callable[..., bytes], ref_id: int, ranks: tuple[int, ...],
        deadline: float | None, req: Request | None = None,
    ) -> Request:
        """Send a request (GET of ``ref_id``, or SYNC) to ``ranks``; the router expects its
        replies. The deadline bounds taking the send lock and the send."""
        if self._closed:
            self.check_open()
        if req is None:
            req = Request(next(self._ids), len(ranks), ref_id)
        fields = (req.req_id, ref_id) if ref_id else (req.req_id,)
        try:  # Ctrl-C in here closes the session (see _send_quick)
            router = self._router
            self._lock_send(deadline)
            try:
                if self._closed:
                    self.check_open()
                try:
                    router.expect(req, ranks)
                    self._send(build, fields, ranks, _NO_BUFFERS, deadline)
                except BaseException:
                    router.forget(req, ranks)
                    raise
            finally:
                self._send_lock.release()
            return req
        except BaseException as exc:
            self._close_if_signalled(exc)
            raise

    def _decode(self, req: Request, ranks: tuple[int, ...], values: bool = False
                ) -> list[tuple[int, Any]]:
        try:
            return self._router.decode(req, ranks, values=values)
        except OutOfStep as exc:
            err = SessionClosed(str(exc))
            self._shutdown_beside(err)
            raise err from None

    # -- sending -------------------------------------------------------------------------------

    def _send_deadline(self) -> float | None:
        t = self._send_timeout
        return None if t is None else time.monotonic() + t

    def _lock_send(self, deadline: float | None) -> None:
        """Take the send lock, or raise TimeoutError at ``deadline`` (another thread holds
        it while it waits for room to send), or SessionClosed once the session is closed:
        a Ctrl-C that lands just after a thread's acquire closes the session with the lock
        still held, so a waiter looks for the close every ``_CLOSED_LOOK_S``."""
        lock = self._send_lock
        if _owned(lock):
            raise self._reentered()
        if lock.acquire(False):
            return
        while True:
            left = _CLOSED_LOOK_S if deadline is None else deadline - time.monotonic()
            if lock.acquire(timeout=max(0.0, min(left, _CLOSED_LOOK_S))):
                return
            if self._closed:
                self.check_open()
            if deadline is not None and left <= _CLOSED_LOOK_S:
                raise TimeoutError(
                    "another thread was still sending to the workers at the deadline (their "
                    "command queue is full: a worker is busy or stuck). Nothing was sent: "
                    "wait for the workers (sync) or close the session."
                )

    def _reentered(self) -> RuntimeError:
        """This thread is inside the session's own send (code run there used the session:
        a ``__del__`` that the garbage collector ran, a weakref callback, a signal
        handler). Its call would cut into the one in progress: the re-entrant lock let it
        in, and it sent its own function's id with the outer call's arguments."""
        if self._pump is not None:  # inside worker 0's inline call: its own message
            self._res.launcher.check_free()  # type: ignore[attr-defined]
        return reentered()

    def _send(
        self, build: Callable[..., bytes], fields: tuple[Any, ...], ranks: tuple[int, ...],
        buffers: list[pickle.PickleBuffer] = [],  # noqa: B006 (never mutated)
        deadline: float | None = None,
    ) -> None:
        """Build one message (``build(frees, *fields)``, a protocol builder) and write it to
        ``ranks``; caller holds the send lock. At ``deadline`` it raises TimeoutError, with
        nothing of the message sent."""
        if self._closed:
            self.check_open()
        pump = self._pump
        if pump is not None:
            self._res.launcher.check_free()  # type: ignore[attr-defined]
        frees = self._take_frees() if self._frees else None
        try:
            if frees and len(ranks) != self.num_workers:  # frees must reach every worker
                self._chan.send(nop_msg(frees), self.workers, deadline=deadline)
                frees = None
            msg = build(frees, *fields)
            tracer = self._tracer
            sent = time.perf_counter_ns() if tracer is not None else 0  # before: a worker's
            # call must not start before the message that asked for it
            self._chan.send(msg, ranks, buffers, deadline=deadline)
            if tracer is not None:
                tracer.on_message(sent, build, fields, ranks, len(msg) + sum(
                    memoryview(b).nbytes for b in buffers) if buffers else len(msg))
            if pump is not None:
                self._run_inline(deadline)
        except BaseException as exc:
            self._closed_under(exc)
            raise self._send_failed(exc, frees, ranks)  # noqa: B904 (its cause is set there)

    def _closed_under(self, exc: BaseException) -> None:
        """A send's error once the session is closed: a close in a signal handler (in this
        thread, whose locks let it through) let go of the channel under it (shm's released
        ring: ValueError; pipe's emptied fd list: IndexError). SessionClosed says so."""
        if self._closed and isinstance(exc, Exception) and not raised_by_a_signal(exc):
            self.check_open()

    def _run_inline(self, deadline: float | None = None) -> None:
        """Worker 0 inline: it runs its share of what was just sent, now, here (the caller
        holds the send lock); its collectives give up at ``deadline``."""
        assert self._pump is not None
        try:
            self._pump(deadline)
        except BaseException as exc:
            self._close_if_signalled(exc)  # Ctrl-C in worker 0's call: as during a wait
            raise
        if self._closed:  # closed inside worker 0's call (a signal handler's close)
            self.check_open()

    def _send_failed(self, exc: BaseException, frees: tuple[int, ...] | None,
                     ranks: tuple[int, ...]) -> BaseException:
        """What a failed send of a message carrying ``frees`` to ``ranks`` raises (the
        channel's own error as its cause only where it says more than ours). Only the
        channel's deadline (SendTimeout) says that nothing was sent: any other exception,
        a TimeoutError of a signal handler's too, goes on as it is where the channel let it
        through (nothing of the message went), and closes the session where the message was
        half sent (PartialSendError)."""
        err: BaseException
        if frees and isinstance(exc, (channels.SendTimeout, ValueError, MemoryError,
                                      Reentered)):
            self._frees.extend(frees)  # nothing of it was sent (a deadline, a buffer the
            # arena refused, a full arena, a use from inside a read): the frees ride on the
            # next message instead
        if isinstance(exc, channels.SendTimeout):
            err = TimeoutError(
                "the workers did not take the message by the deadline (their command queue is "
                "full: a worker is busy or stuck). Nothing of it was sent: wait for the workers "
                "(sync), or close the session." + self._where_they_are(ranks)
            )
        elif isinstance(exc, channels.PartialSendError):  # some workers got it, some not:
            cause = exc.__cause__  # no lockstep: the session closes
            if cause is not None and (not isinstance(cause, Exception)
                                      or raised_by_a_signal(cause)):
                self._shutdown_beside(cause)
                return cause  # Ctrl-C, SystemExit, a signal handler's: goes on, the session
                # closed (its context says why)
            err = SessionClosed(f"the session is closed because {exc}")
            err.__cause__ = exc
            self._shutdown_beside(err)
            return err
        elif (isinstance(exc, OSError) and not isinstance(exc, TimeoutError)
              and not raised_by_a_signal(exc)):  # (a handler's OSError is no death)
            err = self.died("sending a message", None)
        else:
            return exc
        err.__suppress_context__ = True
        return err

    def _take_frees(self) -> tuple[int, ...]:
        out = []
        pop = self._frees.popleft
        while self._frees:
            out.append(pop())
        return tuple(out)

    def _define(
        self, fn: Callable[..., Any], blob: bytes | None, deadline: float | None
    ) -> tuple[int, bool]:
        """Send ``fn`` (its pickle ``blob``, made here if None) to every worker; return its id
        and whether it stays defined there (see fncache.py for when a copy stays current)."""
        blob, proof = self._fns.pickle(fn, blob)  # the proof before the pickle: see there
        fn_id = next(self._ids)
        self._send(define_msg, (fn_id, blob), self.workers, _NO_BUFFERS, deadline)
        drop, resent = self._fns.store(fn, fn_id, blob, proof)
        self._frees.extend(drop)
        if resent:  # last: under -W error it raises, and the ids are queued to free already
            self._fns.warn_big(fn, len(blob))
        return fn_id, proof is not None

    def _encode_args(
        self, ranks: tuple[int, ...], fn: Callable[..., Any], args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[bytes, list[pickle.PickleBuffer]]:
        try:
            blob, bufs, refs = protocol.dumps_with_refs((protocol.bytes_apart(args), kwargs))
        except protocol.SharedCopyError as exc:
            raise ValueError(str(exc)) from None
        except Exception as exc:
            if raised_by_a_signal(exc):  # a signal handler's, not the arguments' fault
                raise
            for what, value in [*((f"argument {i}", a) for i, a in enumerate(args)),
                                *((f"keyword argument {k!r}", v) for k, v in kwargs.items())]:
                try:
                    protocol.dumps_with_refs(value)
                except Exception as bad:
                    if raised_by_a_signal(bad):
                        raise
                    raise _unpicklable(f"{what} of {_fn_name(fn)}", value, bad) from bad
            raise _unpicklable(f"the arguments of {_fn_name(fn)}", args, exc) from exc
        for ref in refs:
            self._check_ref_arg(ref, ranks)
        return blob, bufs

    def _ref_args(self, ranks: tuple[int, ...], args: tuple[Any, ...],
                  kwargs: dict[str, Any] | None = None) -> Any:
        """Arguments as a CALL carries them without a pickle (see protocol.call_msg): plain
        values, each Ref's id where it sits (the worker puts its object there), small numpy
        values as their array payloads; None where one must be pickled. Each Ref is checked
        as a pickled one is. Pickled, a round of ``call(f, ref)`` and sync took 2.26x one
        without arguments at N=2, by id 1.24x; ``call(f, x=1)`` 1.55x; ``call(f,
        np.float32(1))`` 2.9x (``python benchmarks/ref_args.py``)."""
        where = checks.ref_positions(args, Ref) if args else ()
        names = checks.ref_names(kwargs, Ref) if kwargs else ()
        arrays: tuple[int | str, ...] = ()
        if where is None or names is None:  # containers, numpy values: one look at them all
            parts = checks.call_parts(args, kwargs or {}, Ref)
            if parts is None:
                return None
            args, kwargs, where, names, arrays = parts
        if kwargs and not args and not names and not arrays:
            return kwargs  # plain keyword values alone: the dict (this call's own)
        if where:
            held = list(args)
            for i in where:
                self._check_ref_arg(args[i], ranks)
                held[i] = args[i]._id
            args = tuple(held)
        if not kwargs and not arrays:
            return [where, args]
        if names:
            kwargs = dict(kwargs or {})  # (a copy: call_parts may have made none)
            for k in names:
                self._check_ref_arg(kwargs[k], ranks)
                kwargs[k] = kwargs[k]._id
        blob = [where, args, kwargs or {}, names]
        if arrays:
            blob.append(arrays)
        return blob

    def _encode_value(self, value: Any, what: str) -> tuple[bytes, list[pickle.PickleBuffer]]:
        try:
            bufs: list[pickle.PickleBuffer] = []
            return protocol.dumps(protocol.bytes_apart(value), bufs, shared=True), bufs
        except protocol.SharedCopyError as exc:
            raise ValueError(str(exc)) from None
        except Exception as exc:
            if raised_by_a_signal(exc):  # a signal handler's, not the value's fault
                raise
            raise _unpicklable(what, value, exc) from exc

    def _check_ref_arg(self, ref: Ref, ranks: tuple[int, ...]) -> None:
        if ref._session is not self:
            state = " (a closed one)" if ref._session._closed else ""
            raise ValueError(f"{ref!r} belongs to another session{state}: pass it only to its own")
        if ref._freed:
            raise ValueError(f"{ref!r} was freed and cannot be passed to a call")
        missing = () if ref.workers == ranks else sorted(set(ranks) - set(ref.workers))
        if missing:
            raise ValueError(
                f"{ref!r} is not held by workers {missing} that this call runs on: call on a "
                f"view of its workers, or put the value there first"
            )

    # -- liveness (also the router's owner interface) -----------------------------------------

    def check_open(self) -> None:
        """Raise SessionClosed if the session is closed, saying why."""
        if self._closed:
            if os.getpid() != self._owner:
                raise SessionClosed(
                    f"{self.name} belongs to process {self._owner}; this process "
                    f"({os.getpid()}) is a fork of it and must not use it. Open a new Session "
                    "here instead."
                )
            if self._dead is not None:
                raise SessionClosed(f"the session is closed because {self._dead}") from self._dead
            raise SessionClosed("the session is closed: open a new Session to go on")

    def check_alive(self, during: str) -> None:
        """Raise WorkerDied if a worker has ended (a wait found nothing to read)."""
        rank = self._res.ended()
        if rank is not None:
            raise self.died(during, rank)

    def died(self, during: str, rank: int | None) -> BaseException:
        """A worker is gone (or its stream broke): close the session and describe the death."""
        if self._closed:
            if self._dead is not None:
                return SessionClosed(f"the session is closed because {self._dead}")
            return SessionClosed("the session is closed: open a new Session to go on")
        if rank is None:  # a broken write: find who, for a moment
            end = time.monotonic() + 1.0
            while rank is None and time.monotonic() < end:
                rank = self._res.ended()
                time.sleep(0.005)
        report = self._res.on_death(rank, 1.0)
        # (before the workers are up, none has taken anything: it died starting; a rank
        # nobody named is on_death's guess, whose state says nothing of the death)
        idle = (rank is not None and hasattr(self, "_pids")
                and self._chan.was_idle(report.rank))
        self._dead = WorkerDied(report.rank, report.exitcode, report.output, during,
                                report.reason, idle)
        self._shutdown_beside(self._dead)
        return self._dead

    def _close_if_signalled(self, exc: BaseException) -> None:
        """Close, where ``exc`` came from Ctrl-C or another signal handler in the middle of a
        send or a wait (session/signals.py): whether a message went, or a reply was read,
        is not known there. The exception goes on, raised by the caller."""
        if raised_by_a_signal(exc):
            self.interrupted(exc)

    def interrupted(self, exc: BaseException) -> None:
        """Ctrl-C (or another signal handler's exception, ``exc``: session/signals.py) during
        a send or a wait: stop the workers now, quietly."""
        self._shutdown_beside(exc)

    def out_of_step(self, rank: int) -> BaseException:
        """A reply that no request waits for (its worker's stream is out of step): taking
        it for another call would be a wrong result, so the session closes."""
        err = SessionClosed(
            f"worker {rank} sent a reply that no request was waiting for: the replies are "
            "out of step, so the session was closed. Open a new Session to go on; if worker code "
            "writes to unison's channel, stop it; otherwise please report this.")
        self._shutdown_beside(err)
        return err

    def _stacks(self, ranks: tuple[int, ...], timeout: float) -> _debug_stacks.Stacks:
        self.check_open()
        secs = _seconds(timeout, "timeout", none=False)
        return _debug_stacks.collect({r: self._pids[r] for r in ranks}, min(secs, 3600.0))

    def _where_they_are(self, ranks: Sequence[int]) -> str:
        """For a TimeoutError's message: where each of ``ranks`` is, one line each (their
        stacks, asked for with a ``_WHERE_S`` bound); "" before the workers are up. Never
        raises."""
        pids = getattr(self, "_pids", None)
        if not ranks or not pids or self._closed:
            return ""
        try:
            got = _debug_stacks.collect({r: pids[r] for r in ranks}, _WHERE_S)
            return "\nWhere they are:\n" + _debug_stacks.report(got, ranks)
        except Exception as exc:  # a report must never hide the timeout itself
            return f"\n(where they are could not be read: {exc})"

    def _check_rank(self, rank: object, ref: Ref | None = None) -> int:
        rank = checks.as_rank(rank, "a worker is named by an int rank")
        if not -self.num_workers <= rank < self.num_workers:
            raise ValueError(
                f"worker index {rank} is out of range for a session of {self.num_workers} workers"
            )
        rank %= self.num_workers  # -1: the last, as sess[-1]
        if ref is not None and rank not in ref.workers:
            raise ValueError(
                f"worker {rank} does not hold {ref!r}: pick one of {list(ref.workers)}"
            )
        return rank


# -- helpers ---------------------------------------------------------------------------------


class _Both:
    """Two locks taken together, in order, as one context; the first is let be while
    ``unless()`` says so (looked at every 10 ms while it is held elsewhere)."""

    def __init__(self, first: threading.RLock, second: threading.RLock,
                 unless: Callable[[], bool] | None = None) -> None:
        self._first, self._second, self._unless = first, second, unless
        self._took = False

    def __enter__(self) -> None:
        self._took = self._take_first()
        self._second.acquire()

    def _take_first(self) -> bool:
        unless = self._unless
        if unless is None:
            return self._first.acquire()
        while not self._first.acquire(timeout=0.01):
            if unless():
                return False
        return True

    def __exit__(self, *exc: object) -> None:
        self._second.release()
        if self._took:
            self._first.release()


def _sync_request(floor: int, ranks: tuple[int, ...]) -> Request:
    """A SYNC (its id: the floor's, one id a sync), whose answers the reader keeps once all
    are in (router.WHOLE)."""
    req = Request(floor, len(ranks))
    req.abandoned = WHOLE
    return req


def _too_many_files(exc: BaseException, num_workers: int) -> None:
    """A start that ran out of file descriptors (EMFILE) says how many it needs and what
    to do, where it said only "Too many open files" at some step of the start."""
    if not isinstance(exc, OSError) or exc.errno != errno.EMFILE:
        return
    need = 16 + 10 * num_workers  # the channel's, the workers' pipes and pidfds, a margin
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    raise OSError(errno.EMFILE, (
        f"Too many open files: a session of {num_workers} workers needs up to about {need} "
        f"file descriptors besides those this process holds, and its limit (RLIMIT_NOFILE) "
        f"is {soft}: raise it (ulimit -n, or resource.setrlimit), or close files"
    )) from exc


def _owned(lock: threading.RLock) -> bool:
    """Whether this thread holds ``lock`` (as threading.Condition asks an RLock)."""
    return bool(lock._is_owned())  # type: ignore[attr-defined]


def _labelled(values: list[Any]) -> Iterable[tuple[Any, str]]:
    if len(values) == 1:
        yield values[0], "the value to put"
    else:
        for i, v in enumerate(values):
            yield v, f"scatter value {i}"


def _unpicklable(what: str, value: object, exc: BaseException) -> TypeError:
    return TypeError(
        f"{what} ({type(value).__qualname__}) cannot be pickled: {exc}. Pass a picklable "
        "value, or build the object on the workers inside the function."
    )


def _fn_name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _worker_error(errors: dict[int, tuple[Any, ...]]) -> WorkerError | CancelledError:
    ranks = sorted(errors)
    first = ranks[0]
    excs = {r: protocol.unpack_error(errors[r], raised_by_a_signal) for r in ranks}
    if all(isinstance(e, Cancelled) and not protocol.was_unasked(errors[r])
           for r, e in excs.items()):
        return CancelledError(
            f"the call was cancelled (ref.cancel()) on workers {ranks}: {excs[first]}", ranks)
    unread = "'s reply could not be read:"
    text = f"worker {first}{_said(errors[first], ' raised', unread)}"
    if len(ranks) > 1:
        text += f"; workers {ranks[1:]} failed too (see .errors)"
    began = _began(excs)
    if began != first:
        text += f". It began on worker {began}, " \
                f"{_said(errors[began], 'which raised', 'whose reply could not be read:')}"
    text += _traceback(errors[first], f"worker {first}")
    if began != first:
        text += _traceback(errors[began], f"worker {began}, where it began")
    err = WorkerError(text, first, excs)
    err.__cause__ = excs[first]
    return err


def _traceback(error: tuple[Any, ...], whose: str) -> str:
    """A packed error's traceback, titled with where it ran: a worker, or the controller."""
    title = (f"Traceback on the controller ({whose}'s reply)"
             if error[4] == protocol.ON_CONTROLLER else f"Remote traceback ({whose})")
    return f"\n\n{title}:\n{shortened(error[3].rstrip())}"


def _said(error: tuple[Any, ...], raised: str, unread: str) -> str:
    """``raised``, then ``Type: message (in where)`` of a packed worker error; ``unread``
    first instead where the reply failed here, on the controller (protocol.ON_CONTROLLER)."""
    _, type_name, message, _, where = error[:5]
    said = f"{type_name}: {shortened(message)}"
    if where == protocol.ON_CONTROLLER:
        return f"{unread} {said}"
    return f"{raised} {said}" + (f" (in {where})" if where else "")


def _began(excs: dict[int, BaseException]) -> int:
    """The lowest rank whose error is its own: not a collective's report that another rank
    that failed in this call left it (that rank's error is where the failure began, as
    torchrun's "root cause"). The lowest rank where every error is such a report."""
    for r in sorted(excs):
        e = excs[r]
        if not (isinstance(e, CollectiveError) and e.peer in excs):
            return r
    return min(excs)


def _forked() -> None:
    """In a forked child, the parent's sessions are closed to it (the workers, rings and
    replies are the parent's): any use raises, naming the owner."""
    for sess in list(_live):
        sess._closed = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


@atexit.register
def _close_all() -> None:
    raised = None
    for sess in list(_live):
        try:
            sess.close(timeout=1.0)
        except Warning as exc:  # -W error: raised (atexit prints it) once every session is
            if raised is None:  # closed, not dropped
                raised = exc
        except Exception:
            pass
    if raised is not None:
        raise raised
