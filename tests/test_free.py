"""Dropping a Ref, or ref.free(), frees the workers' objects: the frees ride on the next
message (no round trip of their own), freeing twice is harmless, and nothing accumulates."""

from __future__ import annotations

import gc
import sys
import time

import pytest

import unison
from unison.refs import Ref
from unison.worker import object_count


def count(sess):
    """How many objects each worker holds (the call that asks holds none yet)."""
    return sess.run(object_count)


def boom():
    raise ValueError("no value")


def test_a_dropped_ref_is_freed_on_every_worker(sess):
    baseline = count(sess)
    ref = sess.put("payload")
    assert count(sess) == [b + 1 for b in baseline]
    del ref
    gc.collect()
    assert count(sess) == baseline


def test_free_frees_at_once(sess):
    baseline = count(sess)
    ref = sess.call(lambda: bytearray(1000))
    assert count(sess) == [b + 1 for b in baseline]
    ref.free()
    assert count(sess) == baseline
    assert "freed" in repr(ref)


def test_freeing_twice_is_harmless(sess):
    baseline = count(sess)
    ref = sess.scatter([1, 2])
    ref.free()
    ref.free()
    del ref
    gc.collect()
    assert count(sess) == baseline
    assert sess.run(unison.rank) == [0, 1]


def test_refs_of_a_view_are_freed_on_its_workers(make_session):
    sess = make_session(3)
    baseline = count(sess)
    ref = sess[1].put("only on 1")
    assert count(sess) == [baseline[0], baseline[1] + 1, baseline[2]]
    del ref
    assert count(sess) == baseline


def nothing():
    return None


def test_refs_dropped_before_calls_to_a_view_are_freed_on_every_worker(make_session):
    sess = make_session(2)
    baseline = count(sess)
    refs = [sess.put(i) for i in range(10)]
    sess[0].call(nothing)  # the function is defined and cached: the next calls go the quick way
    del refs
    gc.collect()
    for _ in range(5):
        sess[0].call(nothing)  # to worker 0 only, with frees that worker 1 needs as well
    sess.sync()
    assert count(sess) == baseline


def test_a_thousand_refs_created_and_dropped_leave_nothing_behind(sess):
    baseline = count(sess)
    refs = [sess.put(i) for i in range(1000)]
    assert count(sess) == [b + 1000 for b in baseline]
    del refs
    gc.collect()
    assert count(sess) == baseline
    for i in range(1000):
        sess.call(lambda x: x + 1, i)  # each Ref dropped at once
    assert count(sess) == baseline


def test_run_leaves_nothing_behind(sess):
    baseline = count(sess)
    for i in range(100):
        sess.run(lambda x: x, i)
    assert count(sess) == baseline


def test_a_ref_dropped_while_its_call_still_runs_is_freed_after_it(sess):
    baseline = count(sess)
    ref = sess.call(time.sleep, 0.3)
    del ref
    assert count(sess) == baseline


def test_the_ref_of_a_failed_call_is_freed_too(sess):
    baseline = count(sess)
    ref = sess.call(boom)
    with pytest.raises(unison.WorkerError):
        ref.gather()
    del ref
    assert count(sess) == baseline
    assert sess.sync() is None


def test_a_ref_that_timed_out_and_was_dropped_is_freed(sess):
    baseline = count(sess)
    ref = sess.call(time.sleep, 0.4)
    with pytest.raises(TimeoutError):
        ref.gather(timeout=0.05)
    del ref
    assert count(sess) == baseline


def test_dropping_refs_never_waits_for_a_busy_worker(sess):
    # Frees ride on the next message: dropping a Ref sends nothing and waits for nothing,
    # even while the workers are busy with a long call.
    baseline = count(sess)
    sess.call(time.sleep, 1.0)
    refs = [sess.put(i) for i in range(100)]
    start = time.monotonic()
    del refs  # a list of Refs: each is freed here, by its count
    took = time.monotonic() - start
    gc.collect()  # not timed: a full collection of a big test process takes its own time
    assert took < 0.5
    assert count(sess) == baseline


def test_a_scatter_refused_at_a_later_rank_leaves_nothing_on_the_earlier_ones(make_session):
    """A scatter sends one message a worker: when a later rank's value was refused (another
    session's ``sess.empty`` array), the earlier ranks kept theirs, with no Ref to free
    them. Now the scatter's id is freed on every worker with the next message."""
    np = pytest.importorskip("numpy")
    foreign = make_session(1).empty(4)
    sess = make_session(3)
    baseline = count(sess)
    for _ in range(2):
        with pytest.raises(ValueError, match="another session"):
            sess.scatter([np.ones(1 << 14), b"small", foreign])
    assert count(sess) == baseline


@pytest.mark.parametrize("channel", ["shm"])
def test_refs_dropped_before_a_send_the_full_arena_refused_are_still_freed(
        make_session, monkeypatch):
    """A send refused for a full arena (MemoryError: nothing was sent) dropped the frees it
    carried, so those Refs stayed on the workers for good. Now they ride on the next
    message, as after a deadline or a refused buffer."""
    np = pytest.importorskip("numpy")
    from unison.channel import arena

    monkeypatch.setattr(arena, "default_size", lambda: 4 << 20)  # a 4 MiB arena
    sess = make_session(2)
    baseline = count(sess)
    pin = sess.empty(3 << 20, np.uint8)  # the whole arena, untouched
    ref = sess.put("payload")
    assert count(sess) == [b + 1 for b in baseline]
    del ref
    gc.collect()  # its free waits for the next message
    with pytest.raises(MemoryError, match="shared memory is full"):
        sess.put(np.ones(1 << 17))  # 1 MiB: out of band, through the arena
    assert count(sess) == baseline
    del pin


def _ctrl_c_at_opcode(code, k):
    """A trace function that raises KeyboardInterrupt (what a Ctrl-C does, between any two
    bytecodes) at the ``k``-th opcode run in ``code``, once; ``fired`` says whether it did."""
    seen, fired = [0], [False]

    def local(frame, event, arg):
        if event == "opcode" and not fired[0]:
            if seen[0] == k:
                fired[0] = True
                raise KeyboardInterrupt
            seen[0] += 1
        return local

    def tracer(frame, event, arg):
        if frame.f_code is code:
            frame.f_trace_opcodes = True
            return local
        return None

    return tracer, fired


def test_ctrl_c_at_any_point_of_free_never_leaks_the_workers_object(sess):
    """Ref.free (and __del__) marked the Ref freed before it queued its id: a Ctrl-C between
    the two left the Ref freed and the workers holding its object for the session's life."""
    baseline = count(sess)
    old = sys.gettrace()
    for k in range(100):
        ref = sess.put(k)
        tracer, fired = _ctrl_c_at_opcode(Ref.free.__code__, k)
        sys.settrace(tracer)
        try:
            ref.free()
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(old)
        del ref  # freed now, where the Ctrl-C came before anything was done
        gc.collect()
        assert count(sess) == baseline, f"Ctrl-C at opcode {k} of Ref.free"
        if not fired[0]:  # past the end of free: every point was tried
            break
    else:
        pytest.fail("Ref.free ran more than 100 opcodes: raise the bound")
