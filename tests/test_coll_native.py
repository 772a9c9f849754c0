"""A small allreduce's C steps (src/unison/_coll.c, issue 9): README's install builds them,
they are chosen automatically, and they stand in for the numpy path exactly: the same bits
(signed zeros, infinities, NaNs and integer wrap-around included), the same records in
shared memory (workers with and without them meet in one collective), and the same errors
when a wait they give up on goes on in Python."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import numpy as np
import pytest

import unison
from unison import _native
from unison.collective import shm

C_HERE = shm._coll is not None
C_HERE_WHY = ("UNISON_PURE is set" if _native.pure_asked() and _native.built("_coll")
              else "the C steps are not built here, or are stale")
"""For the cases that run the C steps in this process (the others start workers with their
own UNISON_PURE, and ask only _native.built)."""

UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
N = 3
SPECIAL = [0.0, -0.0, 1.5, -2.25, np.inf, -np.inf, np.nan, 3e38, -3e38, 1e-45, 7.0]


def inputs(dtype: str, rank: int) -> np.ndarray:
    """Rank ``rank``'s input: for floats, every pair of special values meets across ranks;
    for integers, values that overflow when summed or multiplied."""
    if dtype.startswith("float"):
        vals = np.array(SPECIAL, dtype)
        pairs = np.roll(np.repeat(vals, len(SPECIAL)), rank * (len(SPECIAL) + 1))
        rounding = np.random.default_rng(rank).standard_normal(64) * 10.0 ** rank
        return np.concatenate([pairs, rounding.astype(dtype)])
    info = np.iinfo(dtype)
    vals = np.array([info.max, info.min, info.max // 3, -7 % (int(info.max) + 1), 1, 0, 12345],
                    dtype)
    return np.roll(np.tile(vals, 5), rank * 3)


def every_case() -> list[tuple[str, str]]:
    return sorted({(op, np.dtype(d).name) for op, d in shm._C_CODES})


def reduce_all(cases: list[tuple[str, str]]) -> tuple[bool, list[bytes]]:
    """This worker's allreduce of its input for every case, as bytes; and whether it ran the
    C steps."""
    r = unison.rank()
    with np.errstate(all="ignore"):
        return shm._coll is not None, [unison.allreduce(inputs(d, r), op).tobytes()
                                       for op, d in cases]


def expected(op: str, dtype: str) -> bytes:
    xs = [inputs(dtype, r) for r in range(N)]
    with np.errstate(all="ignore"):
        if op == "mean":
            return (functools.reduce(np.add, xs) / N).astype(dtype).tobytes()
        return functools.reduce(UFUNCS[op], xs).tobytes()


def test_the_extension_is_built_and_chosen() -> None:
    if _native.pure_asked():
        pytest.skip("UNISON_PURE is set: the pure-Python path was asked for")
    import unison._coll  # noqa: F401  (README's install command builds it)

    assert shm._coll is not None


@pytest.mark.parametrize("pure", [(), (0,), (0, 1, 2)], ids=["native", "mixed", "pure"])
def test_same_bits_as_numpy_with_or_without_c(pure: tuple[int, ...]) -> None:
    if _native.pure_asked() and len(pure) < N:
        pytest.skip("UNISON_PURE is set: no C steps to compare")
    cases = every_case()
    env = {r: {"UNISON_PURE": "1" if r in pure else ""} for r in range(N)}
    with unison.Session(N, env=env) as sess:
        got = sess.run(reduce_all, cases, timeout=60)
    assert [native for native, _ in got] == [r not in pure for r in range(N)]
    for i, (op, dtype) in enumerate(cases):
        want = expected(op, dtype)
        for r, (_, outs) in enumerate(got):
            assert outs[i] == want, f"rank {r}: allreduce({op!r}) of {dtype} differs from numpy"


def slow_waits(rounds: int, crowded: bool) -> tuple[list[float], int]:
    """allreduces whose waits outlast the C steps' spin: a peer sleeps past it in turn, or
    (``crowded``) the C steps may not spin at all, so waits go on in Python; and how many
    did."""
    r = unison.rank()
    coll = unison.collective._shm
    assert coll is not None
    waits = 0
    python_await = coll._await

    def counted(*args: Any) -> None:
        nonlocal waits
        waits += 1
        python_await(*args)

    coll._await = counted  # type: ignore[method-assign]
    if crowded:
        unison.pacing.crowd.until = time.perf_counter() + 3600
    try:
        out = []
        for k in range(rounds):
            if k % N == r:
                time.sleep(0.002)
            out.append(float(unison.allreduce(np.array([k + r], np.float64))[0]))
        return out, waits
    finally:
        unison.pacing.crowd.until = 0.0
        del coll._await


@pytest.mark.parametrize("crowded", [False, True], ids=["peer-sleeps", "no-spin"])
def test_waits_the_c_steps_give_up_go_on_in_python(crowded: bool) -> None:
    with unison.Session(N) as sess:
        got = sess.run(slow_waits, 150, crowded, timeout=60)
    want = [float(N * k + sum(range(N))) for k in range(150)]
    assert [out for out, _ in got] == [want] * N
    assert all(waits >= 100 for _, waits in got), got  # the sleeper's peers, at least


def mismatched(kind: str) -> Any:
    r = unison.rank()
    if kind == "shape":
        return unison.allreduce(np.ones(4 + (r == 1), np.float32))
    if kind == "dtype":
        return unison.allreduce(np.ones(4, np.float32 if r != 1 else np.float64))
    return unison.allreduce(np.ones(4, np.float32), "sum" if r != 1 else "prod")


@pytest.mark.parametrize("kind", ["shape", "dtype", "op"])
def test_a_mismatch_raises_on_every_rank(kind: str) -> None:
    with unison.Session(N) as sess:
        with pytest.raises(unison.WorkerError) as info:
            sess.run(mismatched, kind, timeout=30)
        errors = info.value.errors
        assert sorted(errors) == list(range(N))
        assert all(isinstance(e, unison.CollectiveError) for e in errors.values()), errors
        assert sess.run(lambda: unison.allreduce(np.ones(2, np.float32)).tolist(),
                        timeout=30) == [[3.0, 3.0]] * N  # still usable


@pytest.mark.skipif(not C_HERE, reason=C_HERE_WHY)
def test_end_in_c_says_the_call_is_left_and_tidies_only_what_is_held() -> None:
    """Reducer.end, the worker loop's end after every call: the left word peers read, and
    the Python ``_tidy`` only while spills or pidfds are held (the same as shm.py's end)."""
    fd, _ = shm.create("unison-test-end", 2, 1)
    try:
        coll = shm.ShmCollectives(fd, 1, 2, 1)
    finally:
        os.close(fd)
    tidied: list[int] = []
    coll._tidy = lambda: tidied.append(1)  # type: ignore[method-assign]
    assert coll.end == coll._c.end  # the loop's end is the C one
    coll.end(41)
    assert coll._q[coll._left] == 41 and not tidied
    coll._spills[0] = None  # type: ignore[assignment]  # held: any entry
    coll.end(42)
    assert coll._q[coll._left] == 42 and tidied == [1]
    coll._spills.clear()
    coll._pidfds[0] = (0, -1)
    coll.end(43)
    assert coll._q[coll._left] == 43 and tidied == [1, 1]
    coll._pidfds.clear()
    with pytest.raises(OverflowError):
        coll.end(-1)
    reducer, q, left, held = coll._c, coll._q, coll._left, coll._spills
    held[0] = None  # type: ignore[assignment]
    del coll  # the owner gone: its end still says so, and tidies nothing
    reducer.end(44)
    assert q[left] == 44 and tidied == [1, 1]


def steps_of_a_worker(coll: shm.ShmCollectives) -> list[Any]:
    """A lone worker's collectives over three calls, and its generation bookkeeping (what
    _next keeps: ``_index`` and ``_owe``) after each."""
    x, seen = np.arange(6.0), []

    def note(result: Any) -> None:
        seen.append((None if result is None else np.asarray(result).tolist(),
                     list(coll._index), list(coll._owe)))

    coll.begin(7, None)
    note(coll.barrier())  # owed in this call: the C steps go on after it
    note(coll.allreduce(x, "sum", False))
    note(coll.allreduce(np.arange(12.0)[::2], "sum", False))  # not contiguous: copied
    note(coll.allreduce(x, "mean", True))
    note(coll.barrier(True))
    coll.end(7)
    coll.begin(8, None)
    note(coll.allreduce(x, "prod", False))  # the last call's barrier settled first
    note(coll.allreduce(x.astype(np.int32), "max", True, out=np.empty(6, np.int32)))
    coll.end(8)
    coll.begin(9, (0,))  # a call some workers run: no per-shape plan
    note(coll.allreduce(x, "sum", False))
    coll._owe[0] = (9, coll._owe[0] or 0, (0,), True)  # as a failed collective leaves it
    with pytest.raises(unison.CollectiveError, match="an earlier collective of this call"):
        coll.allreduce(x, "sum", False)
    note(None)
    return seen


def lone_worker(name: str, pure: bool) -> shm.ShmCollectives:
    """The collectives of a session of one worker, in this process; ``pure``: without the
    C steps."""
    fd, _ = shm.create(name, 1, 1)
    try:
        coll = shm.ShmCollectives(fd, 0, 1, 1)
    finally:
        os.close(fd)
    if pure:
        coll._c = None
    return coll


@pytest.mark.skipif(not C_HERE, reason=C_HERE_WHY)
def test_the_c_steps_take_each_generation_as_next_does() -> None:
    """Reducer.small takes a small allreduce's generation itself: the same bookkeeping as
    Python's _next, step by step, where something of this call or an earlier one is owed,
    for an input it must copy, in either scope, and where an earlier collective failed."""
    runs = [steps_of_a_worker(lone_worker("unison-test-small", pure)) for pure in (False, True)]
    assert runs[0] == runs[1]
    assert runs[0][1] == ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [2, 0], [None, None])
    assert runs[0][5][1:] == ([1, 0], [None, None])


def test_a_peers_pid_word_that_changes_to_an_ended_process_closes_its_pidfd_once():
    """``_gone`` keeps a pidfd per peer's pid word. Where the word changed to a pid that had
    ended already, it closed the old pidfd but kept it in its table, and the call's end
    closed that number again: by then another file's."""
    import subprocess
    import sys

    fd, _ = shm.create("unison-test-gone", 2, 1)
    coll = shm.ShmCollectives(fd, 0, 2, 1, watch_peers=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    other = None
    try:
        coll._q[coll._w[1] + shm._PID] = live.pid
        assert coll._gone(1) is False
        ended = subprocess.Popen(["true"])
        ended.wait()
        coll._q[coll._w[1] + shm._PID] = ended.pid
        assert coll._gone(1) is True
        other = os.pipe()  # another file takes the number closed just now
        coll.close()
        for each in other:
            os.fstat(each)  # still open (EBADF before)
    finally:
        live.kill()
        live.wait()
        for each in other or ():
            os.close(each)
        os.close(fd)


MAX_INDEX, MAX_CALL = 1 << 24, 1 << 38  # collectives per call and scope; call ids below


def near_the_index_limit(kind: str) -> tuple[bool, list[Any]]:
    """As if this call had run all but 3 of the collectives a call may run in a scope, then
    allreduces of values that change every step (rank 1 a little late, so a fast rank may
    meet a stale record): whether the C steps ran, and each result or the error that ends
    them."""
    r, n = unison.rank(), unison.world_size()
    coll = unison.collective._shm
    assert coll is not None
    unison.barrier()  # the backends learn of the call
    unison.barrier(group=True)
    coll._index[0] = coll._index[1] = MAX_INDEX - 3
    got: list[Any] = []
    for i in range(6):
        if r == 1:
            time.sleep(0.002)
        try:
            if kind == "barrier":
                unison.barrier()
                got.append(None)
            else:
                x = np.array([1000.0 * i + r + 1])
                res = unison.allreduce(x, group=kind == "group")
                got.append(float(res[0]) - sum(1000.0 * i + k + 1 for k in range(n)))
        except unison.CollectiveError as exc:
            got.append(str(exc))
            break
    return coll._c is not None, got


@pytest.mark.parametrize("kind", ["allreduce", "group", "barrier"])
@pytest.mark.parametrize("pure", [False, True], ids=["native", "pure"])
def test_a_call_past_its_collectives_per_scope_raises_instead_of_mixing_them(
        kind: str, pure: bool) -> None:
    """The generation word holds 2**24 collectives per call and scope. Past 2**22 the index
    spilled into the call id: a fast rank counted a stale peer as arrived and reduced its
    previous data (no error), or saw a bogus "left the call". Now the last ones run right
    and the next raises on every rank, before it publishes anything."""
    if pure is False and not _native.built("_coll"):
        pytest.skip("the C steps are not built here, or are stale")
    env = {r: {"UNISON_PURE": "1" if pure else ""} for r in range(2)}
    with unison.Session(2, env=env) as sess:
        for _ in range(2):  # an odd call id and an even one: they failed differently
            got = sess.run(near_the_index_limit, kind, timeout=30)
            ok = None if kind == "barrier" else 0.0
            assert [native for native, _ in got] == [not pure] * 2
            for _, each in got:
                assert each[:3] == [ok] * 3, got
                assert len(each) == 4 and "at most 16,777,216 collectives" in each[3], got
        assert sess.run(lambda: unison.allreduce(np.ones(2)).tolist(),
                        timeout=30) == [[2.0, 2.0]] * 2  # the next call starts again


@pytest.mark.parametrize("pure", [False, True], ids=["native", "pure"])
def test_a_call_id_past_the_generation_word_raises(pure: bool) -> None:
    """Call ids take the word's top 38 bits: the last one still runs collectives, a later
    one raises (nothing published) rather than wrapping onto call 0's generations."""
    if pure is False and not C_HERE:
        pytest.skip(C_HERE_WHY)
    coll = lone_worker("unison-test-call-limit", pure)
    x = np.arange(4.0)
    coll.begin(MAX_CALL - 1, None)
    assert coll.allreduce(x, "sum", False).tolist() == x.tolist()
    coll.barrier(True)
    coll.end(MAX_CALL - 1)
    coll.begin(MAX_CALL, None)
    for run in (lambda: coll.allreduce(x, "sum", False), lambda: coll.barrier()):
        with pytest.raises(unison.CollectiveError, match="open a new Session"):
            run()
    assert coll._index == [0, 0]
