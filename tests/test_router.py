"""The reply router, below the Session: replies matched to requests, leader and followers,
timeouts, abandoned requests that keep their errors, deaths. In-process, against an
in-memory channel: no worker processes, so each case runs in milliseconds."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from support import held_elsewhere
from unison import protocol
from unison.protocol import ERR, OK
from unison.session.router import OutOfStep, Request, Router
from unison.session.unreported import UnreportedErrors


class MemoryChannel:
    """Replies put by the test, read by the router: (rank, bytes or None for a dead stream)."""

    def __init__(self) -> None:
        self._q: queue.Queue[tuple[int, bytes | None]] = queue.Queue()
        self.reads = 0

    def reply(self, rank: int, req_id: int, status: int = OK, payload: object = None) -> None:
        self._q.put((rank, protocol.dumps((req_id, status, payload))))

    def ack(self, rank: int) -> None:
        self._q.put((rank, b""))

    def pending(self) -> bool:
        return not self._q.empty()

    def rearm_wake(self) -> None:
        pass

    def end(self, rank: int) -> None:
        self._q.put((rank, None))

    quick: list[object] | BaseException | None = None
    """What plain_values gives (the router's quick path), or raises; None: no quick path."""

    def plain_values(self, ranks: tuple[int, ...], req_id: int,
                     timeout: float) -> list[object] | None:
        self.quick_asked = (ranks, req_id)
        if isinstance(self.quick, BaseException):
            raise self.quick
        return self.quick

    def recv(self, timeout: float | None) -> list[tuple[int, bytes | None]]:
        self.reads += 1
        try:
            first = self._q.get(timeout=timeout) if timeout else self._q.get_nowait()
        except queue.Empty:
            return []
        out = [first]
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return out


class Owner:
    def __init__(self) -> None:
        self.alive_checks = 0
        self.deaths: list[tuple[str, int | None]] = []
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("closed")

    def died(self, during: str, rank: int | None) -> BaseException:
        self.deaths.append((during, rank))
        return ConnectionError(f"worker {rank} died while {during}")

    def check_alive(self, during: str) -> None:
        self.alive_checks += 1

    def interrupted(self, exc: BaseException) -> None:
        self.interrupts = getattr(self, "interrupts", 0) + 1

    def out_of_step(self, rank: int) -> BaseException:
        self.closed = True
        return OutOfStep(f"worker {rank} sent a reply nobody asked for")


def make(n: int = 2) -> tuple[Router, MemoryChannel, UnreportedErrors, Owner]:
    chan, errors, owner = MemoryChannel(), UnreportedErrors(), Owner()
    return Router(n, chan, errors, owner, watched=True), chan, errors, owner  # type: ignore[arg-type]


def error(message: str) -> tuple[object, ...]:
    return protocol.pack_error(ValueError(message), "f")


def test_replies_go_to_requests_in_each_workers_order():
    router, chan, _, _ = make(2)
    first, second = Request(1, 2, ref_id=10), Request(2, 2, ref_id=11)
    router.expect(first, (0, 1))
    router.expect(second, (0, 1))
    chan.reply(0, 1, OK, "a0")
    chan.reply(1, 1, OK, "a1")
    chan.reply(0, 2, OK, "b0")
    chan.reply(1, 2, OK, "b1")
    router.wait(second, None, "testing")  # the leader completes both on the way
    assert first.remaining == 0
    assert router.decode(first, (0, 1)) == [(OK, "a0"), (OK, "a1")]
    assert router.decode(second, (0, 1)) == [(OK, "b0"), (OK, "b1")]


def test_an_ack_decodes_as_ok_with_nothing():
    router, chan, _, _ = make(1)
    req = Request(3, 1)
    router.expect(req, (0,))
    chan.ack(0)
    router.wait(req, None, "testing")
    assert router.decode(req, (0,)) == [(OK, ())]


def test_a_follower_is_handed_its_reply_by_the_leader():
    router, chan, _, _ = make(2)
    mine, theirs = Request(1, 1), Request(2, 1)
    router.expect(mine, (0,))
    router.expect(theirs, (1,))
    done = threading.Event()

    def follower():
        router.wait(theirs, time.monotonic() + 10, "following")
        done.set()

    router.recv_lock.acquire()  # make this thread the reader while the follower starts
    t = threading.Thread(target=follower)
    t.start()
    time.sleep(0.05)
    router.recv_lock.release()
    chan.reply(1, 2, OK, "theirs")
    chan.reply(0, 1, OK, "mine")
    router.wait(mine, time.monotonic() + 10, "leading")
    t.join(10)
    assert done.is_set()
    assert router.decode(theirs, (1,)) == [(OK, "theirs")]


def test_a_follower_past_its_deadline_takes_replies_that_came_in_time():
    """After a pause the follower and the reader wake together, the reply already in: the
    follower reads again while replies wait unread, for up to a slice, then gives up."""
    router, chan, _, _ = make(1)
    req = Request(7, 1, ref_id=70)
    router.expect(req, (0,))
    chan.reply(0, 7, OK, "in time")
    router.recv_lock.acquire()  # the reader, woken but not yet reading
    outcome: list[object] = []
    t = threading.Thread(target=lambda: outcome.append(_waited(router, req)))
    t.start()
    time.sleep(0.1)  # the follower is in its last look: its deadline passed
    router.recv_lock.release()  # the reader lets go with the reply unread, telling nobody
    let_go = time.monotonic()
    t.join(5)
    assert outcome == [None]
    assert time.monotonic() - let_go < 0.25  # it reads again soon, not after a slice
    assert router.decode(req, (0,)) == [(OK, "in time")]

    stuck = Request(8, 1, ref_id=80)  # a reply unread that nobody delivers: a slice, then the error
    router.expect(stuck, (0,))
    chan.reply(0, 8, OK, "held")
    with held_elsewhere(router.recv_lock):
        start = time.monotonic()
        assert isinstance(_waited(router, stuck), TimeoutError)
        assert 0.4 < time.monotonic() - start < 2.0
    router.poll(clear=False)  # (its reply, now late, is dropped)

    late = Request(9, 1, ref_id=90)  # nothing in: the error at once
    router.expect(late, (0,))
    with held_elsewhere(router.recv_lock):
        start = time.monotonic()
        assert isinstance(_waited(router, late), TimeoutError)
        assert time.monotonic() - start < 0.3


def _waited(router: Router, req: Request) -> BaseException | None:
    try:
        router.wait(req, time.monotonic() - 1, "waiting")
    except TimeoutError as exc:
        return exc
    return None


def test_a_timeout_abandons_the_request_and_a_late_error_is_kept():
    router, chan, errors, _ = make(1)
    req = Request(5, 1, ref_id=42)
    router.expect(req, (0,))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="had not answered"):
        router.wait(req, time.monotonic() + 0.1, "waiting")
    assert time.monotonic() - start < 1.0
    assert req.abandoned
    later = Request(6, 1)
    router.expect(later, (0,))
    chan.reply(0, 5, ERR, error("late failure"))  # the abandoned GET's reply comes first
    chan.ack(0)
    router.wait(later, None, "testing")
    kept = errors.pop_earliest((0, 1), 1 << 30)
    assert kept is not None and kept[0][2] == "late failure"


def test_a_late_value_of_an_abandoned_request_is_not_an_error():
    router, chan, errors, _ = make(1)
    req = Request(5, 1, ref_id=42)
    router.expect(req, (0,))
    with pytest.raises(TimeoutError):
        router.wait(req, time.monotonic() + 0.05, "waiting")
    later = Request(6, 1)
    router.expect(later, (0,))
    chan.reply(0, 5, OK, "fine")
    chan.ack(0)
    router.wait(later, None, "testing")
    assert errors.pop_earliest((0, 1), 1 << 30) is None


def test_an_abandoned_sync_keeps_every_error_it_carries():
    router, chan, errors, _ = make(1)
    req = Request(7, 1)  # SYNC: ref_id 0, the payload lists (ref_id, error)
    router.expect(req, (0,))
    with pytest.raises(TimeoutError):
        router.wait(req, time.monotonic() + 0.05, "syncing")
    chan.reply(0, 7, OK, [(3, error("three")), (4, error("four"))])
    router.drain()
    assert errors.pop_earliest((0, 1), 1 << 30)[0][2] == "three"
    assert errors.pop_earliest((0, 1), 1 << 30)[0][2] == "four"


def test_an_ended_stream_is_a_death():
    router, chan, _, owner = make(2)
    req = Request(1, 2)
    router.expect(req, (0, 1))
    chan.end(1)
    with pytest.raises(ConnectionError, match="worker 1 died while fetching"):
        router.wait(req, None, "fetching")
    assert owner.deaths == [("fetching", 1)]


@pytest.mark.parametrize("reader", ["wait", "poll"])
def test_replies_read_after_a_death_in_one_batch_still_reach_their_requests(reader):
    """A death met in the middle of a batch: the replies read after it are delivered before
    the owner hears of the death, so that a close reading on (a SHUTDOWN's errors from the
    survivors) finds each worker's requests in step (before, they were dropped: the
    survivor's next reply went to the request that had lost its own)."""
    router, chan, errors, _ = make(2)
    req, goodbye = Request(1, 2), Request(2, 1)
    goodbye.abandoned = True
    router.expect(req, (0, 1))
    router.expect(goodbye, (0,))
    chan.end(1)  # one batch: worker 1's end, then worker 0's reply to req
    chan.reply(0, 1, OK, "value")
    if reader == "wait":
        with pytest.raises(ConnectionError, match="worker 1 died"):
            router.wait(req, None, "fetching")
    else:
        router.poll(clear=False)  # (an event loop's reader)
    assert req.replies[0] is not None and router.pending(req) == [1]
    chan.reply(0, 2, OK, [(7, error("held on worker 0"))])  # the survivor's goodbye
    router.drain()
    assert router.pending(goodbye) == []
    assert errors.pop_earliest((0,), 1 << 30)[0][2] == "held on worker 0"


def test_an_idle_wait_checks_that_the_workers_live():
    router, _, _, owner = make(1)
    router.set_watched(False)  # no death fds: poll often
    req = Request(1, 1)
    router.expect(req, (0,))
    with pytest.raises(TimeoutError):
        router.wait(req, time.monotonic() + 0.3, "waiting")
    assert owner.alive_checks >= 2


def test_a_reply_for_another_request_is_never_taken():
    router, chan, _, _ = make(1)
    req = Request(9, 1)
    router.expect(req, (0,))
    chan.reply(0, 8, OK, "not yours")
    router.wait(req, None, "testing")
    with pytest.raises(OutOfStep, match="out of step"):
        router.decode(req, (0,))


def test_a_marshalled_reply_for_another_request_is_never_taken():
    router, chan, _, _ = make(2)
    req = Request(9, 2)
    router.expect(req, (0, 1))
    chan._q.put((0, protocol.dumps_plain((9, OK, 5), protocol.PLAIN)))
    chan._q.put((1, protocol.dumps_plain((8, OK, 5), protocol.PLAIN)))  # id wrong
    router.wait(req, None, "testing")
    with pytest.raises(OutOfStep, match="answered request 8 where 9 was expected"):
        router.decode(req, (0, 1), values=True)


def test_an_ack_where_a_value_is_expected_is_never_taken_for_one():
    router, chan, _, _ = make(1)
    req = Request(4, 1)
    router.expect(req, (0,))
    chan.ack(0)
    router.wait(req, None, "testing")
    with pytest.raises(OutOfStep, match="acknowledgement where a value was expected"):
        router.decode(req, (0,), values=True)


@pytest.mark.parametrize("second", [
    protocol.dumps_plain((8, OK, 5), protocol.PLAIN),  # another request's
    protocol.dumps_plain((9, ERR, error("boom")), protocol.PLAIN),  # an error
    b"",  # an ack
    protocol.dumps((9, OK, 5)),  # pickled: decoded the long way
    protocol.dumps_plain((9, OK), protocol.PLAIN),  # two fields, not three
    b"\x00garbage",  # not marshal
], ids=["other-id", "error", "ack", "pickled", "short", "garbage"])
def test_the_plain_values_shortcut_takes_only_plain_ok_replies_for_the_request(second):
    """Router.values (run's usual case) gives up, for decode to judge, on anything but a
    plain OK reply carrying this request's id."""
    router, chan, _, _ = make(2)
    req = Request(9, 2)
    router.expect(req, (0, 1))
    chan._q.put((0, protocol.dumps_plain((9, OK, 5), protocol.PLAIN)))
    chan._q.put((1, second))
    router.wait(req, None, "testing")
    assert router.values(req, (0, 1)) is None
    good = Request(10, 2)
    router.expect(good, (0, 1))
    for rank in (0, 1):
        chan._q.put((rank, protocol.dumps_plain((10, OK, rank + 40), protocol.PLAIN)))
    router.wait(good, None, "testing")
    assert router.values(good, (0, 1)) == [40, 41]
    assert router.values(good, (1, 0)) == [41, 40]


def test_a_reply_that_no_request_waits_for_closes_the_session():
    router, chan, _, owner = make(2)
    req = Request(1, 1)
    router.expect(req, (1,))
    chan.reply(0, 7, OK, "nobody asked")  # worker 0 owes nothing
    chan.reply(1, 1, OK, "yours")
    with pytest.raises(OutOfStep, match="worker 0"):
        router.wait(req, None, "testing")
    assert owner.closed


def test_a_request_that_could_not_be_sent_is_forgotten():
    router, chan, _, _ = make(2)
    lost, kept = Request(1, 2), Request(2, 2)
    router.expect(lost, (0, 1))
    router.forget(lost, (0, 1))
    router.expect(kept, (0, 1))
    chan.reply(0, 2, OK, 0)
    chan.reply(1, 2, OK, 1)
    router.wait(kept, None, "testing")
    assert router.decode(kept, (0, 1)) == [(OK, 0), (OK, 1)]


def test_a_closed_owner_ends_the_wait():
    router, _, _, owner = make(1)
    req = Request(1, 1)
    router.expect(req, (0,))
    owner.closed = True
    router.closed = True
    with pytest.raises(RuntimeError, match="closed"):
        router.wait(req, None, "waiting")


def test_the_unreported_store_reports_each_error_once_earliest_first():
    errors = UnreportedErrors()
    errors.add(7, 1, error("seven on 1"))
    errors.add_all(0, [(3, error("three on 0")), (7, error("seven on 0"))])
    errors.forget(99, (0, 1))
    first = errors.pop_earliest((0, 1), 1 << 30)
    assert sorted(first) == [0] and first[0][2] == "three on 0"
    second = errors.pop_earliest((0, 1), 1 << 30)
    assert sorted(second) == [0, 1]
    assert errors.pop_earliest((0, 1), 1 << 30) is None
    errors.add(5, 1, error("five on 1"))
    errors.add(6, 0, error("six on 0"))
    errors.add(6, 1, error("six on 1"))
    # a view's sync takes its workers' errors only, earliest first; the rest stay
    assert [(r, e[2]) for r, e in errors.pop_earliest((0,), 1 << 30).items()] == [(0, "six on 0")]
    assert [(r, e[2]) for r, e in errors.pop_earliest((1,), 1 << 30).items()] == [(1, "five on 1")]
    assert [(r, e[2]) for r, e in errors.pop_earliest((0, 1), 1 << 30).items()] == [(1, "six on 1")]
    assert errors.pop_earliest((0, 1), 1 << 30) is None
    errors.add(8, 0, error("lost"))
    [said] = errors.take_warnings("a session")
    assert said.startswith("call #8 of f raised ValueError: lost")
    assert errors.pop_earliest((0, 1), 1 << 30) is None


def _send_an_extra_ack() -> int:
    """Worker code that writes to its own channel (never done by unison): an ack before the
    run's reply."""
    import gc

    from unison.channel import WorkerChannel

    chan = next(o for o in gc.get_objects() if isinstance(o, WorkerChannel))
    chan.reply(b"")
    return 1


def test_a_worker_that_answers_twice_never_gives_a_wrong_value(make_session):
    import unison

    sess = make_session(1)
    with pytest.raises(unison.SessionClosed, match="out of step"):
        sess.run(_send_an_extra_ack, timeout=30)
    with pytest.raises(unison.SessionClosed):
        sess.run(int, timeout=30)


def test_the_quick_path_asks_the_channel_only_for_a_request_at_the_head_of_each_fifo():
    """run's quick path (Router.quick) hands the channel a request only where each of its
    ranks' next reply must be its own; it then takes the request off those FIFOs, so the
    replies after it go to the requests after it."""
    router, chan, _, _ = make(2)
    first, second, third = Request(1, 2), Request(2, 2), Request(3, 1)
    for req in (first, second):
        router.expect(req, (0, 1))
    chan.quick = ["x", "y"]
    assert router.quick(second, (0, 1)) is None  # first's replies come before second's
    assert not hasattr(chan, "quick_asked")
    assert router.quick(first, (0, 1)) == ["x", "y"]
    assert chan.quick_asked == ((0, 1), 1) and first.remaining == 0
    router.expect(third, (1,))
    chan.quick = None  # the channel cannot: nothing is taken off, wait reads as ever
    assert router.quick(second, (0, 1)) is None and second.remaining == 2
    chan.reply(0, 2, OK, "b0")
    chan.reply(1, 2, OK, "b1")
    chan.reply(1, 3, OK, "c1")
    router.wait(third, None, "testing")
    assert router.decode(second, (0, 1)) == [(OK, "b0"), (OK, "b1")]
    assert router.decode(third, (1,)) == [(OK, "c1")]
    assert router.idle((0, 1))


def test_the_quick_path_stands_aside_for_a_reading_thread_a_trace_and_a_closed_session():
    router, chan, _, _ = make(1)
    req = Request(1, 1)
    router.expect(req, (0,))
    chan.quick = [1]
    holder = threading.Thread(target=router.recv_lock.acquire)  # another thread reads
    holder.start()
    holder.join()
    assert router.quick(req, (0,)) is None
    router._recv_lock = threading.RLock()  # that thread is gone with the lock: a fresh one
    router.tracer = object()  # type: ignore[assignment]
    assert router.quick(req, (0,)) is None
    router.tracer = None
    router.closed = True
    assert router.quick(req, (0,)) is None
    assert not hasattr(chan, "quick_asked") and req.remaining == 1


def test_ctrl_c_in_the_quick_path_stops_the_workers():
    """A reply may have been read and not yet delivered: as in wait, the owner stops the
    workers (the session closes), never going on out of step."""
    router, chan, _, owner = make(1)
    req = Request(1, 1)
    router.expect(req, (0,))
    chan.quick = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        router.quick(req, (0,))
    assert owner.interrupts == 1
    assert router.recv_lock.acquire(False)  # released


class _AbandonedOnItsLastReply(Request):
    """An await whose wait_for times out just as its last reply is delivered: reading its
    count of 0 abandons it (what the event loop's thread does at that moment)."""

    __slots__ = ("_left", "router")

    def __init__(self, req_id: int, count: int, router: Router) -> None:
        self.router = router
        super().__init__(req_id, count)

    @property  # type: ignore[override]
    def remaining(self) -> int:
        if self._left == 0 and self.done is not None:
            self.router.abandon(self)
        return self._left

    @remaining.setter
    def remaining(self, value: int) -> None:
        self._left = value


def test_an_await_abandoned_as_its_reply_is_delivered_leaves_the_others_whole():
    """The reading thread checked the await's ``done``, the loop's timeout cleared it, and
    the reader then called None: its own blocking run raised TypeError, and the rest of
    the batch it had read was dropped, so one worker's replies were a request behind for
    good. Now ``done`` is read once."""
    router, chan, _, _ = make(1)
    called: list[object] = []
    awaited = _AbandonedOnItsLastReply(1, 1, router)
    awaited.ref_id = 7  # a run's (its call's id)
    awaited.done = called.append
    blocking = Request(2, 1)
    router.expect(awaited, (0,))
    router.expect(blocking, (0,))
    chan.reply(0, 1, OK, "the await's")
    chan.reply(0, 2, OK, "mine")
    router.wait(blocking, time.monotonic() + 5, "testing")
    assert blocking.remaining == 0 and 0 in blocking.replies
    assert called == [None]  # the stale callback: harmless (a cancelled future ignores it)


def test_the_unreported_store_forgets_only_the_ranks_a_get_raised_and_syncs_take_their_own():
    """A get of one worker that raised forgot the call's errors on every worker, so a
    timed-out get's late error there never reached a sync; and a sync raised the earliest
    error held even of a call sent after it began (another thread's), whose own sync then
    returned quietly."""
    errors = UnreportedErrors()
    errors.add(5, 0, error("late on 0"))
    errors.add(5, 1, error("on 1"))
    errors.forget(5, (1,))  # get(worker=1) raised worker 1's
    assert [(r, e[2]) for r, e in errors.pop_earliest((0, 1), 6).items()] == [(0, "late on 0")]
    errors.add(9, 0, error("a later call's"))
    assert errors.pop_earliest((0, 1), 9) is None  # a sync that began before call 9
    assert errors.pop_earliest((0, 1), 10)[0][2] == "a later call's"
