"""The way back: results through each worker's reply arena (shared memory, copied once),
valid for as long as the controller holds them whatever the worker does next, and
failures while pickling or unpickling a result that say so instead of killing anything."""

from __future__ import annotations

import gc
import os
import pickle
from typing import Any

import numpy as np
import pytest

import unison
from support import open_fds
from unison import WorkerError
from unison.channel import shm

MIB = 1 << 20


def _full(nbytes: int, value: float) -> np.ndarray:
    return np.full(nbytes // 8, value + unison.rank())


def _overwrite(x: np.ndarray, value: float) -> None:
    x[:] = value


def _mapping_of(arr: np.ndarray) -> str:
    """The /proc/self/maps path of the mapping that holds ``arr``'s memory."""
    addr = arr.__array_interface__["data"][0]
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *rest = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return rest[-1].strip() if len(rest) == 5 else ""
    return ""


def _reply_pages(sess: unison.Session) -> list[int]:
    """Bytes of backed pages in each worker's reply arena."""
    return [os.fstat(fd).st_blocks * 512 for fd in sess._chan._reply_fds]  # type: ignore[attr-defined]


def test_64_mib_from_two_workers_round_trips_through_the_reply_arenas(
    sess: unison.Session,
) -> None:
    ref = sess.call(_full, 64 * MIB, 1.0)
    out = ref.gather()
    assert [o.nbytes for o in out] == [64 * MIB] * 2
    assert bool((out[0] == 1.0).all()) and bool((out[1] == 2.0).all())
    # the arrays lie on the pages the workers wrote, not on a copy of a pickle
    names = [_mapping_of(o) for o in out]
    assert "reply0" in names[0] and "reply1" in names[1], names
    assert all(o.flags.writeable for o in out)


def test_a_result_stays_valid_after_the_worker_overwrites_and_frees_its_copy(
    sess: unison.Session,
) -> None:
    ref = sess.call(_full, 4 * MIB, 5.0)
    got = ref.get(worker=1)
    sess.run(_overwrite, ref, -1.0)  # the worker changes its array in place
    assert sess.run(lambda x: float(x[0]), ref) == [-1.0, -1.0]
    ref.free()
    for i in range(20):  # later fetches of the same size, with room to reuse blocks
        other = sess.call(_full, 4 * MIB, float(i)).gather()
        assert float(other[0][0]) == float(i)
        del other
        gc.collect()
    assert bool((got == 6.0).all())


def test_changing_a_fetched_array_does_not_change_the_workers_copy(sess: unison.Session) -> None:
    ref = sess.call(_full, 2 * MIB, 0.0)
    first = ref.get()
    first[:] = 42.0
    again = ref.get()
    assert float(again[0]) == 0.0 and float(first[0]) == 42.0


def test_blocks_come_back_once_the_results_are_dropped(sess: unison.Session) -> None:
    ref = sess.call(_full, 8 * MIB, 1.0)
    for _ in range(4):
        ref.gather()
    before = _reply_pages(sess)
    for _ in range(30):
        ref.gather()
    after = _reply_pages(sess)
    # steady state: the same few blocks are reused, nothing piles up
    assert all(a <= b + 16 * MIB for a, b in zip(after, before)), (before, after)


def test_a_large_in_band_pickle_goes_through_the_arena_and_back(sess: unison.Session) -> None:
    n = 3 * shm.REPLY_RING + 12345
    out = sess.run(lambda: list(range(n // 8)))
    assert out[0] == out[1] == list(range(n // 8))


class _Unloadable:
    """Pickles fine on the worker, and cannot be rebuilt on the controller."""

    def __init__(self) -> None:
        self.data = np.ones(MIB // 8)

    def __reduce__(self) -> Any:
        return (_refuse, (self.data,))


def _refuse(data: np.ndarray) -> None:
    if unison.worker._identity:  # on the worker: fine
        return None
    raise ValueError("refused on the controller")


def test_a_value_that_cannot_be_unpickled_is_a_clear_error_and_leaks_no_block(
    sess: unison.Session,
) -> None:
    ref = sess.call(_Unloadable)
    for _ in range(3):
        with pytest.raises(WorkerError, match="cannot be unpickled on the controller") as got:
            ref.get(worker=0)
        assert isinstance(got.value.errors[0], TypeError)
    with pytest.raises(WorkerError, match="cannot be unpickled") as got:
        ref.gather()
    assert sorted(got.value.errors) == [0, 1]  # each rank's, as for errors the ranks raise
    del got
    gc.collect()
    before = _reply_pages(sess)
    for _ in range(20):
        with pytest.raises(WorkerError, match="cannot be unpickled"):
            ref.gather()
        gc.collect()  # the error's traceback holds the reply until its frames are collected
    assert all(a <= b + 2 * MIB for a, b in zip(_reply_pages(sess), before))
    assert sess.run(unison.rank) == [0, 1]


def test_held_results_do_not_hold_a_file_descriptor_each(sess: unison.Session) -> None:
    ref = sess.call(_full, 128 << 10, 1.0)
    ref.gather()
    before = len(open_fds())
    held = [ref.gather() for _ in range(200)]
    assert len(open_fds()) < before + 10
    assert all(float(h[1][0]) == 2.0 for h in held)


class _RaisesWhenPickled:
    def __init__(self, exc: type[BaseException]) -> None:
        self.exc = exc

    def __reduce__(self) -> Any:
        raise self.exc("from __reduce__")


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_a_base_exception_while_pickling_a_result_is_a_worker_error(
    sess: unison.Session, exc: type[BaseException]
) -> None:
    pids = sess.run(os.getpid)
    ref = sess.call(_RaisesWhenPickled, exc)
    with pytest.raises(WorkerError, match=exc.__name__):
        ref.gather()
    assert sess.run(os.getpid) == pids  # no worker died
    assert sess.run(lambda: 7) == [7, 7]


def test_the_pipe_channel_fetches_large_results_too(make_session: Any) -> None:
    s = make_session(2, channel="pipe")
    out = s.call(_full, 8 * MIB, 1.0).gather()
    assert [float(o[-1]) for o in out] == [1.0, 2.0]
    assert all(o.flags.writeable for o in out)


def test_pickle_of_a_fetched_array_is_an_ordinary_array(sess: unison.Session) -> None:
    got = sess.call(_full, MIB, 3.0).get()
    back = pickle.loads(pickle.dumps(got))
    assert float(back[0]) == 3.0 and back.nbytes == MIB
