"""The reply router: which reply belongs to which request, and who reads the channel.

    sender (holds the send lock)           router                          channel
    expect(req, ranks) ----------------->  per-rank FIFO of requests
    channel.send(...)  ------------------------------------------------->  workers
    wait(req, deadline) --> leader?  yes:  recv() a batch, hand each reply <-- replies, in
                                           to the head of its rank's FIFO     each worker's
                                           (a request timed out earlier      request order
                                           still takes its reply: errors in
                                           it are salvaged), wake followers
                                    no:    sleep on a condition until the leader
                                           has filled this request, or the deadline

run's usual case takes a shorter way (``quick``): when its request heads the FIFO of each
of its ranks, the channel reads and decodes all of their replies in one step, or none.

An event loop waits differently (session/aio.py): its request carries a ``done`` callback,
the loop watches the channel's wake fds, and on each wake ``poll()`` delivers what is there
without blocking; whoever delivers a request's last reply (the loop, or a blocking leader in
another thread) calls ``done``.

A worker answers its requests in the order they were sent, so the head of a rank's FIFO is
always the request a reply of that rank belongs to. Every wait is bounded: a wait slice
never exceeds half a second, so a closed session, a death (the owner's check_alive) and the
deadline are all noticed. A timeout abandons only the wait: the request stays in its FIFOs,
and any error its replies bring is kept for the next sync.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from unison import protocol
from unison.channel import Channel, Reply
from unison.errors import start_timed_out
from unison.protocol import ARRAY, ERR, OK, PICKLED, array_value, loads_plain, read_reply
from unison.session.signals import raised_by_a_signal
from unison.session.unreported import UnreportedErrors

if TYPE_CHECKING:
    from unison.debug.hang import Watchdog
    from unison.trace import Trace

__all__ = ["WHOLE", "Reentered", "Request", "Router", "RouterOwner", "reentered"]

SLICE = 0.5  # the longest single sleep of a wait, so close() and deadlines are noticed
_LOOK_AGAIN = 0.01  # a follower's last look, past its deadline: how often it reads again
WHOLE = 2
"""Request.abandoned for a SYNC: the reader keeps its answers' errors the moment the last
one is in (Router.keep_answers), all ranks at once: a sync of another thread that ends
after it finds them (kept by the waiting thread after its wait, they could come too late
for that one, and be raised by neither), and never half of one call's errors (unless the
sync timed out: then, as any abandoned wait's, each late answer is kept as it comes)."""


class Reentered(RuntimeError):
    """A session used from inside its own send or read, in the same thread: by code that
    ran there (a ``__del__`` the garbage collector ran, a weakref callback, a signal
    handler). The locks are re-entrant, so it got in, and cut into the call in progress: it
    sent its own function with that call's arguments, or took its replies. Raised before
    anything of it is sent."""


def reentered() -> Reentered:
    """The refusal, saying what to do."""
    return Reentered(
        "the session was used from code that ran in the middle of its own send or wait in "
        "this thread (a __del__ run by the garbage collector, a weakref callback, a signal "
        "handler), where it would cut into the call in progress: it is refused, and that "
        "call goes on. Defer the work (queue it, and make the call after the session's call "
        "returns), or close() there, which works")


class Request:
    """One request awaiting a reply from each of its ranks."""

    __slots__ = ("abandoned", "done", "ref_id", "remaining", "replies", "req_id", "salvaged")

    def __init__(self, req_id: int, count: int, ref_id: int = 0) -> None:
        self.req_id = req_id
        self.ref_id = ref_id  # for GET: whose value (or error) the replies carry
        self.remaining = count
        self.replies: dict[int, bytes | Reply] = {}
        self.abandoned: bool | int = False  # its wait timed out: errors in late replies
        # must be kept; or WHOLE, a SYNC whose answers are kept once all are in
        self.salvaged: set[int] | None = None  # ranks whose late reply was read after a
        # timeout (made then: run's hot path makes a Request per call)
        self.done: Callable[[BaseException | None], None] | None = None
        """Called (from any thread) once the last reply is in, or with the error that ends
        the wait (the session closed); an event loop's wait sets it."""


class RouterOwner(Protocol):
    """What the router needs from the session that owns it."""

    def check_open(self) -> None:
        """Raise SessionClosed if the session is closed."""

    def died(self, during: str, rank: int | None) -> BaseException:
        """A worker's stream ended: close the session; the error to raise."""

    def check_alive(self, during: str) -> None:
        """Raise (as died() does) if a worker has ended."""

    def interrupted(self, exc: BaseException) -> None:
        """Ctrl-C (or another signal handler's exception, ``exc``, which goes on) during a
        wait: stop the workers."""

    def out_of_step(self, rank: int) -> BaseException:
        """Worker ``rank`` sent a reply no request waits for: close the session; the error
        to raise."""


class Router:
    """Matches replies to requests for one session, from any number of waiting threads."""

    def __init__(self, num_workers: int, chan: Channel, errors: UnreportedErrors,
                 owner: RouterOwner, watched: bool) -> None:
        self._chan = chan
        self._errors = errors
        self._owner = owner
        self._expect: list[collections.deque[Request]] = [
            collections.deque() for _ in range(num_workers)
        ]
        self._recv_lock = threading.RLock()
        self._state_lock = threading.RLock()  # a signal handler's close salvages too
        self._cv = threading.Condition(threading.Lock())
        self._followers = 0
        self._missed = False
        """An event loop's poll found the recv lock taken: whoever lets go of it re-arms the
        loop's wake fd (``_rearm``), until a poll gets the lock."""
        self.slice = SLICE if watched else 0.05  # no death fds to wake us: poll more often
        """The longest single sleep of a wait (s); set by set_watched."""
        self.closed = False  # set by the owner; checked at every slice
        self.tracer: Trace | None = None
        """The running trace (unison.trace), told of every reply; None: off."""
        self.hang: Watchdog | None = None
        """Session(hang_timeout=...)'s policy, polled between slices (unison.debug.hang)."""

    def set_watched(self, watched: bool) -> None:
        """Whether a death wakes a waiting recv (then waits need not poll as often)."""
        self.slice = SLICE if watched else 0.05

    def idle(self, ranks: Sequence[int]) -> bool:
        """Whether no request to ``ranks`` awaits a reply."""
        expect = self._expect
        for r in ranks:  # noqa: SIM110 (a plain loop: the hot path)
            if expect[r]:
                return False
        return True

    @property
    def recv_lock(self) -> threading.RLock:
        """Held by the reading thread; the owner takes it to close the channel safely."""
        return self._recv_lock

    def expect(self, req: Request, ranks: Sequence[int]) -> None:
        """``req`` is about to be sent to ``ranks`` (caller holds the send lock). Refused
        where this thread is inside a read (code run there: a ``__del__``, a signal
        handler): that read would take its replies for the request ahead of it."""
        if self._recv_lock._is_owned():  # type: ignore[attr-defined]
            raise reentered()
        for r in ranks:
            self._expect[r].append(req)

    def expect_goodbye(self, req: Request, ranks: Sequence[int]) -> None:
        """``expect`` for the close's SHUTDOWN, which may come from inside a read (a signal
        handler's close, a death found there): its answers are drained, not waited for."""
        for r in ranks:
            self._expect[r].append(req)

    def forget(self, req: Request, ranks: Sequence[int]) -> None:
        """``req`` could not be sent after all."""
        for r in ranks:
            try:
                self._expect[r].remove(req)
            except ValueError:
                pass

    def wait(self, req: Request, deadline: float | None, during: str) -> None:
        """Until every rank of ``req`` has replied; TimeoutError at ``deadline`` (the request
        is then abandoned: its late replies' errors are kept for the next sync)."""
        try:  # (a wait inside a read cannot come: its request was refused at expect)
            while req.remaining:
                if self._recv_lock.acquire(False):
                    try:
                        self._pump(req, deadline, during)
                    finally:
                        self._recv_lock.release()
                        if self._missed:
                            self._rearm()
                        if self._followers:
                            with self._cv:
                                self._cv.notify_all()
                else:
                    self._follow(req, deadline, during)
        except BaseException as exc:
            if raised_by_a_signal(exc):  # Ctrl-C, a signal handler's: replies may be read
                self._owner.interrupted(exc)  # and not delivered, so the session closes
                raise
            if isinstance(exc, TimeoutError):
                self._abandon(req)
            elif isinstance(exc, (ValueError, OSError)) and self.closed:  # closed under the
                # wait (a signal handler's close, this thread's locks): the released ring's
                self._owner.check_open()  # error says nothing
            raise

    def quick(self, req: Request, ranks: tuple[int, ...],
              timeout: float | None = None) -> list[Any] | None:
        """run's usual case, ``req`` just sent and at the head of each of its ranks' FIFOs
        (so each rank's next reply is its own): the channel waits a little, reads and
        decodes them in one step (Channel.plain_values). None, with nothing delivered,
        where that cannot be (another thread reads, a trace runs, a reply that is not a
        plain value, not all in within one wait slice, or ``timeout``): then ``wait`` as
        ever."""
        try:  # (a read inside a read was refused at expect)
            if self.tracer is not None or not self._recv_lock.acquire(False):
                return None
            try:
                if self.closed:
                    return None
                expect = self._expect
                for r in ranks:
                    fifo = expect[r]
                    if not fifo or fifo[0] is not req:
                        return None
                hang, slice_ = self.hang, self.slice
                if hang is not None:
                    slice_ = min(slice_, hang.interval)
                if timeout is not None:
                    slice_ = min(slice_, timeout)
                values = self._chan.plain_values(ranks, req.req_id, slice_)
                if values is not None:
                    for r in ranks:
                        expect[r].popleft()
                    req.remaining = 0
                return values
            finally:
                self._recv_lock.release()
                if self._missed:
                    self._rearm()
                if self._followers:
                    with self._cv:
                        self._cv.notify_all()
        except BaseException as exc:
            if raised_by_a_signal(exc):  # a reply may be read and not delivered: as in wait
                self._owner.interrupted(exc)
            elif isinstance(exc, (ValueError, OSError)) and self.closed:  # (as in wait)
                self._owner.check_open()
            raise

    def values(self, req: Request, ranks: Sequence[int]) -> list[Any] | None:
        """A completed GET's or run's values in ``ranks`` order where every reply is a plain
        OK one for it (or a small numpy array's or scalar's: protocol.ARRAY): run's usual
        case, in one loop. None otherwise: ``decode`` then says what each reply is, and
        raises where one is wrong."""
        replies, want = req.replies, req.req_id
        out = []
        try:
            for r in ranks:
                raw = replies[r]
                if type(raw) is not bytes or not raw or raw[0] == PICKLED:
                    return None
                got, status, value = loads_plain(raw)
                if got != want or status != OK:
                    if got != want or status != ARRAY:
                        return None
                    value = array_value(value)
                out.append(value)
        except BaseException as exc:
            if raised_by_a_signal(exc):  # a signal handler's: never swallowed
                raise
            return None
        return out

    def decode(self, req: Request, ranks: Sequence[int], *, values: bool = False
               ) -> list[tuple[int, Any]]:
        """Each rank's (status, payload) of a completed request, in ``ranks`` order. With
        ``values`` (a GET or a run), an empty ack is out of step: it is no value; and a
        reply that will not unpickle here is that rank's error (ERR, a packed TypeError),
        the others still read: one rank's value must not hide another's error (a GET's
        worker struck it from its unreported list as it answered)."""
        out: list[tuple[int, Any]] = []
        for r in ranks:
            raw = req.replies[r]
            if not raw:  # an ack: done, nothing to report
                if values:
                    raise OutOfStep(
                        f"worker {r} answered request {req.req_id} with an acknowledgement "
                        "where a value was expected: the replies are out of step, so the "
                        "session was closed. Open a new Session to go on, and please report this.")
                out.append((OK, ()))
                continue
            try:  # (not run's usual case: ``values`` reads that)
                got_id, status, payload = read_reply(raw)
            except BaseException as exc:
                if raised_by_a_signal(exc):  # a signal handler's, not the reply's fault
                    raise
                err = _undecodable(r, exc)
                if not values:  # (a SYNC's errors are plain data: they always unpickle)
                    raise err from exc
                err.__cause__ = exc  # its traceback says where unpickling failed
                out.append((ERR, protocol.pack_error(  # (interrupts: here, Ctrl-C is ours)
                    err, protocol.ON_CONTROLLER, interrupts=True)))
                continue
            if got_id != req.req_id:  # never hand a reply to the wrong call, even under -O
                raise OutOfStep(
                    f"worker {r} answered request {got_id} where {req.req_id} was expected: the "
                    "replies are out of step, so the session was closed. Open a new Session "
                    "to go on, and please report this."
                )
            out.append((status, payload))
        return out

    def drain(self) -> None:
        """The workers are gone: read the replies they left, keeping the errors they carry
        (for abandoned requests, such as the one SHUTDOWN makes)."""
        late = None
        try:
            while any(self._expect):
                batch = self._chan.recv(0.0)
                if not batch:
                    break
                for rank, data in batch:
                    if data is None or not self._expect[rank]:
                        continue
                    exc = self._deliver(rank, data)
                    if late is None:
                        late = exc
        except (OSError, ValueError):
            pass
        if late is not None:
            raise late

    # -- the leader reads, followers sleep ------------------------------------------------------

    def _pump(self, req: Request, deadline: float | None, during: str) -> None:
        """Read replies for everyone until ``req`` is complete; caller holds the recv lock."""
        chan, owner, slice_ = self._chan, self._owner, self.slice
        hang = self.hang
        if hang is not None:
            slice_ = min(slice_, hang.interval)
        looked = False  # past the deadline: one last look first (worker 0 inline may have
        while req.remaining:  # replied while its share ran into the deadline)
            if self.closed:
                owner.check_open()
            timeout = slice_ if deadline is None else min(slice_, deadline - time.monotonic())
            if timeout <= 0:
                if looked:
                    raise self._timeout_error(req, during)
                looked, timeout = True, 0.0
            batch = chan.recv(timeout)
            if not batch:
                owner.check_alive(during)
                if hang is not None:
                    hang.poll(req.req_id, lambda: self.pending(req), during)
                continue
            expect = self._expect
            tracer = self.tracer
            late = None  # a done callback's error: raised once the whole batch is delivered
            for rank, data in batch:  # _deliver, inlined: this is the hot path
                if data is None:
                    self._deliver_rest(batch, rank)
                    raise owner.died(during, rank)
                waiting = expect[rank]
                if not waiting:  # never guess whose reply it is
                    raise owner.out_of_step(rank)
                p = waiting.popleft()
                p.replies[rank] = data
                p.remaining -= 1
                if tracer is not None:
                    tracer.on_reply(p.req_id, rank, data)
                if p.abandoned:
                    self._salvage(p, rank)
                done = p.done  # read once: an event loop's timeout may abandon it meanwhile
                if done is not None and not p.remaining:
                    try:
                        done(None)
                    except BaseException as exc:
                        if late is None:
                            late = exc
            if self._followers:
                with self._cv:
                    self._cv.notify_all()
            if late is not None:
                raise late
            if hang is not None and req.remaining:  # other threads' replies keep coming:
                hang.poll(req.req_id, lambda: self.pending(req), during)  # sample ours too

    def _deliver_rest(self, batch: list[tuple[int, bytes | Reply | None]], rank: int) -> None:
        """A death in ``batch`` at ``rank``: the replies read after it go to their requests
        before the session closes. The close reads on (and asks survivors that hold errors
        nobody fetched for them): a reply dropped here would put its worker's FIFO out of
        step, its SHUTDOWN answer taken for another request. The death is what is raised,
        not a done callback's error."""
        for r, data in batch[batch.index((rank, None)) + 1:]:
            if data is not None and self._expect[r]:
                self._deliver(r, data)

    def _deliver(self, rank: int, data: bytes | Reply) -> BaseException | None:
        """Hand one reply to the head of its rank's FIFO. What the request's ``done``
        callback raised, if anything: the caller raises it once its batch is all delivered
        (the replies read and not delivered would put the FIFOs out of step)."""
        waiting = self._expect[rank]
        if not waiting:
            raise self._owner.out_of_step(rank)
        p = waiting.popleft()
        p.replies[rank] = data
        p.remaining -= 1
        if self.tracer is not None:
            self.tracer.on_reply(p.req_id, rank, data)
        if p.abandoned:
            self._salvage(p, rank)
        done = p.done  # (read once, as in _pump)
        if done is not None and not p.remaining:
            try:
                done(None)
            except BaseException as exc:
                return exc
        return None

    # -- an event loop's wait ---------------------------------------------------------------------

    def poll(self, clear: bool = True) -> None:
        """Deliver the replies there are now, without blocking; nothing if another thread is
        reading: that one re-arms the wake fd as it lets go (it may have emptied it, reading
        only its own replies: shm's quick path), so the loop polls again. A death fails
        every waiting request (through the owner, which closes the session). ``clear``:
        empty the wake fd first (a syscall; a spinning wait skips it, and the poll that
        ends the spin empties it)."""
        try:
            if not self._recv_lock.acquire(False):
                self._missed = True
                if not self._recv_lock.acquire(False):  # (it let go before it could see)
                    return
            self._missed = False  # what is in now is read below
            try:
                if self.closed:  # the channel is gone: the waits were failed with the reason
                    return
                if clear:
                    self._chan.clear_wake()
                late = None
                batch = self._chan.recv(0.0)
                for rank, data in batch:
                    if data is None:
                        self._deliver_rest(batch, rank)
                        self.fail_all(self._owner.died("waiting for replies", rank))
                        return
                    if not self._expect[rank]:
                        self.fail_all(self._owner.out_of_step(rank))
                        return
                    exc = self._deliver(rank, data)
                    if late is None:
                        late = exc
                if late is not None:
                    raise late
            finally:
                self._recv_lock.release()
                if self._missed:
                    self._rearm()
                if self._followers:
                    with self._cv:
                        self._cv.notify_all()
        except BaseException as exc:
            if raised_by_a_signal(exc):  # (an event loop's reader: run_until_complete raises
                self._owner.interrupted(exc)  # it here) replies may be read and not delivered,
                raise  # as in wait: the session closes
            if not (isinstance(exc, (ValueError, OSError)) and self.closed):  # closed under
                raise  # the look (as in wait): the waits were failed with the reason

    def _rearm(self) -> None:
        """A poll found the recv lock taken (``_missed``): make the event loop's wake fd
        readable, so that it polls again now the lock is free. Under the lock, so that a
        close cannot close the fd meanwhile (and a poll it turns away meanwhile finds the
        fd readable after); where another thread has taken it again, that one does it as
        it lets go (only a poll that gets the lock lowers ``_missed``)."""
        if not self._recv_lock.acquire(False):
            return
        try:
            if not self.closed:
                self._chan.rearm_wake()
        finally:
            self._recv_lock.release()

    def fail_all(self, exc: BaseException) -> None:
        """The session is over: end every wait that has a ``done`` callback with ``exc``
        (each, where one raises: that is raised after)."""
        late = None
        for fifo in self._expect:
            for p in list(fifo):
                if p.remaining:
                    done, p.done = p.done, None  # (abandon() may clear it meanwhile)
                    if done is not None:
                        try:
                            done(exc)
                        except BaseException as error:
                            if late is None:
                                late = error
        if late is not None:
            raise late

    def abandon(self, req: Request) -> None:
        """A wait gave up (timeout, cancellation): keep the errors its replies bring."""
        req.done = None
        self._abandon(req)

    def _follow(self, req: Request, deadline: float | None, during: str = "waiting") -> None:
        """Another thread reads the channel: sleep until it hands over our replies."""
        with self._cv:
            self._followers += 1
            try:
                if req.remaining:
                    most = SLICE if self.hang is None else min(SLICE, self.hang.interval)
                    left = most if deadline is None else deadline - time.monotonic()
                    self._cv.wait(max(0.0, min(most, left)))
            finally:
                self._followers -= 1
        self._owner.check_open()
        if req.remaining and self.hang is not None:
            self.hang.poll(req.req_id, lambda: self.pending(req), during)
        if req.remaining and deadline is not None and time.monotonic() >= deadline:
            self._last_look(req)
            if req.remaining:
                raise self._timeout_error(req, during)

    def _last_look(self, req: Request) -> None:
        """A follower's look past its deadline, as ``_pump``'s: read what is in if nobody
        reads, else give the reader up to a slice while replies wait unread in the channel.
        After a pause (SIGSTOP, a suspended machine) this thread and the reader wake
        together, and the replies that came in time were not delivered yet: before (an
        audit of pauses, issue 9, forty-ninth pass), TimeoutError named a worker that had
        answered, and its value was dropped as late."""
        end = time.monotonic() + SLICE
        while True:
            self.poll(clear=False)  # (nothing where another thread reads: it delivers)
            if not req.remaining or self.closed or not self._chan.pending():
                return
            left = end - time.monotonic()
            if left <= 0:
                return
            with self._cv:  # counted, so the reader's delivery or its leaving wakes us
                self._followers += 1
                try:
                    if req.remaining:
                        self._cv.wait(min(left, _LOOK_AGAIN))
                finally:
                    self._followers -= 1

    def pending(self, req: Request) -> list[int]:
        """The ranks whose reply to ``req`` has not come yet."""
        return [r for r, fifo in enumerate(self._expect) if req in fifo]

    def _timeout_error(self, req: Request, during: str) -> TimeoutError:
        """The deadline passed: name the wait, and where each worker that owes a reply is
        (the owner's ``_where_they_are``, bounded; absent for owners without one)."""
        ranks = self.pending(req)
        text = self._start_timed_out(ranks) if during == "starting" else (
            f"{during} timed out: {req.remaining} worker(s) {ranks} had not answered by "
            "the deadline. The work goes on and the Ref stays valid: wait again "
            "(get/gather/sync), or close the session.")
        where = getattr(self._owner, "_where_they_are", None)
        if where is not None:
            text += where(ranks)
        return TimeoutError(text)

    def _start_timed_out(self, ranks: list[int]) -> str:
        """The start's timeout; where workers join over TCP, also those that never connected,
        and how to start them (the usual cause there: nobody started them, or they cannot
        reach the address)."""
        text = start_timed_out(ranks)
        joined = getattr(self._chan, "joined", None)
        address = getattr(self._chan, "address", "")
        never = [] if joined is None else sorted(set(ranks) - set(joined()))
        if never and address:
            text += (f" Worker(s) {never} never connected to {address}: start them with "
                     f"`unison worker --connect {address}` (UNISON_SECRET set to the session's "
                     "secret), and check that they can reach that address.")
        refusal = getattr(self._chan, "refusal", "")
        if never and refusal:
            text += f" The last worker that tried was refused: {refusal}."
        return text

    # -- abandoned requests keep their errors ----------------------------------------------------

    def _abandon(self, req: Request) -> None:
        with self._state_lock:
            req.abandoned = True
        for rank in list(req.replies):
            self._salvage(req, rank)

    def keep_answers(self, req: Request) -> None:
        """A complete SYNC's answers (``WHOLE``): every worker's errors, kept at once.
        Whoever comes first does it: the reader, or the waiting thread after its wait."""
        with self._state_lock:
            if req.remaining or req.salvaged is not None:
                return
            req.salvaged = set(req.replies)
        answers = {}
        for rank, raw in req.replies.items():
            if not raw:  # an empty ack: nothing held
                continue
            try:
                got, _, payload = read_reply(raw)
            except BaseException as exc:  # (in whichever thread reads: the session closes)
                if raised_by_a_signal(exc):
                    raise
                got = None
            if got != req.req_id:  # another call's reply: never read as this one's errors
                raise self._owner.out_of_step(rank)
            answers[rank] = payload
        self._errors.add_answers(answers)

    def _salvage(self, req: Request, rank: int) -> None:
        if req.abandoned is WHOLE:
            self.keep_answers(req)
            return
        with self._state_lock:
            if req.salvaged is None:
                req.salvaged = set()
            elif rank in req.salvaged:
                return
            req.salvaged.add(rank)
        raw = req.replies[rank]
        if not raw:
            return
        try:
            got, status, payload = read_reply(raw)
        except BaseException as exc:
            if raised_by_a_signal(exc):  # a signal handler's: never swallowed
                raise
            return  # a value that cannot be unpickled here carries no error
        if got != req.req_id:  # another call's reply: never read as this one's errors
            raise self._owner.out_of_step(rank)
        if req.ref_id and status != OK:
            self._errors.add(req.ref_id, rank, payload)
        elif not req.ref_id and got != protocol.READY_REQ:  # a SYNC's or SHUTDOWN's list
            # (a worker's hello carries its pid, no errors)
            self._errors.add_all(rank, payload)


def _undecodable(rank: int, exc: BaseException) -> TypeError:
    """Why a reply will not unpickle here (its type does not import, or its reducer
    refuses, or raises SystemExit, which must not end the controller), and what to do."""
    said = protocol.safe_str(exc, True)
    if not isinstance(exc, Exception):  # SystemExit's text is its bare code
        said = f"{type(exc).__name__}({said})"
    return TypeError(
        f"the reply of worker {rank} cannot be unpickled on the controller: "
        f"{said}. Make its type importable here, or return plain data.")


class OutOfStep(RuntimeError):
    """A reply carried another request's id: the session must close."""
