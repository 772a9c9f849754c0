"""``sync`` and ``run`` take the floor system's shape (issue 9): ``run`` is one message each
way, and on the shm channel ``sync`` sends nothing, waiting on the workers' published done
positions (on the pipe channel, the reports in their reply streams), yet still reports
every error exactly once and never returns early."""

from __future__ import annotations

import time

import pytest

import unison
from support import boom, check_sync_reads_progress

pytestmark = pytest.mark.channels


@pytest.mark.parametrize("channel", ["shm"], indirect=True)
def test_run_is_one_message_and_sync_none_on_shm(make_session):
    sess = make_session(2)
    sess.run(int)
    chan = sess._chan
    before = chan.mark()
    sess.sync()
    assert chan.mark() == before  # nothing was sent
    sess.run(int)
    one = chan.mark() - before
    sess.run(int)
    assert chan.mark() - before == 2 * one  # one entry per run, no GET behind it


@pytest.mark.parametrize("channel", ["shm"], indirect=True)
@pytest.mark.parametrize("awaited", [False, True], ids=["sync", "sync_async"])
def test_sync_after_a_quick_call_sends_nothing_on_shm(make_session, awaited):
    """The workers' done positions say all ran: neither sync nor ``await sync_async``
    sends SYNC (the await did, each time, before the thirty-fourth pass of issue 9)."""
    check_sync_reads_progress(make_session(2), None, awaited)


@pytest.mark.parametrize("channel", ["pipe"], indirect=True)
@pytest.mark.parametrize("awaited", [False, True], ids=["sync", "sync_async"])
def test_sync_after_a_quick_call_sends_nothing_on_pipe(make_session, awaited):
    """The pipe channel's workers report what they ran before they wait, so a sync after
    a quick call reads that report instead of sending SYNC; one that finds an error held
    asks, and reports it."""
    sess = make_session(2)
    check_sync_reads_progress(sess, lambda: list(sess._chan._sent), awaited)


def test_sync_waits_for_everything_sent(sess):
    ref = sess.call(time.sleep, 0.3)
    start = time.monotonic()
    sess.sync()
    assert time.monotonic() - start >= 0.25
    del ref


def test_sync_of_one_worker_skips_what_others_run(sess):
    busy = sess[0].call(time.sleep, 3)
    start = time.monotonic()
    sess[1].sync(timeout=2)  # worker 1 skips worker 0's call: done at once
    assert time.monotonic() - start < 1.5
    with pytest.raises(TimeoutError, match="worker"):
        sess[0].sync(timeout=0.2)
    del busy


def test_errors_reach_sync_once_and_run_reports_its_own(sess):
    sess.call(boom)
    with pytest.raises(unison.WorkerError) as info:
        sess.sync()
    assert isinstance(info.value.__cause__, ValueError)
    sess.sync()  # reported once: nothing left
    with pytest.raises(unison.WorkerError):
        sess.run(boom)
    sess.sync()  # run's error went back with its reply, never into the unreported list


def test_a_failed_call_fetched_by_get_is_not_reported_again(sess):
    ref = sess.call(boom)
    with pytest.raises(unison.WorkerError):
        ref.gather()
    sess.sync()


def test_an_error_behind_a_timed_out_wait_reaches_the_next_sync(sess):
    ref = sess.call(lambda: (time.sleep(0.4), 1 / 0))
    with pytest.raises(TimeoutError):
        ref.gather(timeout=0.05)  # abandoned: its late ERR replies are salvaged
    with pytest.raises(unison.WorkerError) as info:
        sess.sync()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    sess.sync()


def test_run_that_times_out_keeps_its_error_for_sync(sess):
    with pytest.raises(TimeoutError):
        sess.run(lambda: (time.sleep(0.4), 1 / 0), timeout=0.05)
    with pytest.raises(unison.WorkerError):
        sess.sync()
    assert sess.run(unison.rank) == [0, 1]


def test_threads_syncing_at_once_all_return(sess):
    import threading

    sess.call(time.sleep, 0.2)
    done: list[float] = []

    def sync() -> None:
        sess.sync(timeout=10)
        done.append(time.monotonic())

    threads = [threading.Thread(target=sync) for _ in range(4)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(done) == 4
    assert max(done) - start < 2.0  # one sleeps on the eventfd, the others nap: none is lost


def test_a_sync_never_waits_for_a_sleeping_worker_that_was_sent_nothing(sess):
    """A send wakes only the workers it is for: a worker asleep through a view's calls
    stayed short of the ring's position until its sleep ended (up to a second), so a sync
    of the session stalled, and ``sync(timeout=0.5)`` of it, or of a view of that worker
    alone, raised TimeoutError for a worker sent nothing (an audit, issue 9, forty-eighth
    pass, on the shm channel). A sync now wakes such a worker, which steps past them."""
    for whom in (sess, sess[1:2], sess, sess[1:2]):
        sess.sync()
        time.sleep(0.2)  # both workers asleep
        assert sess[0:1].run(unison.rank) == [0]
        whom.sync(timeout=0.5)


@pytest.mark.parametrize("channel", ["shm"])  # (the ring: a pipe worker is sent nothing)
def test_a_sync_with_no_time_counts_a_worker_asleep_through_others_calls_as_done(sess):
    """``sync(timeout=0)`` right after a view's calls, the other worker still asleep short
    of the ring's position: it returns, since nothing sent to that worker is left to run
    (the channel reads the commands between it and the position). Before (issue 9,
    forty-ninth pass), it raised TimeoutError naming the worker that was sent nothing;
    the first version of the fix still did where the sync's wake had that worker stepping
    past them (its done position is published once it runs out: CI, a slow host). A
    worker that has a command left is still not done."""
    # Defined on every worker first: a view's first call of a function sends its DEFINE to
    # all of them, and a worker asleep until that send woke it may still be running it at
    # the sync below (rightly not done: a CI run on a slow host, the fiftieth pass)
    assert sess.run(unison.rank) == [0, 1]
    for _ in range(5):
        sess.sync()
        time.sleep(0.2)  # both workers asleep
        assert sess[0:1].run(unison.rank) == [0]
        sess[0:1].sync()  # worker 0 back in its loop (it replies before that)
        sess.sync(timeout=0)
        sess[1:2].sync(timeout=0)
    sess.sync()
    slow = sess[1:2].call(time.sleep, 0.5)
    sess[0:1].call(unison.rank)
    with pytest.raises(TimeoutError, match=r"worker\(s\) \[(0, )?1\]"):
        sess.sync(timeout=0)
    slow.get()
