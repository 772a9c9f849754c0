"""Session: the controller's face. It turns calls into messages and replies into values.

    sess.call(fn, *args) ---> encode once ---> channel.send(msg, ranks) ---> workers
          returns Ref at once                   (frees of dropped Refs ride along)
    ref.gather() ----------> GET to each rank, then wait:
                              one thread at a time reads the channel and hands every reply
                              to the request waiting for it (replies of one worker come back
                              in the order its requests went out); each wait also watches the
                              workers' pidfds, so a death ends it at once as WorkerDied.

A timeout abandons only the wait: the request stays queued, and its reply is dropped when it
comes, except for any error it carries, which the next sync() reports. A death closes the
session, stops every worker and leaves the WorkerDied as the cause of every later
SessionClosed.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import math
import operator
import os
import pickle
import secrets
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from unison import channel as channels
from unison import collective, protocol
from unison.collective import shm as collective_shm
from unison.deadline import deadline as _deadline
from unison.deadline import seconds as _seconds
from unison.errors import SessionClosed, WorkerDied, WorkerError
from unison.fncache import FunctionCache, pickle_function
from unison.launch.local import LocalLauncher
from unison.protocol import CALL, DEFINE, GET, NOP, OK, PUT, SHUTDOWN, SYNC
from unison.refs import Ref

__all__ = ["Session", "View"]

_NO_BUFFERS: list[pickle.PickleBuffer] = []
_FN_CACHE = 512  # functions kept defined on the workers; older ones are freed
_SLICE = 0.5  # longest single sleep of a wait, so close() and deadlines are noticed
_names = itertools.count()
_live: weakref.WeakSet[Session] = weakref.WeakSet()


class _Pending:
    """One request awaiting a reply from each of its ranks."""

    __slots__ = ("abandoned", "ref_id", "remaining", "replies", "req_id", "salvaged")

    def __init__(self, req_id: int, count: int, ref_id: int = 0) -> None:
        self.req_id = req_id
        self.ref_id = ref_id  # for GET: whose value (or error) the replies carry
        self.remaining = count
        self.replies: dict[int, bytes | channels.Reply] = {}
        self.abandoned = False  # its wait timed out: errors in late replies must be kept
        self.salvaged: set[int] = set()


class View:
    """A set of workers of a session, addressed by global rank: ``sess[i]``, ``sess[a:b]``,
    ``sess.group(g)``, or the whole session. A view is not indexed again."""

    def __init__(self, session: Session, ranks: tuple[int, ...]) -> None:
        self._session = session
        self.workers = ranks
        """The global ranks in this view, ascending."""

    def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Ref:
        """Run ``fn(*args, **kwargs)`` on every worker of the view; return a Ref at once."""
        session = self._session
        return session._call(self.workers, fn, args, kwargs, session._send_deadline())

    def run(
        self, fn: Callable[..., Any], /, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """``call`` then ``gather``: every worker's result, in rank order."""
        session = self._session
        deadline = _deadline(timeout)  # a bad timeout is refused before anything is sent
        send_by = session._send_deadline() if deadline is None else deadline
        ref = session._call(self.workers, fn, args, kwargs, send_by)
        try:
            return session._fetch(ref, ref.workers, deadline)
        finally:
            ref.free()

    def put(self, value: Any) -> Ref:
        """The same value on every worker of the view."""
        return self._session._put(self.workers, [value])

    def scatter(self, values: Sequence[Any]) -> Ref:
        """One value per worker of the view, in rank order."""
        values = _values_per_worker(values, "scatter")
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
        launcher: str = "local",
        channel: str = "auto",
        env: Mapping[int, Mapping[str, str]] | None = None,
        cpu_affinity: bool | Mapping[int, Iterable[int]] | None = None,
        collectives: str = "shm",
        start_timeout: float = 60.0,
        send_timeout: float | None = None,
    ) -> None:
        """``send_timeout`` bounds how long ``call``, ``put`` and ``scatter`` may block when
        the workers fall behind and the command queue is full (TimeoutError; nothing of that
        message was sent). None waits as long as it takes."""
        _check_sizes(num_workers, num_groups)
        if launcher != "local":
            raise ValueError(f"unknown launcher {launcher!r}: use 'local'")
        if collectives not in ("shm", "torch"):
            raise ValueError(f"unknown collectives backend {collectives!r}: use 'shm' or 'torch'")
        start_deadline = _deadline(start_timeout, "start_timeout")
        _deadline(send_timeout, "send_timeout")
        cpus = _cpu_plan(num_workers, cpu_affinity)
        envs = _check_env(num_workers, env)
        self.num_workers = num_workers
        self.num_groups = num_groups
        self.name = f"unison-{os.getpid()}-{next(_names)}-{secrets.token_hex(3)}"
        self.workers = tuple(range(num_workers))
        self._closed = True  # until the workers are up
        self._owner = os.getpid()
        self._stopping = False
        self._dead: WorkerDied | None = None
        self._send_timeout = None if send_timeout == math.inf else send_timeout
        self._ids = itertools.count(1)
        self._frees: collections.deque[int] = collections.deque()
        self._fns = FunctionCache(_FN_CACHE)
        self._expect: list[collections.deque[_Pending]] = [
            collections.deque() for _ in range(num_workers)
        ]
        self._unreported: dict[int, dict[int, tuple[Any, ...]]] = {}
        self._send_lock = threading.RLock()
        self._recv_lock = threading.RLock()
        self._state_lock = threading.Lock()
        self._cv = threading.Condition(threading.Lock())
        self._followers = 0
        self._coll_fd = -1
        self._launcher = LocalLauncher()
        self._procs = self._launcher.workers
        self._pidfds: list[int] = []
        try:
            self._chan = channels.create(channel, num_workers, self.name)
            coll_spec = None
            if hasattr(os, "memfd_create"):  # else no collectives: they say so when called
                self._coll_fd, _ = collective_shm.create(self.name, num_workers, num_groups)
                coll_spec = {"fd": self._coll_fd, "backend": collectives,
                             "torch_address": _free_address() if collectives == "torch" else None}
            inits, fds = [], []
            for rank in range(num_workers):
                spec, rank_fds = self._chan.endpoint(rank)
                inits.append({
                    "rank": rank, "world_size": num_workers, "num_groups": num_groups,
                    "sys_path": list(sys_path()), "channel": spec, "cpus": cpus.get(rank),
                    "collective": coll_spec,
                })
                fds.append([*rank_fds, self._coll_fd] if self._coll_fd >= 0 else rank_fds)
            ready = _Pending(protocol.READY_REQ, num_workers)
            for q in self._expect:
                q.append(ready)
            self._closed = False
            self._launcher.start(inits, fds, envs)
            self._pidfds = [w.pidfd for w in self._procs if w.pidfd is not None]
            self._chan.started(self._pidfds)
            self._wait(ready, start_deadline, "starting")
        except BaseException:
            self._shutdown(0)
            raise
        _live.add(self)

    @property
    def _session(self) -> Session:  # type: ignore[override]
        """A session is the view of all its workers (a property: no reference cycle, so the
        session is closed as soon as the last reference to it goes)."""
        return self

    # -- views ---------------------------------------------------------------------------------

    def __getitem__(self, key: object) -> View:
        self._check_open()
        if isinstance(key, slice):
            ranks = tuple(range(self.num_workers)[key])
            if not ranks:
                raise ValueError(
                    f"sess[{key.start}:{key.stop}] selects no worker of {self.num_workers}"
                )
            return View(self, ranks)
        rank = _as_rank(key, "index a session with an int rank or a slice")
        if not -self.num_workers <= rank < self.num_workers:
            raise IndexError(
                f"worker index {rank} is out of range for a session of {self.num_workers} workers"
            )
        return View(self, (rank % self.num_workers,))

    def group(self, g: int) -> View:
        """The workers of group ``g``: ranks g*size .. (g+1)*size - 1."""
        self._check_open()
        g = _as_rank(g, "a group is named by an int")
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
        values = _values_per_worker(values, "scatter_from")
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

        self._check_open()
        dt = np.dtype(dtype)
        shape_t = _shape(shape)
        count = int(np.prod(shape_t, dtype=np.int64))
        arena = getattr(self._chan, "arena", None)
        if count * dt.itemsize == 0:
            return np.empty(shape_t, dt)
        if arena is None:
            raise RuntimeError(
                "sess.empty needs shared memory (memfd), which this platform lacks: "
                "send the array with put/scatter and fetch the workers' results instead"
            )
        with self._send_lock:
            self._check_open()
            mm = arena.shared_array(count * dt.itemsize)
        return np.frombuffer(mm, dt, count).reshape(shape_t)

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float = 3.0) -> None:
        """Let calls in flight finish for up to ``timeout`` seconds, then stop every worker.
        Errors of calls that nobody fetched are not lost: each becomes a RuntimeWarning.
        Idempotent."""
        grace = _seconds(timeout, "timeout")
        if grace == math.inf:
            raise ValueError("close(timeout=...) needs a finite number of seconds")
        self._shutdown(grace)

    def _shutdown(self, grace: float) -> None:
        with self._state_lock:
            self._closed = True
            if self._stopping:
                return
            self._stopping = True
        if os.getpid() != self._owner:
            return  # a forked child's copy: the workers belong to the parent, leave them be
        deadline = time.monotonic() + grace
        goodbye = None
        # a thread blocked sending (to busy workers) holds the send lock: don't wait past grace
        if grace > 0 and self._dead is None and self._send_lock.acquire(timeout=grace):
            try:
                # the workers answer SHUTDOWN with their unreported errors, read below
                goodbye = _Pending(next(self._ids), self.num_workers)
                goodbye.abandoned = True
                for q in self._expect:
                    q.append(goodbye)
                self._chan.send(pickle.dumps((SHUTDOWN, None, goodbye.req_id)), self.workers,
                                deadline=deadline)
            except OSError:  # TimeoutError too: the workers are stopped all the same
                goodbye = None
            finally:
                self._send_lock.release()
        self._launcher.stop(max(0.0, deadline - time.monotonic()))
        # the workers are gone, so a sender still inside the channel fails out of it at once
        with self._send_lock, self._recv_lock:
            if goodbye is not None:
                self._drain()
            if hasattr(self, "_chan"):  # else the channel's own creation failed
                self._chan.close()
        if self._coll_fd >= 0:
            os.close(self._coll_fd)
            self._coll_fd = -1
        _live.discard(self)
        self._warn_unreported()

    def _drain(self) -> None:
        """The workers are gone: read the replies they left, keeping the errors they carry."""
        try:
            while any(self._expect):
                batch = self._chan.recv(0.0, ())
                if not batch:
                    return
                for rank, data in batch:
                    if data is None or not self._expect[rank]:
                        continue
                    p = self._expect[rank].popleft()
                    p.replies[rank] = data
                    p.remaining -= 1
                    if p.abandoned:
                        self._salvage(p, rank)
        except (OSError, ValueError):
            pass

    def _warn_unreported(self) -> None:
        """Errors that nobody fetched are said out loud, as asyncio does for a task's."""
        with self._state_lock:
            lost, self._unreported = self._unreported, {}
        for ref_id in sorted(lost):
            errors = lost[ref_id]
            ranks = sorted(errors)
            err = errors[ranks[0]]
            where = f" of {err[4]}" if len(err) > 4 and err[4] else ""
            try:
                warnings.warn(
                    f"call #{ref_id}{where} raised {err[1]}: {err[2]} on worker(s) {ranks}, and "
                    f"nobody fetched that error before {self.name} closed: get/gather its Ref "
                    "or call sess.sync() to see errors as they happen",
                    RuntimeWarning, stacklevel=4,
                )
            except Exception:  # interpreter shutdown: nowhere left to say it
                return

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(timeout=3.0 if exc[0] is None else 0)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close(timeout=1.0)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<unison.Session {self.name} workers={self.num_workers} {state}>"

    # -- the calls behind Session, View and Ref ------------------------------------------------

    def _call(
        self, ranks: tuple[int, ...], fn: Callable[..., Any], args: tuple[Any, ...],
        kwargs: dict[str, Any], deadline: float | None = None,
    ) -> Ref:
        if self._closed:
            self._check_open()
        if not callable(fn):
            raise TypeError(f"call needs a callable first, got {type(fn).__name__}")
        blob: Any = None
        bufs = _NO_BUFFERS
        if kwargs or (args and not _plain(args)):
            blob, bufs = self._encode_args(ranks, fn, args, kwargs)
        elif args:
            blob = args  # plain values ride inside the message itself: no second pickle
        ref_id = next(self._ids)
        self._lock_send(deadline)
        try:
            fn_id, fresh = self._fns.lookup(fn)
            cached = True
            if not fn_id:
                fn_id, cached = self._define(fn, fresh, deadline)
            try:
                self._send(CALL, (ref_id, fn_id, blob, None if ranks == self.workers else ranks),
                           ranks, bufs, deadline)
            finally:
                if not cached:
                    self._frees.append(fn_id)  # dropped with the next message, after this call
        finally:
            self._send_lock.release()
        return Ref(self, ref_id, ranks)

    def _put(self, ranks: tuple[int, ...], values: list[Any]) -> Ref:
        if self._closed:
            self._check_open()
        deadline = self._send_deadline()
        ref_id = next(self._ids)
        blobs = [self._encode_value(v, what) for v, what in _labelled(values)]
        self._lock_send(deadline)
        try:
            if len(blobs) == 1:
                self._send(PUT, (ref_id, blobs[0][0]), ranks, blobs[0][1], deadline)
            else:
                for rank, (blob, bufs) in zip(ranks, blobs):
                    self._send(PUT, (ref_id, blob), (rank,), bufs, deadline)
        except TimeoutError:
            self._frees.append(ref_id)  # the workers that got their value drop it again
            raise
        finally:
            self._send_lock.release()
        return Ref(self, ref_id, ranks)

    def _fetch(self, ref: Ref, ranks: tuple[int, ...], deadline: float | None) -> list[Any]:
        self._check_open()
        if ref._session is not self:
            raise ValueError(f"{ref!r} belongs to another session")
        if ref._freed:
            raise ValueError(f"{ref!r} was freed; its value is gone")
        replies = self._request(GET, (ref._id,), ranks, deadline, "fetching a value")
        values, errors = [], {}
        for rank, (status, payload) in zip(ranks, replies):
            if status == OK:
                values.append(payload)
            else:
                errors[rank] = payload
        if errors:
            with self._state_lock:
                self._unreported.pop(ref._id, None)
            raise _worker_error(errors)
        return values

    def _sync(self, ranks: tuple[int, ...], timeout: float | None) -> None:
        replies = self._request(SYNC, (), ranks, _deadline(timeout), "syncing")
        with self._state_lock:
            for rank, (_, errs) in zip(ranks, replies):
                for ref_id, err in errs:
                    self._unreported.setdefault(ref_id, {})[rank] = err
            if not self._unreported:
                return
            errors = self._unreported.pop(min(self._unreported))
        raise _worker_error(errors)

    def _release(self, ref_id: int) -> None:
        """Called from Ref.__del__, in any thread: so no lock, just an atomic append."""
        self._frees.append(ref_id)

    # -- sending -------------------------------------------------------------------------------

    def _send_deadline(self) -> float | None:
        t = self._send_timeout
        return None if t is None else time.monotonic() + t

    def _lock_send(self, deadline: float | None) -> None:
        """Take the send lock, or raise TimeoutError at ``deadline`` (another thread holds
        it while it waits for room to send)."""
        if deadline is None:
            self._send_lock.acquire()
        elif not self._send_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(
                "another thread was still sending to the workers at the deadline (their command "
                "queue is full: a worker is busy or stuck). Nothing was sent: wait for the "
                "workers (sync) or close the session."
            )

    def _send(
        self, op: int, fields: tuple[Any, ...], ranks: tuple[int, ...],
        buffers: list[pickle.PickleBuffer] = [],  # noqa: B006 (never mutated)
        deadline: float | None = None,
    ) -> None:
        """Encode one message and write it to ``ranks``; caller holds the send lock. At
        ``deadline`` it raises TimeoutError, with nothing of the message sent."""
        if self._closed:
            self._check_open()
        frees = self._take_frees() if self._frees else None
        try:
            if frees and len(ranks) != self.num_workers:  # frees must reach every worker
                self._chan.send(pickle.dumps((NOP, frees)), self.workers, deadline=deadline)
                frees = None
            self._chan.send(pickle.dumps((op, frees, *fields)), ranks, buffers,
                            deadline=deadline)
        except TimeoutError:
            if frees:
                self._frees.extend(frees)  # they ride on the next message instead
            raise TimeoutError(
                "the workers did not take the message by the deadline (their command queue is "
                "full: a worker is busy or stuck). Nothing of it was sent: wait for the workers "
                "(sync), or close the session."
            ) from None
        except OSError:
            raise self._find_death("sending a message") from None
        except channels.PartialSendError as exc:  # some workers got it, some not: no lockstep
            self._shutdown(0)
            raise SessionClosed(f"the session is closed because {exc}") from exc

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
        if blob is None:
            blob = pickle_function(fn)
        fn_id = next(self._ids)
        self._send(DEFINE, (fn_id, blob), self.workers, _NO_BUFFERS, deadline)
        self._frees.extend(self._fns.store(fn, fn_id, blob))
        return fn_id, self._fns.cacheable(fn)

    def _encode_args(
        self, ranks: tuple[int, ...], fn: Callable[..., Any], args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[bytes, list[pickle.PickleBuffer]]:
        try:
            blob, bufs, refs = protocol.dumps_with_refs((args, kwargs))
        except Exception as exc:
            for what, value in [*((f"argument {i}", a) for i, a in enumerate(args)),
                                *((f"keyword argument {k!r}", v) for k, v in kwargs.items())]:
                try:
                    protocol.dumps_with_refs(value)
                except Exception as bad:
                    raise _unpicklable(f"{what} of {_fn_name(fn)}", value, bad) from bad
            raise _unpicklable(f"the arguments of {_fn_name(fn)}", args, exc) from exc
        for ref in refs:
            self._check_ref_arg(ref, ranks)
        return blob, bufs

    def _encode_value(self, value: Any, what: str) -> tuple[bytes, list[pickle.PickleBuffer]]:
        try:
            bufs: list[pickle.PickleBuffer] = []
            return protocol.dumps(value, bufs), bufs
        except Exception as exc:
            raise _unpicklable(what, value, exc) from exc

    def _check_ref_arg(self, ref: Ref, ranks: tuple[int, ...]) -> None:
        if ref._session is not self:
            state = " (a closed one)" if ref._session._closed else ""
            raise ValueError(f"{ref!r} belongs to another session{state}: pass it only to its own")
        if ref._freed:
            raise ValueError(f"{ref!r} was freed and cannot be passed to a call")
        missing = sorted(set(ranks) - set(ref.workers))
        if missing:
            raise ValueError(
                f"{ref!r} is not held by workers {missing} that this call runs on: call on a "
                f"view of its workers, or put the value there first"
            )

    # -- waiting for replies -------------------------------------------------------------------

    def _request(
        self, op: int, fields: tuple[Any, ...], ranks: tuple[int, ...], deadline: float | None,
        during: str,
    ) -> list[tuple[int, Any]]:
        """Send a request to ``ranks`` and return each one's decoded (status, payload). The
        deadline bounds it all: the send lock, the send, and the wait for replies."""
        if self._closed:
            self._check_open()
        req_id = next(self._ids)
        pending = _Pending(req_id, len(ranks), fields[0] if op == GET else 0)
        self._lock_send(deadline)
        try:
            if self._closed:
                self._check_open()
            for r in ranks:
                self._expect[r].append(pending)
            try:
                self._send(op, (req_id, *fields), ranks, _NO_BUFFERS, deadline)
            except BaseException:
                for r in ranks:
                    _discard(self._expect[r], pending)
                raise
        finally:
            self._send_lock.release()
        try:
            self._wait(pending, deadline, during)
        except TimeoutError:
            self._abandon(pending)
            raise
        out = []
        for r in ranks:
            raw = pending.replies[r]
            if not raw:  # an ack: done, nothing to report
                out.append((OK, ()))
                continue
            try:
                got_id, status, payload = protocol.loads(raw)
            except Exception as exc:
                raise TypeError(
                    f"the reply of worker {r} cannot be unpickled on the controller: {exc}. "
                    "Make its type importable here, or return plain data."
                ) from exc
            if got_id != req_id:  # never hand a reply to the wrong call, even under -O
                self._shutdown(0)
                raise SessionClosed(
                    f"worker {r} answered request {got_id} where {req_id} was expected: the "
                    "replies are out of step, so the session was closed. Please report this."
                )
            out.append((status, payload))
        return out

    def _wait(self, pending: _Pending, deadline: float | None, during: str) -> None:
        try:
            while pending.remaining:
                if self._recv_lock.acquire(blocking=False):
                    try:
                        self._pump(pending, deadline, during)
                    finally:
                        self._recv_lock.release()
                        if self._followers:
                            with self._cv:
                                self._cv.notify_all()
                else:
                    self._follow(pending, deadline)
        except KeyboardInterrupt:
            self._abort()
            raise

    def _pump(self, pending: _Pending, deadline: float | None, during: str) -> None:
        """Read replies for everyone until ``pending`` is complete; caller holds the recv lock."""
        chan, expect = self._chan, self._expect
        slice_ = _SLICE if self._pidfds else 0.05
        while pending.remaining:
            if self._closed:
                self._check_open()
            timeout = slice_ if deadline is None else min(slice_, deadline - time.monotonic())
            if timeout <= 0:
                raise _timeout_error(pending, deadline)
            batch = chan.recv(timeout, self._pidfds)
            if not batch:
                self._check_alive(during)
                continue
            for rank, data in batch:
                if data is None:
                    raise self._find_death(during, rank)
                p = expect[rank].popleft()
                p.replies[rank] = data
                p.remaining -= 1
                if p.abandoned:
                    self._salvage(p, rank)
            if self._followers:
                with self._cv:
                    self._cv.notify_all()

    def _abandon(self, pending: _Pending) -> None:
        """A wait timed out: keep the errors that its replies carry, now or when they come,
        for the next sync (the worker counts them as reported once it has replied)."""
        with self._state_lock:
            pending.abandoned = True
        for rank in list(pending.replies):
            self._salvage(pending, rank)

    def _salvage(self, pending: _Pending, rank: int) -> None:
        with self._state_lock:
            if rank in pending.salvaged:
                return
            pending.salvaged.add(rank)
        raw = pending.replies[rank]
        if not raw:
            return
        try:
            _, status, payload = protocol.loads(raw)
        except Exception:
            return  # a value that cannot be unpickled here carries no error
        with self._state_lock:
            if pending.ref_id and status != OK:
                self._unreported.setdefault(pending.ref_id, {})[rank] = payload
            elif not pending.ref_id:
                for ref_id, err in payload:
                    self._unreported.setdefault(ref_id, {})[rank] = err

    def _follow(self, pending: _Pending, deadline: float | None) -> None:
        """Another thread reads the channel: sleep until it hands over our replies."""
        with self._cv:
            self._followers += 1
            try:
                if pending.remaining:
                    left = _SLICE if deadline is None else deadline - time.monotonic()
                    self._cv.wait(max(0.0, min(_SLICE, left)))
            finally:
                self._followers -= 1
        self._check_open()
        if pending.remaining and deadline is not None and time.monotonic() >= deadline:
            raise _timeout_error(pending, deadline)

    # -- liveness ------------------------------------------------------------------------------

    def _check_open(self) -> None:
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

    def _check_alive(self, during: str) -> None:
        for w in self._procs:
            if w.exitcode() is not None:
                raise self._find_death(during, w.rank)

    def _find_death(self, during: str, rank: int | None = None) -> BaseException:
        """A worker is gone (or its stream broke): close the session and describe the death."""
        if self._closed and self._dead is not None:
            return SessionClosed(f"the session is closed because {self._dead}")
        if self._closed:
            return SessionClosed("the session is closed: open a new Session to go on")
        deadline = time.monotonic() + 1.0
        while rank is None and time.monotonic() < deadline:
            rank = next((w.rank for w in self._procs if w.exitcode() is not None), None)
            time.sleep(0.005)
        if rank is None:
            rank = 0
        if self._coll_fd >= 0:
            collective_shm.abort(self._coll_fd, rank)  # peers waiting in a collective give up
        worker = self._procs[rank]
        code = worker.wait_exit(1.0)
        reason = worker.death_reason()  # read before our own kill below
        if code is None:
            reason = "its channel broke while it still ran, so unison killed it"
        worker.kill()
        self._dead = WorkerDied(rank, code if code is not None else worker.exitcode(),
                                worker.output(), during, reason)
        self._shutdown(0)
        return self._dead

    def _abort(self) -> None:
        """Ctrl-C: stop the workers now, quietly."""
        self._shutdown(0)

    def _check_rank(self, rank: object, ref: Ref | None = None) -> int:
        rank = _as_rank(rank, "a worker is named by an int rank")
        if ref is not None:
            if rank not in ref.workers:
                raise ValueError(
                    f"worker {rank} does not hold {ref!r}: pick one of {list(ref.workers)}"
                )
            return rank
        if not -self.num_workers <= rank < self.num_workers:
            raise ValueError(
                f"worker index {rank} is out of range for a session of {self.num_workers} workers"
            )
        return rank % self.num_workers


# -- helpers ---------------------------------------------------------------------------------


def sys_path() -> list[str]:
    """The controller's import path, for the workers (so functions pickled by reference and
    the classes of arguments import there too)."""
    return [os.getcwd() if p == "" else p for p in sys.path]


def _free_address() -> str:
    """A loopback address with a free port, for torch.distributed's rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def _check_sizes(num_workers: object, num_groups: object) -> None:
    for name, v in (("num_workers", num_workers), ("num_groups", num_groups)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{name} must be at least 1, got {v}")
    assert isinstance(num_workers, int) and isinstance(num_groups, int)
    if num_workers % num_groups:
        raise ValueError(
            f"num_workers ({num_workers}) must be divisible by num_groups ({num_groups}), "
            "so that every group has the same size"
        )


def _as_rank(value: object, what: str) -> int:
    """An int index (numpy integers too, as sequences take them); never a bool."""
    if isinstance(value, bool):
        raise TypeError(f"{what}, not bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what}, not {type(value).__name__}") from None


def _rank_key(key: object, n: int, what: str) -> int:
    try:
        rank = _as_rank(key, f"{what} keys are int ranks")
    except TypeError:
        raise ValueError(f"{what} has key {key!r}, which is not a rank in 0..{n - 1}") from None
    if not 0 <= rank < n:
        raise ValueError(f"{what} has key {key!r}, which is not a rank in 0..{n - 1}")
    return rank


def _check_env(n: int, env: Mapping[int, Mapping[str, str]] | None) -> dict[int, dict[str, str]]:
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise TypeError("env must map a rank to a dict of environment variables, e.g. {0: {...}}")
    out = {}
    for key, values in env.items():
        rank = _rank_key(key, n, "env")
        if not isinstance(values, Mapping):
            raise TypeError(
                f"env[{key!r}] must be a dict of environment variables, e.g. "
                f"{{{key!r}: {{'NAME': 'value'}}}}, got {type(values).__name__}"
            )
        out[rank] = {str(k): str(v) for k, v in values.items()}
    return out


def _cpu_plan(n: int, plan: bool | Mapping[int, Iterable[int]] | None) -> dict[int, list[int]]:
    if plan is None or plan is False:
        return {}
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError("cpu_affinity needs os.sched_getaffinity, which this platform lacks")
    usable = sorted(os.sched_getaffinity(0))
    if plan is True:
        return {r: [usable[r % len(usable)]] for r in range(n)}
    if not isinstance(plan, Mapping):
        raise TypeError("cpu_affinity must be True or map a rank to a list of CPU numbers")
    out = {}
    for key, cpus in plan.items():
        rank = _rank_key(key, n, "cpu_affinity")
        if isinstance(cpus, (str, bytes)) or not isinstance(cpus, Iterable):
            raise TypeError(f"cpu_affinity[{key!r}] must be a list of CPU numbers, e.g. [0, 1]")
        chosen = [_as_rank(c, "a CPU is named by an int") for c in cpus]
        missing = sorted(set(chosen) - set(usable))
        if not chosen or missing:
            raise ValueError(
                f"cpu_affinity[{key!r}] = {chosen} names CPUs this process cannot use "
                f"({missing or 'none given'}); the usable CPUs are {usable}"
            )
        out[rank] = chosen
    return out


_PLAIN = frozenset({int, float, bool, type(None), str, complex})


def _plain(args: tuple[Any, ...]) -> bool:
    """Arguments that pickle small and alike everywhere (numbers, short strings)."""
    if len(args) > 8:
        return False
    for a in args:  # noqa: SIM110 (a plain loop: the hot path)
        if type(a) not in _PLAIN or (type(a) is str and len(a) > 256):
            return False
    return True


def _shape(shape: object) -> tuple[int, ...]:
    dims = (shape,) if not isinstance(shape, (tuple, list)) else tuple(shape)
    out = tuple(_as_rank(d, "an array's shape is made of ints") for d in dims)
    if any(d < 0 for d in out):
        raise ValueError(f"an array's shape cannot have negative sizes: {shape!r}")
    return out


def _values_per_worker(values: object, what: str) -> list[Any]:
    """A sequence of values, one per worker: a dict (its keys) or a set (no order) would be
    spread silently wrong, so they are refused."""
    if isinstance(values, (Mapping, set, frozenset, str, bytes, bytearray)):
        raise TypeError(
            f"{what} needs a list (or tuple, or array) of values, one per worker in rank order; "
            f"got {type(values).__name__}. To send the same value to every worker, use put()."
        )
    try:
        return list(values)  # type: ignore[call-overload,no-any-return]
    except TypeError:
        raise TypeError(
            f"{what} needs a list of values, one per worker, got {type(values).__name__}"
        ) from None


def _timeout_error(pending: _Pending, deadline: float | None) -> TimeoutError:
    return TimeoutError(
        f"{pending.remaining} worker(s) had not answered by the deadline. The work goes on and "
        "the Ref stays valid: wait again (get/gather/sync), or close the session."
    )


def _discard(q: collections.deque[_Pending], p: _Pending) -> None:
    try:
        q.remove(p)
    except ValueError:
        pass


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


def _worker_error(errors: dict[int, tuple[Any, ...]]) -> WorkerError:
    ranks = sorted(errors)
    first = ranks[0]
    excs = {r: protocol.unpack_error(errors[r]) for r in ranks}
    _, type_name, message, tb, where = errors[first]
    text = f"worker {first} raised {type_name}: {message}"
    if where:
        text += f" (in {where})"
    if len(ranks) > 1:
        text += f"; workers {ranks[1:]} failed too (see .errors)"
    text += f"\n\nRemote traceback (worker {first}):\n{tb.rstrip()}"
    err = WorkerError(text, first, excs)
    err.__cause__ = excs[first]
    return err


def _forked() -> None:
    """In a forked child, the parent's sessions are closed to it (the workers, rings and
    replies are the parent's): any use raises, naming the owner."""
    for sess in list(_live):
        sess._closed = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


@atexit.register
def _close_all() -> None:
    for sess in list(_live):
        try:
            sess.close(timeout=1.0)
        except Exception:
            pass
