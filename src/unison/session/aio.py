"""asyncio: waiting for replies without blocking the event loop, and without a thread per
wait.

    await ref / sess.run_async(f)  -> a Request with a ``done`` callback, sent as usual
                                   -> Waits.wait(req): a future of the running loop
    loop.add_reader(wake fds)      -> Router.poll(): deliver what is there, no blocking;
                                      the last reply calls req.done -> the future is set
    loop.add_reader(pidfds)        -> a death: the session closes, every future fails

One ``Waits`` per session, bound to the first event loop that waits on it (a second loop
while the first still waits is refused: the replies are read in one place; once the first
is closed, the next takes over). The readers stay on the loop until the session closes
(adding and removing them per await cost more than the round trip); the channel is told to
signal every reply only while at least one await sleeps in the selector, so an await caught
by its spin, and a session that no event loop waits on, cost no signal. When the loop has
nothing else ready to run, an await first spins up to SPIN for its replies, as a blocking
wait does: a quick call is then caught without a wake-up through the selector. Cancelling
the waiting task (``asyncio.wait_for``, ``task.cancel()``) abandons only the wait, as
``timeout=`` does: the work goes on, and errors in its late replies are kept for the next
sync; so with an await left pending on a loop that was then closed, once its replies come.
"""

from __future__ import annotations

import asyncio
import math
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from unison.channel import Channel
from unison.deadline import seconds
from unison.pacing import SPIN, spin
from unison.session.router import Request, Router

_DETACH_S = 1.0
"""How long a close in another thread waits for the event loop to stop watching the
session's fds (a running loop does it at its next turn)."""

__all__ = ["Waits"]


class Owner(Protocol):
    """What the waits need from their session."""

    def check_open(self) -> None: ...

    def check_alive(self, during: str) -> None: ...

    def watch_fds(self) -> list[int]: ...


class Waits:
    """The event loop's side of one session's replies."""

    def __init__(self, owner: Owner, chan: Channel, router: Router) -> None:
        self._owner = owner
        self._chan = chan
        self._router = router
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0
        self._pending = 0  # waits between prepare and their end, on the bound loop
        self._asleep = 0  # of those, the ones sleeping in the selector (the flag is up)
        self._readers: list[tuple[int, Callable[[], None]]] = []  # what _attach gave the loop

    async def wait(self, req: Request, fut: asyncio.Future[None], timeout: float | None,
                   during: str) -> None:
        """Until every reply of ``req`` is in (``fut`` is what ``prepare`` gave, before
        ``req`` was sent). TimeoutError after ``timeout`` seconds; what ended the wait
        otherwise (the session closed: SessionClosed, WorkerDied)."""
        chan, router = self._chan, self._router
        slept = False
        try:
            if req.remaining and _loop_idle():
                # nothing else is ready to run: a short spin catches quick replies without
                # a trip through the selector (asyncio's loops; others skip it); until every
                # reply is in, not the first only (a wait that met one of two replies went
                # through the selector for the other: a wake-up, 30-80 us)
                def complete() -> bool:
                    if chan.pending():
                        router.poll(clear=False)
                    return not req.remaining

                spin(complete, SPIN)
            if req.remaining:  # (every reply in: a later death is no concern of this one)
                router.poll(clear=False)  # deliver what is in (or a death)
            if fut.done():  # no flag raised, no trip through the selector
                fut.result()
                return
            self._suspend()
            slept = True
            router.poll(clear=False)  # what came before the workers saw the flag
            if timeout is None or seconds(timeout, "timeout") == math.inf:  # (checked
                await fut  # before the send: 10**400 is inf too, past what wait_for takes)
            else:
                await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            # one last look, as a blocking wait's: after a pause (SIGSTOP, a suspended
            # machine) the loop runs wait_for's timer before the reader of replies that
            # came in time (before, an audit of pauses, issue 9, forty-ninth pass: a
            # TimeoutError naming no worker, and run_async's values lost)
            router.poll(clear=False)
            if not req.remaining:
                return
            ranks = router.pending(req)
            router.abandon(req)
            where = getattr(self._owner, "_where_they_are", None)  # their stacks: ~10 ms,
            report = "" if where is None else where(ranks)  # 0.1 s at most, on the loop
            raise TimeoutError(
                f"{during} timed out: {req.remaining} worker(s) {ranks} had not answered "
                f"within {timeout} s. The work goes on and the Ref stays valid: wait again, or "
                f"close the session.{report}"
            ) from None
        except asyncio.CancelledError:
            router.abandon(req)
            raise
        finally:
            self._end(slept, fut.get_loop())

    def settled(self, ranks: tuple[int, ...], timeout: float | None) -> bool:
        """sync_async's look at the workers' progress (done positions, reports), in place of
        SYNC: whether every worker in ``ranks`` ran all sent and holds no error nobody
        fetched. It waits up to the spin a blocking wait spins, and only where the loop has
        nothing else ready to run (elsewhere one look); False: the caller asks (SYNC)."""
        wait = SPIN if _loop_idle() else 0.0
        if timeout is not None:
            wait = min(wait, max(0.0, timeout))
        return self._chan.settled(ranks, wait)

    def prepare(self, req: Request) -> asyncio.Future[None]:
        """A future of the running loop for ``req``, set from whichever thread delivers its
        last reply. Call before sending, and ``wait`` (or ``cancel``) after. A closed
        session raises SessionClosed here: its fds are closed, and their numbers may be
        the user's by now (binding the loop to them would take over the user's readers)."""
        self._owner.check_open()
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._loop is not loop:
                self._bind(loop)
            self._pending += 1
        fut = loop.create_future()
        thread, router = self._thread, self._router

        def done(exc: BaseException | None) -> None:
            req.done = None  # called once; and no cycle (req, done) is left behind
            if not loop.is_closed():
                if threading.get_ident() == thread:
                    _settle(fut, exc)
                    return
                try:
                    loop.call_soon_threadsafe(_settle, fut, exc)
                    return
                except RuntimeError:  # closed meanwhile
                    pass
            # the loop is closed (a task left pending on it): nobody waits any more, and
            # errors in the replies are kept for the next sync, as a cancelled wait's are
            if exc is None:
                router.abandon(req)

        req.done = done
        return fut

    def quick(self, req: Request, ranks: tuple[int, ...]) -> list[Any] | None:
        """An awaited run's or fetch's usual case, where the loop has nothing else ready to
        run: the blocking one's quick path (Router.quick: every reply read and decoded in
        one step), for the spin a blocking wait spins. The values, and the wait is over;
        None: ``wait`` (which costs a poll and a delivery a reply: 1.66x the blocking run at
        N=2, against 1.30x this way, ``python benchmarks/async_bench.py``)."""
        if not _loop_idle():
            return None
        values = self._router.quick(req, ranks, SPIN)
        if values is not None:
            self.cancel(req)
        return values

    def cancel(self, req: Request) -> None:
        """``req`` needs no wait after ``prepare``: never sent, or its replies read already."""
        req.done = None
        self._end(False)

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch the wake fds from ``loop`` from now on (the session's first loop, or the
        next once the previous one is closed); caller holds the lock."""
        if self._loop is not None and not self._loop.is_closed():
            if self._pending:
                raise RuntimeError(
                    "this session is already awaited from another event loop: await "
                    "it from one loop at a time"
                )
            self._detach(self._loop)
        if self._asleep:  # waits left asleep on a closed loop: lower their flag
            self._chan.async_waiting(False)
        self._pending = self._asleep = 0  # a closed loop's waits are gone with it
        self._attach(loop)

    def _suspend(self) -> None:
        """An await is about to sleep in the selector: workers signal every reply while
        any does (the flag, then a fence, before the caller polls once more)."""
        with self._lock:
            self._asleep += 1
            if self._asleep == 1:
                self._chan.async_waiting(True)

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.get_ident()
        # weakly: the loop's selector holds its callbacks, and through a bound method it
        # held the session, which then stayed open (its workers up) after the program
        # dropped it, for as long as the loop ran
        poll, death = _weakly(self._router.poll), _weakly(self._death)
        self._readers = ([(fd, poll) for fd in self._chan.wake_fds()]
                         + [(fd, death) for fd in self._owner.watch_fds()])
        for fd, callback in self._readers:
            # A reader the loop still has for this number is stale: a closed session's,
            # whose close could not wait for the loop (_DETACH_S). Over it, add_reader
            # would only swap the callback and never watch the new file: a hang.
            loop.remove_reader(fd)
            loop.add_reader(fd, callback)

    def _end(self, slept: bool, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """A wait is over (``slept``: in the selector); the last sleeper lowers the flag.
        ``loop``: the wait's; one of a loop no longer bound (closed, its tasks collected
        later) leaves alone the counts that the binding since then keeps."""
        with self._lock:
            if loop is not None and loop is not self._loop:
                return
            self._pending = max(0, self._pending - 1)
            if not slept or self._asleep == 0:  # (0: close() or a new loop reset it)
                return
            self._asleep -= 1
            if self._asleep == 0:
                try:
                    self._chan.async_waiting(False)
                except (ValueError, OSError):
                    pass  # the channel is closed

    def _detach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Stop watching the session's fds; only where the reader is still ours: a detach
        that comes after close() gave up waiting for it finds the numbers closed, maybe
        reused by a reader of someone else's (another session's)."""
        if loop.is_closed():
            return
        for fd, ours in self._readers:
            if _reader(loop, fd) in (ours, _UNKNOWN):
                loop.remove_reader(fd)

    def close(self) -> None:
        """The session closes: stop watching its fds (before they are closed)."""
        with self._lock:
            loop, self._loop = self._loop, None
            self._pending = self._asleep = 0
        if loop is None:
            return
        if threading.get_ident() == self._thread:
            self._detach(loop)
            return
        # The fds close right after this: the loop must forget them first, or a file opened
        # meanwhile with one of their numbers (another session's, on this loop) would lose
        # its reader to our late remove_reader, or fail its add_reader on our stale entry.
        detached = threading.Event()

        def detach() -> None:
            try:
                self._detach(loop)
            finally:
                detached.set()

        try:
            loop.call_soon_threadsafe(detach)
        except RuntimeError:
            return  # the loop is closed: its selector went with it
        detached.wait(_DETACH_S)  # a loop held by a long callback keeps the old way

    def _death(self) -> None:
        """A watched fd is readable: a worker ended. The session closes and fails every
        pending wait."""
        try:
            self._owner.check_alive("waiting for replies")
        except BaseException as exc:  # the session closed: SessionClosed or WorkerDied
            self._router.fail_all(exc)
            with self._lock:
                loop, self._loop = self._loop, None
            if loop is not None:
                self._detach(loop)


_UNKNOWN = object()


def _reader(loop: asyncio.AbstractEventLoop, fd: int) -> object:
    """The callback ``loop`` calls when ``fd`` is readable; None if none; _UNKNOWN where the
    loop does not say (not a selector loop of asyncio's)."""
    selector = getattr(loop, "_selector", None)
    if selector is None:
        return _UNKNOWN
    try:
        handle = selector.get_key(fd).data[0]
    except KeyError:
        return None
    except Exception:  # (another selector's layout)
        return _UNKNOWN
    return getattr(handle, "_callback", _UNKNOWN) if handle is not None else None


def _weakly(method: Callable[[], None]) -> Callable[[], None]:
    """``method``, called through a weak reference to its object (nothing once it is gone)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _loop_idle() -> bool:
    """Whether the running loop has nothing else ready to run, so that a short spin holds
    up nobody (asyncio's loops say so in ``_ready``; a loop that does not say is busy)."""
    return not getattr(asyncio.get_running_loop(), "_ready", True)
