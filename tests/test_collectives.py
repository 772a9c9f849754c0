"""Worker-to-worker collectives: what each one returns, on every rank, for every kind of input
(numpy arrays of any dtype and layout, 0-d arrays, Python numbers, CPU torch tensors, any
picklable object for the moving collectives), inside groups and across pipeline stages, for
data larger than the shared slots and mailboxes, and the errors a misuse gets instead of a
hang. The torch.distributed backend (gloo) is checked on the same basics at the end.

Results are compared with numpy computed on the controller, in rank order:
``functools.reduce(ufunc, [x_0, x_1, ...])``.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import unison
from unison import CollectiveError, WorkerError

UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
OPS = [*UFUNCS, "mean"]
QUICK = 30.0  # a collective that should answer at once: a hang shows up as TimeoutError


def expected_reduce(xs: list[Any], op: str) -> np.ndarray:
    """The documented result: the ufunc folded in rank order; mean is sum / N, in float64
    for integer (and bool) input, as numpy's mean."""
    arrs = [np.asarray(x) for x in xs]
    with np.errstate(all="ignore"):
        if op == "mean":
            if arrs[0].dtype.kind in "biu":
                arrs = [a.astype(np.float64) for a in arrs]
            total = np.asarray(functools.reduce(np.add, arrs))
            return np.asarray(total / len(arrs), dtype=total.dtype)
        return np.asarray(functools.reduce(UFUNCS[op], arrs), dtype=arrs[0].dtype)


def assert_same(got: Any, want: np.ndarray) -> None:
    """Same dtype, shape and bits."""
    assert isinstance(got, np.ndarray), type(got)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.tobytes() == want.tobytes(), (got, want)


def assert_bit_identical(results: list[np.ndarray]) -> None:
    first = results[0]
    for r, got in enumerate(results[1:], 1):
        assert got.dtype == first.dtype and got.shape == first.shape
        assert got.tobytes() == first.tobytes(), f"rank {r} got other bits than rank 0"


def inputs(n: int, shape: tuple[int, ...], dtype: Any, seed: int = 0) -> list[np.ndarray]:
    """One array per rank, of values every dtype holds (and that multiply without trouble)."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return [rng.integers(0, 2, shape).astype(bool) for _ in range(n)]
    if dt.kind in "iu":
        return [rng.integers(0, 5, shape).astype(dt) for _ in range(n)]
    if dt.kind == "c":
        return [(rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
                for _ in range(n)]
    return [rng.standard_normal(shape).astype(dt) for _ in range(n)]


# -- functions the workers run ------------------------------------------------------------------


def do_allreduce(x: Any, op: str = "sum", group: bool = False) -> Any:
    return unison.allreduce(x, op, group=group)


def allreduce_checked(x: np.ndarray, op: str) -> tuple[np.ndarray, bool, bool]:
    """The result, whether the input is unchanged, and whether the result is a new object
    that shares no memory with the input."""
    before = x.copy()
    out = unison.allreduce(x, op)
    unchanged = x.dtype == before.dtype and x.tobytes() == before.tobytes()
    new = out is not x and not np.shares_memory(out, x)
    return out, unchanged, new


def allreduce_of_view(base: np.ndarray, how: str, op: str) -> tuple[np.ndarray, np.ndarray]:
    """Reduce a non-contiguous view made here (a pickled view would arrive contiguous)."""
    x = base[::2] if how == "step" else base.T
    assert not x.flags.c_contiguous
    before = x.copy()
    out = unison.allreduce(x, op)
    assert np.array_equal(x, before)
    return out, before


def big_input(n: int, r: int, dtype: Any) -> np.ndarray:
    """A large array made where it is used (integers in floats: exact sums in any order)."""
    return ((np.arange(n, dtype=np.int64) % 13) + r).astype(dtype)


def big_allreduce(n: int, dtype: str, op: str) -> tuple[str, str, tuple[int, ...], str]:
    out = unison.allreduce(big_input(n, unison.rank(), dtype), op)
    return type(out).__name__, str(out.dtype), out.shape, hashlib.sha256(out.tobytes()).hexdigest()


def big_reduce_scatter(n: int, dtype: str, op: str) -> tuple[str, tuple[int, ...], str]:
    out = unison.reduce_scatter(big_input(n, unison.rank(), dtype), op)
    return str(out.dtype), out.shape, hashlib.sha256(out.tobytes()).hexdigest()


def do_allgather(x: Any, group: bool = False) -> list[Any]:
    return unison.allgather(x, group=group)


def broadcast_from(values: Any, src: int, group: bool = False) -> Any:
    """Only ``src`` (a rank of the scope) passes a value; the others pass None."""
    me = unison.group_rank() if group else unison.rank()
    return unison.broadcast(values if me == src else None, src, group=group)


def scatter_from(xs: list[Any], src: int, group: bool = False) -> Any:
    me = unison.group_rank() if group else unison.rank()
    return unison.scatter(xs if me == src else None, src, group=group)


def do_gather(x: Any, dst: int, group: bool = False) -> list[Any] | None:
    return unison.gather(x, dst, group=group)


def do_reduce_scatter(x: Any, op: str = "sum", group: bool = False) -> Any:
    return unison.reduce_scatter(x, op, group=group)


def barrier_times(late: int, delay: float) -> tuple[float, float]:
    """(when this worker reached the barrier, when it left it); worker ``late`` comes late."""
    if unison.rank() == late:
        time.sleep(delay)
    reached = time.monotonic()
    unison.barrier()
    return reached, time.monotonic()


def group_barrier_times(late: int, delay: float) -> tuple[float, float]:
    if unison.rank() == late:
        time.sleep(delay)
    reached = time.monotonic()
    unison.barrier(group=True)
    return reached, time.monotonic()


def ring_exchange(x: Any) -> Any:
    """Send to the next rank, receive from the previous one (sends return once copied out,
    so every worker can send first)."""
    r, n = unison.rank(), unison.world_size()
    unison.send(x, (r + 1) % n)
    return unison.recv((r - 1) % n)


def send_many(count: int) -> list[Any] | None:
    """Worker 0 sends ``count`` messages in a row to worker 1, which receives them all."""
    if unison.rank() == 0:
        for i in range(count):
            unison.send({"i": i, "data": np.full(i + 1, i)}, 1)
        return None
    if unison.rank() == 1:
        return [unison.recv(0) for _ in range(count)]
    return None


def send_big(nbytes: int) -> str | None:
    """Worker 0 sends ``nbytes`` of array (larger than the mailbox) to worker 1; both
    directions at once with worker 1's reply."""
    a = np.frombuffer(hashlib.shake_128(b"unison").digest(nbytes), np.uint8)
    if unison.rank() == 0:
        unison.send(a, 1)
        back = unison.recv(1)
        return hashlib.sha256(back.tobytes()).hexdigest()
    if unison.rank() == 1:
        got = unison.recv(0)
        assert got.dtype == np.uint8 and got.shape == a.shape
        unison.send(got[::-1].copy(), 0)
        return hashlib.sha256(got.tobytes()).hexdigest()
    return None


def pipeline(start: int) -> dict[str, Any]:
    """Each group adds its number to what the previous group sent, then sends it on."""
    g, stages = unison.group(), unison.world_size() // unison.group_size()
    if g == 0:
        value = {"sum": start, "path": [unison.rank()]}
    else:
        got = unison.recv_from_prev_group()
        value = {"sum": got["sum"] + g, "path": [*got["path"], unison.rank()]}
    if g < stages - 1:
        unison.send_to_next_group(value)
    return value


def send_past_last_group() -> None:
    unison.send_to_next_group(1)


def recv_before_first_group() -> None:
    unison.recv_from_prev_group()


def identity(x: Any) -> Any:
    return x


def call_and_catch(fn: Callable[..., Any], *args: Any) -> tuple[str, str]:
    """Run a collective; return (exception type, message) or ("ok", result repr)."""
    try:
        return "ok", repr(fn(*args))
    except Exception as exc:
        return type(exc).__name__, str(exc)


def rank_shaped(shapes: list[tuple[int, ...]], dtypes: list[str]) -> np.ndarray:
    r = unison.rank()
    return np.ones(shapes[r], dtypes[r])


def mismatched_allreduce(shapes: list[tuple[int, ...]], dtypes: list[str]) -> Any:
    return unison.allreduce(rank_shaped(shapes, dtypes))


def mismatched_reduce_scatter(shapes: list[tuple[int, ...]], dtypes: list[str]) -> Any:
    return unison.reduce_scatter(rank_shaped(shapes, dtypes))


def typed_allreduce(dtypes: list[str], op: str) -> np.ndarray:
    return unison.allreduce(np.arange(1, 4).astype(dtypes[unison.rank()]), op)


def allreduce_into(x: np.ndarray, op: str, how: str) -> tuple[np.ndarray, bool, np.ndarray]:
    """allreduce(x, op, out=...) into an out made ``how``: the result, whether it is that out
    (for "slice": the slice's base holds it), and the result of the same call without out."""
    want_dtype = unison.allreduce(x[:0] if x.ndim else x, op).dtype
    if how == "same":
        out = x.copy()  # into its own input: reduced from a copy, so the next call still has x
        got = unison.allreduce(out, op, out=out)
    elif how == "slice":  # a non-contiguous out: the result lands in every other element
        base = np.zeros((*x.shape, 2), want_dtype)
        out = base[..., 0]
        assert not out.flags.c_contiguous
        got = unison.allreduce(x, op, out=out)
        return got, got is out and np.shares_memory(got, base), unison.allreduce(x, op)
    else:
        out = np.full(x.shape, 7, want_dtype)
        got = unison.allreduce(x, op, out=out)
    return got, got is out, unison.allreduce(x, op)


def allreduce_into_overlap(n: int, shift: int, slot: int) -> list[int]:
    """allreduce(x, out=o) where o is x's buffer ``shift`` elements on (not x itself), for
    an x of more than one slot (shm.SLOT made ``slot`` bytes here): how many elements came
    out wrong, for a shift forward, backward and none (o a new view of x)."""
    from unison.collective import shm

    unison.barrier()  # the call's first collective takes a path that ignores out
    r, size = unison.rank(), unison.world_size()
    want = size * (np.arange(n) % 1000) + sum(range(size))
    kept, shm.SLOT = shm.SLOT, slot
    try:
        wrong = []
        for lo, hi in ((0, shift), (shift, 0), (0, 0)):
            buf = np.zeros(n + shift)
            x = buf[lo : lo + n]
            x[:] = np.arange(n) % 1000 + r
            out = buf[hi : hi + n]
            got = unison.allreduce(x, out=out)
            wrong.append(int((got != want).sum()) + (got is not out))
        return wrong
    finally:
        shm.SLOT = kept


def allreduce_into_wrong(x: np.ndarray, bad: dict[int, str], first: bool) -> Any:
    """Ranks in ``bad`` pass a wrong out (that kind), in the call's first collective or after
    another (which takes the shortest path); every rank then reduces once more, to show the
    peers stayed in step. Returns (error or None, the next result)."""
    if not first:
        unison.allreduce(x)
    kind = bad.get(unison.rank())
    out = {None: None, "shape": np.zeros(x.size + 1, x.dtype),
           "dtype": np.zeros(x.shape, np.float16), "list": [0.0] * x.size,
           "readonly": np.zeros(x.shape, x.dtype)}[kind]
    if kind == "readonly":
        out.flags.writeable = False
    try:
        unison.allreduce(x, out=out)
        error = None
    except ValueError as exc:
        error = str(exc)
    return error, unison.allreduce(x)


def allreduce_number_into(x: float) -> str:
    try:
        unison.allreduce(x, out=np.zeros(()))
    except ValueError as exc:
        return str(exc)
    return "no error"


def allreduce_tensor_into(t: Any) -> tuple[Any, bool]:
    import torch

    out = torch.zeros_like(t)
    got = unison.allreduce(t, out=out)
    return got, got is out


def send_to(dst: int) -> None:
    unison.send("x", dst)


def recv_from(src: int) -> Any:
    return unison.recv(src)


# -- reductions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float32", "int32", "int64", "uint8", "complex128",
                                   "bool"])
def test_allreduce_every_op_matches_numpy_in_rank_order(shared, dtype):
    sess = shared(3)
    xs = inputs(3, (4, 5), dtype, seed=1)
    ref = sess.scatter(xs)
    for op in OPS:
        if op in ("min", "max") and dtype.startswith("complex"):
            continue
        want = expected_reduce(xs, op)
        got = sess.run(do_allreduce, ref, op, timeout=QUICK)
        for r in range(3):
            assert_same(got[r], want)
        if op == "mean":
            assert got[0].dtype == (np.float64 if dtype in ("int32", "int64", "uint8", "bool")
                                    else np.dtype(dtype))


def test_allreduce_is_bit_identical_on_every_rank(shared):
    """Float sums depend on the order; every rank must fold in the same (rank) order."""
    sess = shared(4)
    xs = [np.random.default_rng(r).standard_normal(1000).astype(np.float32) * 10.0 ** r
          for r in range(4)]
    ref = sess.scatter(xs)
    for op in OPS:
        got = sess.run(do_allreduce, ref, op, timeout=QUICK)
        assert_bit_identical(got)
        assert_same(got[0], expected_reduce(xs, op))


def test_allreduce_leaves_its_input_unchanged_and_returns_a_new_array(shared):
    sess = shared(2)
    xs = inputs(2, (3, 7), "float64", seed=2)
    ref = sess.scatter(xs)
    for op in OPS:
        got = sess.run(allreduce_checked, ref, op, timeout=QUICK)
        for out, unchanged, new in got:
            assert unchanged, f"{op}: allreduce changed its input"
            assert new, f"{op}: allreduce returned its input (or a view of it)"
            assert_same(out, expected_reduce(xs, op))
    # large enough for the reduce-scatter path too
    xs = inputs(2, (300, 300), "float64", seed=3)
    got = sess.run(allreduce_checked, sess.scatter(xs), "sum", timeout=QUICK)
    assert all(unchanged and new for _, unchanged, new in got)
    assert_same(got[0][0], expected_reduce(xs, "sum"))


@pytest.mark.parametrize("how", ["step", "transpose"])
def test_allreduce_of_non_contiguous_arrays(shared, how):
    sess = shared(3)
    bases = inputs(3, (6, 5), "float64", seed=4)
    for op in ["sum", "max", "mean"]:
        got = sess.run(allreduce_of_view, sess.scatter(bases), how, op, timeout=QUICK)
        views = [before for _, before in got]
        want = expected_reduce(views, op)
        assert want.shape == ((3, 5) if how == "step" else (5, 6))
        for out, _ in got:
            assert_same(out, want)


def test_allreduce_of_0d_arrays(shared):
    sess = shared(3)
    got = sess.run(do_allreduce, sess.scatter([np.array(1.5), np.array(2.0), np.array(-4.0)]),
                   timeout=QUICK)
    for out in got:
        assert_same(out, np.array(-0.5))
    for op in OPS:
        xs = [np.array(r + 2, np.int32) for r in range(3)]
        for out in sess.run(do_allreduce, sess.scatter(xs), op, timeout=QUICK):
            assert_same(out, expected_reduce(xs, op))


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_allreduce_of_python_numbers(shared, backend):
    """Python numbers give Python numbers, of the same precision (with torch, a float was
    a float32 tensor: 0.1 summed three times came back as 0.30000001192092896)."""
    sess = backend_session(shared, 3, backend)
    for values, op, want in [
        ([1, 2, 3], "sum", 6),
        ([2, -3, 4], "prod", -24),
        ([5, 2, 9], "min", 2),
        ([5, 2, 9], "max", 9),
        ([1.5, 2.5, 3.5], "sum", 7.5),
        ([1.0, 2.0, 6.0], "mean", 3.0),
        ([1 + 2j, 3j, 1 + 0j], "sum", 2 + 5j),
        ([0.1, 0.1, 0.1], "sum", 0.1 + 0.1 + 0.1),
    ]:
        got = sess.run(do_allreduce, sess.scatter(values), op, timeout=QUICK)
        assert got == [want] * 3, (values, op)
        assert all(type(g) is type(want) for g in got), (values, op, [type(g) for g in got])

    # mean of Python ints: a Python float, as numpy's mean of integers is a float64
    got = sess.run(do_allreduce, sess.scatter([1, 2, 4]), "mean", timeout=QUICK)
    assert got == [7 / 3] * 3 and all(type(g) is float for g in got)


def torch_kinds() -> list[Any]:
    """What the torch backend gives for values torch would pick a dtype for."""
    import torch

    out: list[Any] = []
    for x in ([2**62, 1], [True, True], [0.1], (0.1, 1e-50)):
        try:
            unison.allreduce(x)
            out.append("reduced")
        except unison.CollectiveError as exc:
            out.append(str(exc))
    out.append(unison.allreduce(1 + 2j, op="mean"))
    out.append(unison.allreduce(torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64),
                                op="mean").tolist())
    return out


def test_the_torch_backend_refuses_what_torch_would_give_a_dtype_and_keeps_complex(shared):
    """A list or tuple went to torch.as_tensor: floats became float32, ints int64 (wrapping
    past 2**63), bools a logical or, with no error; the mean of a complex number lost its
    imaginary part (a cast to double)."""
    sess = backend_session(shared, 2, "torch")
    got = sess.run(torch_kinds, timeout=QUICK)
    for out in got:
        assert all("numpy arrays or numbers, not" in e for e in out[:4]), out
        assert out[4] == 1 + 2j and out[5] == [1 + 2j, 3 - 1j], out


def numpy_through_every_collective() -> tuple[bool, Any, list[np.ndarray]]:
    """Numpy values through each collective: whether allreduce's out= returned that buffer,
    the allreduce of a numpy scalar, and every array result, in order."""
    r = unison.rank()
    x = np.arange(4.0) + r
    buf = np.empty(4)
    into = unison.allreduce(x, out=buf) is buf
    arrays = [unison.allreduce(x), buf, unison.allreduce(np.arange(3) + r, op="mean"),
              *unison.allgather(x), unison.broadcast(x if r == 1 else None, src=1),
              unison.scatter([np.full(2, 5.0), np.full(2, 6.0)] if r == 0 else None),
              unison.reduce_scatter(x), *(unison.gather(x, dst=0) or [])]
    return into, unison.allreduce(np.float64(r)), arrays


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_numpy_values_come_back_as_numpy_on_either_backend(shared, backend):
    """With collectives="torch" a numpy array came back as a torch.Tensor from allreduce,
    allgather, broadcast and reduce_scatter, and allreduce(x, out=buf) refused a numpy buf
    ("out= must be ... Tensor"). Now numpy in, numpy out, as on shared memory."""
    sess = backend_session(shared, 2, backend)
    x0, x1 = np.arange(4.0), np.arange(4.0) + 1
    total = x0 + x1
    for r, (into, scalar, arrays) in enumerate(sess.run(numpy_through_every_collective,
                                                        timeout=QUICK)):
        assert into and type(scalar) is np.float64 and scalar == 1.0, (into, scalar)
        want = [total, total, np.array([0.5, 1.5, 2.5]), x0, x1, x1, np.full(2, 5.0 + r),
                total[2 * r:2 * r + 2], *([x0, x1] if r == 0 else [])]
        assert len(arrays) == len(want), [type(a) for a in arrays]
        for got, expected in zip(arrays, want):
            assert_same(got, expected)


def torch_broadcast_of_none() -> list[float]:
    import torch

    x = torch.arange(3.0) if unison.rank() == 1 else None
    return unison.broadcast(x, src=1).tolist()


def torch_scatter_of_shapes() -> Any:
    import torch

    xs = [torch.zeros(2), torch.zeros(3)] if unison.rank() == 0 else None
    return unison.scatter(xs, src=0)


def test_torch_broadcast_takes_none_on_the_receivers_and_scatter_says_what_it_cannot(shared):
    """broadcast's receivers may pass None (``sess.broadcast_from`` does): the torch backend
    made a tensor of it and raised on every call. A scatter of values of several shapes
    was refused by gloo on the source alone, the receivers then waiting inside gloo for its
    timeout (300 s); now the source says so at once, and the receivers give up."""
    import torch

    sess = backend_session(shared, 2, "torch")
    assert sess.run(torch_broadcast_of_none, timeout=QUICK) == [[0.0, 1.0, 2.0]] * 2
    ref = sess.broadcast_from(torch.arange(4.0), src=1)
    assert [t.tolist() for t in ref.gather(timeout=QUICK)] == [[0.0, 1.0, 2.0, 3.0]] * 2
    started = time.monotonic()
    with pytest.raises(unison.WorkerError) as info:
        sess.run(torch_scatter_of_shapes, timeout=QUICK)
    assert time.monotonic() - started < 10
    assert "one shape and dtype" in str(info.value.errors[0])
    assert isinstance(info.value.errors[1], unison.CollectiveError)


def group_sum() -> float:
    import torch

    return float(unison.allreduce(torch.ones(1), group=True)[0])


def test_a_fresh_torch_sessions_first_collective_may_be_on_one_group(make_session):
    """torch.distributed's groups were made at the first collective: one on a single
    group's view waited in init_process_group for the other group's workers, who never
    came, until gloo's timeout (300 s). They are made by every worker at the start now."""
    pytest.importorskip("torch.distributed")
    sess = make_session(4, num_groups=2, collectives="torch")
    assert sess.group(1).run(group_sum, timeout=QUICK) == [2.0, 2.0]
    assert sess.run(group_sum, timeout=QUICK) == [2.0] * 4


def reduce_masked(kind: str) -> str:
    x = np.ma.masked_array([1.0, 2.0, 1e9], mask=[False, False, unison.rank() == 0])
    try:
        if kind == "allreduce":
            unison.allreduce(x)
        else:
            unison.reduce_scatter(x)
    except TypeError as exc:
        return str(exc)
    return "reduced"


@pytest.mark.parametrize("backend", ["shm", "torch"])
@pytest.mark.parametrize("kind", ["allreduce", "reduce_scatter"])
def test_a_masked_array_is_refused_by_the_reductions(shared, backend, kind):
    """A masked array was reduced as its raw elements, the masked 1e9 added in, and came
    back a plain array: a wrong result with no error."""
    sess = backend_session(shared, 2, backend)
    got = sess.run(reduce_masked, kind, timeout=QUICK)
    assert all("masked array" in g and "filled" in g for g in got), got


@pytest.mark.parametrize("n_workers", [2, 3])
def test_allreduce_into_an_out_that_overlaps_its_input_at_an_offset(shared, n_workers):
    """An input of more than one slot reduces in rounds, each writing its share of out: an
    out over the input at an offset was read back as a later round's input (wrong elements,
    no error). Now it reduces into a new array, then copies into out, as numpy's ufuncs do."""
    sess = shared(n_workers)
    got = sess.run(allreduce_into_overlap, 10_000, 3, 16384, timeout=QUICK)  # > SMALL too
    assert got == [[0, 0, 0]] * n_workers


def backend_session(shared: Any, n: int, backend: str) -> unison.Session:
    """A shared session of ``n`` workers whose collectives run on ``backend`` ("shm" or
    "torch": torch.distributed's gloo, skipped where torch is not installed)."""
    if backend == "torch":
        pytest.importorskip("torch.distributed")
        return shared(n, collectives="torch")
    return shared(n)


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_allreduce_of_python_ints_is_exact_and_of_bools_counts(shared, backend):
    """Python ints were reduced as int64: a sum or product past 2**63 wrapped, and came back
    as a wrong Python int with no error (2**63 itself became a uint64); bools summed as a
    logical or. Now every op is Python's own, on values of any size, on either backend."""
    sess = backend_session(shared, 3, backend)
    big = [2 ** 62, 2 ** 63, -(10 ** 30)]
    for values, op in [
        (big, "sum"), (big, "prod"), (big, "min"), (big, "max"), (big, "mean"),
        ([2 ** 31] * 3, "prod"), ([-(2 ** 62)] * 3, "sum"),
        ([True, True, False], "sum"), ([True, True, True], "prod"),
        ([True, False, True], "min"), ([False, True, False], "max"),
        ([True, True, False], "mean"),
    ]:
        want = {"sum": sum, "prod": math.prod, "min": min, "max": max,
                "mean": lambda v: sum(v) / len(v)}[op](values)
        got = sess.run(do_allreduce, sess.scatter(values), op, timeout=QUICK)
        assert got == [want] * 3, (values, op, got)
        assert all(type(g) is type(want) for g in got), (values, op, [type(g) for g in got])


def half_means(torch_tensor: bool) -> list[Any]:
    """Means of float16 values whose sum passes float16's largest (65504): numpy's own
    mean sums them in float32."""
    x = np.full(4, 60000, np.float16)
    if torch_tensor:
        import torch

        t = torch.full((4,), 60000.0, dtype=torch.float16)
        return [unison.allreduce(t, "mean").tolist(), str(unison.allreduce(t, "mean").dtype)]
    big = np.full((9_000_000,), 60000, np.float16)  # past a slot (32 MiB) once float32:
    # reduced in rounds
    return [unison.allreduce(x, "mean").tolist(), str(unison.allreduce(x, "mean").dtype),
            unison.reduce_scatter(x, "mean").tolist(),
            bool(np.isfinite(unison.allreduce(big, "mean")).all()),
            unison.allreduce(np.float16(60000), "mean").item()]


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_a_mean_of_float16_sums_in_float32_as_numpys(shared, backend):
    """Summed in float16, two ranks' 60000 made inf, where numpy's mean of the same values
    is 60000 (it sums float16 in float32). The mean now sums in float32 and comes back as
    float16 (a bfloat16 tensor's too, for its precision: its range is float32's)."""
    sess = backend_session(shared, 2, backend)
    got = sess.run(half_means, False, timeout=QUICK)
    want = float(np.mean(np.full(2, 60000, np.float16)))
    assert want == 60000.0
    assert got == [[[want] * 4, "float16", [want] * 2, True, want]] * 2, got
    if backend == "torch":
        got = sess.run(half_means, True, timeout=QUICK)
        assert got == [[[want] * 4, "torch.float16"]] * 2, got


class Big(int):
    """A user's int subclass (as IntEnum and IntFlag are)."""


def allreduce_of_a_subclass(value: int, op: str) -> Any:
    return unison.allreduce(Big(value), op)


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_allreduce_of_an_int_subclass_is_exact_as_python_ints_are(shared, backend):
    """An int subclass missed the ``type(x) is int`` test: the shared-memory backend made an
    int64 array of it, so 3 * 2**62 came back as -2**62 (and 2**120 as 0), with no error;
    the torch backend refused it."""
    sess = backend_session(shared, 3, backend)
    for value, op, want in [(2 ** 62, "sum", 3 * 2 ** 62), (2 ** 40, "prod", 2 ** 120),
                            (7, "max", 7)]:
        got = sess.run(allreduce_of_a_subclass, value, op, timeout=QUICK)
        assert got == [want] * 3 and all(type(g) is int for g in got), (value, op, got)


def moves_python_numbers() -> list[Any]:
    r = unison.rank()
    return [unison.broadcast(1.5 if r == 0 else None, 0), unison.broadcast(True if r else None, 1),
            unison.allgather(7 * r), unison.gather(0.5 * r, 1),
            unison.scatter([1.0, 2.0] if r == 0 else None, 0)]


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_collectives_that_move_python_numbers_give_python_numbers(shared, backend):
    """The torch backend gave tensors back for Python numbers (a broadcast of 1.5 came as
    ``tensor(1.5, dtype=torch.float64)``) where shared memory gives the numbers: code that
    ran on one backend broke on the other."""
    sess = backend_session(shared, 2, backend)
    got = sess.run(moves_python_numbers, timeout=QUICK)
    assert got == [[1.5, True, [0, 7], None, 1.0], [1.5, True, [0, 7], [0.0, 0.5], 2.0]], got
    kinds = [type(v) for v in got[1][:2] + got[1][2] + got[1][3] + [got[1][4]]]
    assert kinds == [float, bool, int, int, float, float, float], kinds


def bool_reductions() -> list[list[int]]:
    x = np.array([True, unison.rank() == 0, False])
    return [unison.allreduce(x, op).view(np.uint8).tolist() for op in ("sum", "prod")]


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_bool_arrays_reduce_as_numpy_does_an_or_and_an_and(shared, backend):
    """gloo adds bools as bytes: the torch backend's sum of [True, True, False] on two
    ranks held 2 in its first byte (a True no other bool has; 0, False, at 256 ranks)."""
    sess = backend_session(shared, 2, backend)
    assert sess.run(bool_reductions, timeout=QUICK) == [[[1, 1, 0], [1, 0, 0]]] * 2


def allreduce_of_strings(rank_values: list[list[str]], kind: str) -> Any:
    x = np.array(rank_values[unison.rank()], dtype=kind)
    return unison.reduce_scatter(x) if len(x) == 4 else unison.allreduce(x)


@pytest.mark.parametrize("kind", ["U", "S"])
def test_a_reduction_of_strings_is_refused_on_every_rank(shared, kind):
    """numpy adds strings by joining them, into a wider dtype; the result, of the input's
    dtype, cut them to the input's width: ["ab", "c"] + ["x", "yz"] gave ["ab", "cy"] on
    every rank, with no error."""
    sess = shared(2)
    for values in ([["ab", "c"], ["x", "yz"]], [["ab", "c", "d", "e"], ["x", "yz", "w", "v"]]):
        with pytest.raises(WorkerError) as info:
            sess.run(allreduce_of_strings, values, kind, timeout=QUICK)
        errors = info.value.errors
        assert sorted(errors) == [0, 1], errors
        assert all("reduces numbers" in str(e) for e in errors.values()), errors
    assert sess.run(do_allreduce, 2, timeout=QUICK) == [4, 4]  # still usable


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_allreduce_of_a_python_int_against_another_kind_raises_on_every_rank(shared, backend):
    sess = backend_session(shared, 2, backend)
    for other in (1.0, np.int64(1), True):
        with pytest.raises(WorkerError) as info:
            sess.run(do_allreduce, sess.scatter([1, other]), timeout=QUICK)
        errors = info.value.errors
        assert sorted(errors) == [0, 1], errors
        assert all(isinstance(e, CollectiveError) for e in errors.values()), errors
    assert sess.run(do_allreduce, 2 ** 63, timeout=QUICK) == [2 ** 64] * 2  # still usable


def test_allreduce_of_cpu_torch_tensors(shared):
    torch = pytest.importorskip("torch")
    sess = shared(2)
    xs = [torch.arange(6, dtype=torch.float32).reshape(2, 3) + r for r in range(2)]
    ints = [torch.tensor([[1, 5], [7, -2]]) * (r + 1) for r in range(2)]
    for x, ops in [(xs, OPS), (ints, OPS)]:
        ref = sess.scatter(x)
        for op in ops:
            got = sess.run(do_allreduce, ref, op, timeout=QUICK)
            want = expected_reduce([t.numpy() for t in x], op)
            for out in got:
                assert isinstance(out, torch.Tensor), type(out)
                assert_same(out.numpy(), want)
    # a non-contiguous tensor
    got = sess.run(do_allreduce, sess.scatter([t.T for t in xs]), timeout=QUICK)
    assert_same(got[0].numpy(), expected_reduce([t.T.numpy() for t in xs], "sum"))


def test_allreduce_of_0d_torch_tensors(shared):
    torch = pytest.importorskip("torch")
    sess = shared(2)  # the session whose workers have torch imported already
    got = sess.run(do_allreduce, sess.scatter([torch.tensor(1.5), torch.tensor(-4.0)]),
                   timeout=QUICK)
    for out in got:
        assert isinstance(out, torch.Tensor) and out.shape == (), out
        assert out.item() == -2.5


@pytest.mark.parametrize("how", ["new", "same", "slice"])
@pytest.mark.parametrize(("dtype", "op", "shape"), [
    ("float32", "sum", (256,)),        # the C steps
    ("float64", "mean", (3, 4)),       # the C steps, then / N
    ("int64", "max", (5,)),
    ("uint8", "sum", (9,)),            # numpy's path
    ("complex128", "prod", (2, 2)),
    ("float64", "sum", (300, 300)),    # past the small path
])
def test_allreduce_into_out_writes_it_and_returns_it(shared, how, dtype, op, shape):
    sess = shared(3)
    xs = inputs(3, shape, dtype, seed=11)
    for got, is_out, plain in sess.run(allreduce_into, sess.scatter(xs), op, how,
                                       timeout=QUICK):
        assert is_out, "allreduce(out=...) did not return (or write into) that out"
        assert_same(got, expected_reduce(xs, op))
        assert got.tobytes() == plain.tobytes(), "out= gave other bits than a new result"


def allreduce_large_into(x: np.ndarray) -> tuple[bool, bool, np.ndarray]:
    """Into a new out and into x itself, past the small path: (each is its out, result)."""
    out = np.empty_like(x)
    got = unison.allreduce(x, out=out)
    same = x.copy()
    again = unison.allreduce(same, out=same)
    return got is out, again is same and np.array_equal(again, got), got


def test_allreduce_into_out_between_two_workers_past_the_small_path(shared):
    sess = shared(2)
    xs = inputs(2, ((1 << 17) + 3,), "float64", seed=12)  # 1 MiB: C steps, not the small ones
    for is_out, same_ok, got in sess.run(allreduce_large_into, sess.scatter(xs),
                                         timeout=QUICK):
        assert is_out and same_ok
        assert_same(got, expected_reduce(xs, "sum"))


@pytest.mark.parametrize("kind", ["shape", "dtype", "list", "readonly"])
def test_allreduce_with_a_wrong_out_raises_and_peers_stay_in_step(shared, kind):
    sess = shared(2)
    x = sess.scatter([np.arange(4, dtype=np.float32) + r for r in range(2)])
    want = np.arange(4, dtype=np.float32) * 2 + 1
    for bad, first in itertools.product(({0: kind}, {0: kind, 1: kind}), (True, False)):
        got = sess.run(allreduce_into_wrong, x, bad, first, timeout=QUICK)
        for r, (error, after) in enumerate(got):
            if r in bad:
                assert error and ("out=" in error or "read-only" in error), error
            else:
                assert error is None
            np.testing.assert_array_equal(after, want)


def test_allreduce_of_a_number_into_an_array_says_to_leave_out_none(shared):
    sess = shared(2)
    for message in sess.run(allreduce_number_into, sess.scatter([1.5, 2.5]), timeout=QUICK):
        assert "leave out=None" in message, message


def test_allreduce_of_torch_tensors_into_out(shared):
    torch = pytest.importorskip("torch")
    sess = shared(2)
    xs = [torch.arange(6, dtype=torch.float32) + r for r in range(2)]
    for got, is_out in sess.run(allreduce_tensor_into, sess.scatter(xs), timeout=QUICK):
        assert is_out and torch.equal(got, xs[0] + xs[1])


@pytest.mark.parametrize(
    ("n", "size", "dtype", "op"),
    [
        (3, (10 << 20) + 1, "float32", "sum"),   # 40 MiB: more than one 32 MiB slot
        (2, (1 << 18) + 3, "int32", "max"),
        (3, (1 << 17) + 5, "float64", "prod"),   # 1 MiB: past the 64 KiB small path
        (3, (1 << 17) + 5, "int16", "mean"),
        (4, (1 << 17) + 2, "float32", "min"),
    ],
)
def test_large_allreduce_takes_the_reduce_scatter_path_and_agrees(shared, n, size,
                                                                  dtype, op):
    sess = shared(n)
    got = sess.run(big_allreduce, size, dtype, op, timeout=QUICK)
    want = expected_reduce([big_input(size, r, dtype) for r in range(n)], op)
    assert len(set(got)) == 1, "ranks disagree"
    kind, dt, shape, digest = got[0]
    assert (kind, dt, shape) == ("ndarray", str(want.dtype), want.shape)
    assert digest == hashlib.sha256(want.tobytes()).hexdigest()


def test_large_random_floats_agree_with_numpy_bit_for_bit(shared):
    sess = shared(3)
    xs = [np.random.default_rng(r).standard_normal(200_003) for r in range(3)]  # 1.6 MB each
    ref = sess.scatter(xs)
    for op in OPS:
        got = sess.run(do_allreduce, ref, op, timeout=QUICK)
        assert_bit_identical(got)
        assert_same(got[0], expected_reduce(xs, op))


# -- reduce_scatter -----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7,), (7, 3), (3, 2, 2), (2, 4), (9, 1)])
def test_reduce_scatter_gives_each_rank_its_share(shared, shape):
    n = 3
    sess = shared(n)
    for dtype in ["float64", "int32"]:
        xs = inputs(n, shape, dtype, seed=5)
        ref = sess.scatter(xs)
        for op in OPS:
            got = sess.run(do_reduce_scatter, ref, op, timeout=QUICK)
            shares = np.array_split(expected_reduce(xs, op), n)
            for r in range(n):
                assert_same(got[r], shares[r])


def test_reduce_scatter_of_large_arrays_and_torch_tensors(shared):
    torch = pytest.importorskip("torch")
    sess = shared(2)
    size = (9 << 20) + 1  # 36 MiB of float32: more than a slot
    got = sess.run(big_reduce_scatter, size, "float32", "sum", timeout=QUICK)
    full = expected_reduce([big_input(size, r, "float32") for r in range(2)], "sum")
    for r, share in enumerate(np.array_split(full, 2)):
        assert got[r] == ("float32", share.shape, hashlib.sha256(share.tobytes()).hexdigest())
    xs = [torch.arange(10, dtype=torch.float64).reshape(5, 2) * (r + 1) for r in range(2)]
    got = sess.run(do_reduce_scatter, sess.scatter(xs), "mean", timeout=QUICK)
    shares = np.array_split(expected_reduce([t.numpy() for t in xs], "mean"), 2)
    for r in range(2):
        assert isinstance(got[r], torch.Tensor)
        assert_same(got[r].numpy(), shares[r])


# -- moving collectives -------------------------------------------------------------------------

OBJECTS = [
    {"a": 1, "b": [1, 2, {"c": "d"}]},
    "a string",
    np.arange(12, dtype=np.int16).reshape(3, 4),
    None,
]


def assert_objects_equal(got: Any, want: Any) -> None:
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray)
        assert_same(got, want)
    else:
        assert got == want


def test_allgather_returns_every_rank_s_object_in_rank_order(shared):
    sess = shared(4)
    got = sess.run(do_allgather, sess.scatter(OBJECTS), timeout=QUICK)
    for lst in got:
        assert isinstance(lst, list) and len(lst) == 4
        for g, w in zip(lst, OBJECTS):
            assert_objects_equal(g, w)
    # plain numbers and arrays too
    arrs = inputs(4, (2, 3), "float32", seed=6)
    got = sess.run(do_allgather, sess.scatter(arrs), timeout=QUICK)
    for lst in got:
        for g, w in zip(lst, arrs):
            assert_same(g, w)


def test_broadcast_from_every_source(shared):
    sess = shared(3)
    for src, value in enumerate([{"k": (1, 2)}, "text", np.linspace(0, 1, 7)]):
        got = sess.run(broadcast_from, value, src, timeout=QUICK)
        for g in got:
            assert_objects_equal(g, value)


def test_broadcast_of_an_object_larger_than_a_slot(shared):
    sess = shared(2)
    got = sess.run(lambda: hashlib.sha256(unison.broadcast(
        np.arange(9 << 20, dtype=np.float32) if unison.rank() == 1 else None, 1
    ).tobytes()).hexdigest(), timeout=QUICK)
    assert got == [hashlib.sha256(np.arange(9 << 20, dtype=np.float32).tobytes()).hexdigest()] * 2


def test_scatter_gives_rank_r_element_r(shared):
    sess = shared(3)
    xs = [{"rank": 0}, "one", np.arange(5.0)]
    for src in range(3):
        got = sess.run(scatter_from, xs, src, timeout=QUICK)
        for g, w in zip(got, xs):
            assert_objects_equal(g, w)


def test_gather_collects_on_dst_only(shared):
    sess = shared(3)
    xs = OBJECTS[:3]
    ref = sess.scatter(xs)
    for dst in range(3):
        got = sess.run(do_gather, ref, dst, timeout=QUICK)
        for r, g in enumerate(got):
            if r == dst:
                assert isinstance(g, list) and len(g) == 3
                for gi, w in zip(g, xs):
                    assert_objects_equal(gi, w)
            else:
                assert g is None


def test_barrier_waits_for_the_last_worker(shared):
    sess = shared(3)
    times = sess.run(barrier_times, 2, 0.2, timeout=QUICK)
    last_arrival = max(reached for reached, _ in times)
    assert times[2][0] == last_arrival
    for _, left in times:
        assert left >= last_arrival, "a worker left the barrier before the last one got there"


# -- point to point -----------------------------------------------------------------------------


def test_send_recv_ring_of_objects(shared):
    sess = shared(3)
    got = sess.run(ring_exchange, sess.scatter(OBJECTS[:3]), timeout=QUICK)
    for r in range(3):
        assert_objects_equal(got[r], OBJECTS[(r - 1) % 3])


def test_several_messages_in_a_row_arrive_in_order(shared):
    sess = shared(3)
    for _ in range(2):  # and again in a new call
        got = sess.run(send_many, 20, timeout=QUICK)
        assert got[0] is None and got[2] is None
        assert [m["i"] for m in got[1]] == list(range(20))
        for i, m in enumerate(got[1]):
            np.testing.assert_array_equal(m["data"], np.full(i + 1, i))


def test_message_larger_than_the_mailbox(shared):
    sess = shared(2)
    nbytes = 20 << 20
    a = np.frombuffer(hashlib.shake_128(b"unison").digest(nbytes), np.uint8)
    got = sess.run(send_big, nbytes, timeout=QUICK)
    assert got[1] == hashlib.sha256(a.tobytes()).hexdigest()
    assert got[0] == hashlib.sha256(a[::-1].tobytes()).hexdigest()


def test_pipeline_between_groups(shared):
    sess = shared(4, num_groups=2)
    got = sess.run(pipeline, 10, timeout=QUICK)
    assert got[0] == {"sum": 10, "path": [0]} and got[1] == {"sum": 10, "path": [1]}
    assert got[2] == {"sum": 11, "path": [0, 2]} and got[3] == {"sum": 11, "path": [1, 3]}

    errs = sess.group(1).run(call_and_catch, send_past_last_group, timeout=QUICK)
    assert all(kind == "ValueError" for kind, _ in errs), errs
    errs = sess.group(0).run(call_and_catch, recv_before_first_group, timeout=QUICK)
    assert all(kind == "ValueError" for kind, _ in errs), errs


def test_pipeline_of_three_stages(shared):
    sess = shared(3, num_groups=3)
    for start in (0, 5):
        got = sess.run(pipeline, start, timeout=QUICK)
        assert got == [{"sum": start, "path": [0]}, {"sum": start + 1, "path": [0, 1]},
                       {"sum": start + 3, "path": [0, 1, 2]}]


# -- groups -------------------------------------------------------------------------------------


def test_group_collectives_stay_inside_the_group(shared):
    sess = shared(4, num_groups=2)
    xs = inputs(4, (3, 2), "float64", seed=7)
    ref = sess.scatter(xs)
    for op in OPS:
        got = sess.run(do_allreduce, ref, op, True, timeout=QUICK)
        for r in range(4):
            g = r // 2
            assert_same(got[r], expected_reduce(xs[2 * g : 2 * g + 2], op))
    got = sess.run(do_allgather, sess.scatter(OBJECTS), True, timeout=QUICK)
    for r in range(4):
        g = r // 2
        assert len(got[r]) == 2
        for gi, w in zip(got[r], OBJECTS[2 * g : 2 * g + 2]):
            assert_objects_equal(gi, w)
    # src / dst are ranks inside the group
    per_rank = [f"value of {r}" for r in range(4)]
    vref = sess.scatter(per_rank)
    for src in (0, 1):
        got = sess.run(broadcast_from, vref, src, True, timeout=QUICK)
        assert got == [per_rank[src]] * 2 + [per_rank[2 + src]] * 2
        got = sess.run(do_gather, vref, src, True, timeout=QUICK)
        for r in range(4):
            if r % 2 == src:
                assert got[r] == per_rank[r // 2 * 2 : r // 2 * 2 + 2]
            else:
                assert got[r] is None
    lists = sess.scatter([[f"g{r // 2}-{i}" for i in range(2)] for r in range(4)])
    got = sess.run(scatter_from, lists, 1, True, timeout=QUICK)
    assert got == ["g0-0", "g0-1", "g1-0", "g1-1"]
    got = sess.run(do_reduce_scatter, sess.scatter(inputs(4, (5,), "int64", seed=8)), "sum",
                   True, timeout=QUICK)
    xs = inputs(4, (5,), "int64", seed=8)
    for r in range(4):
        g = r // 2
        assert_same(got[r], np.array_split(xs[2 * g] + xs[2 * g + 1], 2)[r % 2])
    # a group barrier waits only for its own group
    times = sess.run(group_barrier_times, 3, 0.3, timeout=QUICK)
    assert times[0][1] < times[3][0], "group 0 waited for a worker of group 1"
    assert times[2][1] >= times[3][0]


def test_group_collective_on_a_view_of_that_group(shared):
    """A call on exactly one group may use group collectives (but not world ones)."""
    sess = shared(4, num_groups=2)
    got = sess.group(1).run(do_allreduce, sess.group(1).scatter([10, 20]), "sum", True,
                            timeout=QUICK)
    assert got == [30, 30]
    with pytest.raises(WorkerError) as info:
        sess.group(1).run(do_allreduce, 1, timeout=QUICK)
    assert isinstance(info.value.__cause__, CollectiveError)


# -- misuse: errors, not hangs ------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn",
    [
        lambda: unison.allreduce(np.ones(3)),
        lambda: unison.allgather(1),
        lambda: unison.broadcast(1),
        lambda: unison.barrier(),
        lambda: unison.reduce_scatter(np.ones(4)),
        lambda: unison.gather(1),
        lambda: unison.scatter([1, 2, 3]),
    ],
    ids=["allreduce", "allgather", "broadcast", "barrier", "reduce_scatter", "gather",
         "scatter"],
)
def test_world_collective_in_a_call_on_some_workers_raises(shared, fn):
    sess = shared(3)
    for view in (sess[0:1], sess[1:3]):
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            view.run(fn, timeout=QUICK)
        assert time.monotonic() - start < 5.0
        assert isinstance(info.value.__cause__, CollectiveError), info.value.__cause__
        assert set(info.value.errors) <= set(view.workers)
        assert all(isinstance(e, CollectiveError) for e in info.value.errors.values())
    assert sess.run(do_allreduce, 1, timeout=QUICK) == [3, 3, 3]  # still usable


def test_send_to_a_worker_outside_the_call_raises(shared):
    sess = shared(3)
    with pytest.raises(WorkerError) as info:
        sess[0:2].run(send_to, 2, timeout=QUICK)
    assert isinstance(info.value.__cause__, CollectiveError)
    with pytest.raises(WorkerError) as info:
        sess[0].run(recv_from, 2, timeout=QUICK)
    assert isinstance(info.value.__cause__, CollectiveError)


@pytest.mark.parametrize(
    ("shapes", "dtypes"),
    [
        ([(3,), (4,)], ["float64", "float64"]),
        ([(2, 3), (2, 3)], ["float64", "float32"]),
        ([(4,), (4,)], ["int32", "float32"]),   # same size in bytes, other dtype
        ([(2, 3), (3, 2)], ["float64", "float64"]),  # same size, other shape
        ([(6,), (2, 3)], ["int64", "int64"]),
    ],
    ids=["size", "dtype", "dtype-same-bytes", "shape-transposed", "shape-reshaped"],
)
@pytest.mark.parametrize("fn", [mismatched_allreduce, mismatched_reduce_scatter],
                         ids=["allreduce", "reduce_scatter"])
def test_mismatched_inputs_raise_collective_error(shared, fn, shapes, dtypes):
    sess = shared(2)
    with pytest.raises(WorkerError) as info:
        sess.run(fn, shapes, dtypes, timeout=QUICK)
    assert isinstance(info.value.__cause__, CollectiveError), info.value.__cause__
    msg = str(info.value.__cause__)
    assert "same shape and dtype" in msg, msg  # says what to fix
    assert sorted(info.value.errors) == [0, 1], "every worker must learn of the mismatch"
    assert sess.run(do_allreduce, 2, timeout=QUICK) == [4, 4]  # and the session goes on


def test_mismatched_large_inputs_raise_collective_error(shared):
    sess = shared(2)
    with pytest.raises(WorkerError) as info:
        sess.run(mismatched_allreduce, [(1 << 17,), (1 << 16,)], ["float64"] * 2,
                 timeout=QUICK)
    assert isinstance(info.value.__cause__, CollectiveError)


@pytest.mark.parametrize(
    ("dtypes", "op"),
    [([">f8", "<f8"], "sum"), (["m8[s]", "m8[ms]"], "max"), (["M8[D]", "M8[h]"], "min")],
    ids=["byte-order", "timedelta-unit", "datetime-unit"],
)
def test_dtypes_that_differ_only_in_byte_order_or_unit_are_not_mixed_up(shared, dtypes, op):
    """np.dtype(">f8") != np.dtype("<f8") and m8[s] != m8[ms], though each pair shares a type
    number: a collective must either refuse the mismatch or reduce the values they mean,
    never reinterpret one rank's bytes in another's dtype."""
    sess = shared(2)
    xs = [np.arange(1, 4).astype(dt) for dt in dtypes]
    want = UFUNCS[op](xs[0], xs[1])  # numpy converts between the two
    try:
        got = sess.run(typed_allreduce, dtypes, op, timeout=QUICK)
    except WorkerError as exc:
        assert isinstance(exc.__cause__, CollectiveError), exc.__cause__
        assert sorted(exc.errors) == [0, 1]
        return
    for r, out in enumerate(got):
        np.testing.assert_array_equal(out, want, err_msg=f"rank {r} ({dtypes[r]}) got {out!r}")


def test_reduce_scatter_of_a_0d_array_is_a_value_error(shared):
    sess = shared(2)
    with pytest.raises(WorkerError) as info:
        sess.run(do_reduce_scatter, np.array(1.0), timeout=QUICK)
    assert all(isinstance(e, ValueError) for e in info.value.errors.values())
    assert sorted(info.value.errors) == [0, 1]


@pytest.mark.parametrize("op", ["avg", "SUM", None, np.add])
def test_bad_op_is_a_value_error(shared, op):
    sess = shared(2)
    for fn in (do_allreduce, do_reduce_scatter):
        with pytest.raises(WorkerError) as info:
            sess.run(fn, np.ones(4), op, timeout=QUICK)
        cause = info.value.__cause__
        assert isinstance(cause, ValueError), cause
        assert "sum" in str(cause) and "mean" in str(cause), "the message lists the ops"


def test_rank_out_of_range_is_a_value_error(shared):
    sess = shared(4, num_groups=2)
    cases = [
        (lambda: unison.broadcast(1, 4), "broadcast"),
        (lambda: unison.broadcast(1, -1), "broadcast"),
        (lambda: unison.scatter([1, 2, 3, 4], 4), "scatter"),
        (lambda: unison.gather(1, 7), "gather"),
        (lambda: unison.broadcast(1, 2, group=True), "group broadcast"),
        (lambda: unison.gather(1, 2, group=True), "group gather"),
        (lambda: unison.send(1, 4), "send"),
        (lambda: unison.send(1, unison.rank()), "send to self"),
        (lambda: unison.recv(-1), "recv"),
    ]
    for fn, what in cases:
        with pytest.raises(WorkerError) as info:
            sess.run(fn, timeout=QUICK)
        assert isinstance(info.value.__cause__, ValueError), (what, info.value.__cause__)


def test_scatter_needs_one_value_per_worker(shared):
    sess = shared(2)
    with pytest.raises(WorkerError) as info:
        sess.run(lambda: unison.scatter([1, 2, 3] if unison.rank() == 0 else None),
                 timeout=QUICK)
    assert isinstance(info.value.errors[0], ValueError)


def test_collectives_outside_a_worker_raise_runtime_error():
    for fn in (lambda: unison.allreduce(1), lambda: unison.barrier(), lambda: unison.recv(0)):
        with pytest.raises(RuntimeError, match="inside a function"):
            fn()


# -- the torch.distributed backend (gloo) -------------------------------------------------------


def torch_suite() -> dict[str, Any]:
    """Every collective of the torch backend on this worker's tensors."""
    import torch

    r, n = unison.rank(), unison.world_size()
    x = torch.arange(6, dtype=torch.float64).reshape(3, 2) * (r + 1) + r
    i = torch.tensor([3, -1, 4, 1, 5]) * (r + 2)
    out: dict[str, Any] = {}
    for op in OPS:
        out[f"allreduce-{op}"] = unison.allreduce(x, op)
        out[f"allreduce-int-{op}"] = unison.allreduce(i, op)
    out["allgather"] = unison.allgather(x)
    out["broadcast"] = unison.broadcast(x, src=n - 1)
    out["gather"] = unison.gather(x, dst=n - 1)
    out["scatter"] = unison.scatter([x * 10 + k for k in range(n)] if r == n - 1 else None,
                                    src=n - 1)
    out["reduce_scatter"] = unison.reduce_scatter(x, "sum")
    out["reduce_scatter-mean"] = unison.reduce_scatter(x, "mean")
    out["input"] = x
    return out


def torch_group_suite() -> dict[str, Any]:
    import torch

    r = unison.rank()
    x = torch.full((4,), float(r + 1))
    return {
        "allreduce": unison.allreduce(x, "sum", group=True),
        "allgather": unison.allgather(x, group=True),
        "broadcast": unison.broadcast(x, src=1, group=True),
        "gather": unison.gather(x, dst=0, group=True),
        "reduce_scatter": unison.reduce_scatter(x, "max", group=True),
        "world": unison.allreduce(x, "sum"),
    }


def test_torch_backend_collectives_on_cpu_tensors(shared):
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.distributed")
    n = 4
    sess = shared(4, num_groups=2, collectives="torch")
    got = sess.run(torch_suite, timeout=120)
    xs = [g["input"] for g in got]
    ints = [torch.tensor([3, -1, 4, 1, 5]) * (r + 2) for r in range(n)]
    for r, res in enumerate(got):
        for op in OPS:
            for key, src in ((f"allreduce-{op}", xs), (f"allreduce-int-{op}", ints)):
                out = res[key]
                assert isinstance(out, torch.Tensor), key
                np.testing.assert_allclose(out.numpy(), expected_reduce([t.numpy() for t in src],
                                                                        op), err_msg=key)
                want_dtype = torch.float64 if op == "mean" else src[0].dtype
                assert out.dtype == want_dtype, (key, out.dtype)
        assert all(torch.equal(a, b) for a, b in zip(res["allgather"], xs))
        assert torch.equal(res["broadcast"], xs[n - 1])
        if r == n - 1:
            assert all(torch.equal(a, b) for a, b in zip(res["gather"], xs))
        else:
            assert res["gather"] is None
        assert torch.equal(res["scatter"], xs[n - 1] * 10 + r)
        full = expected_reduce([t.numpy() for t in xs], "sum")
        np.testing.assert_array_equal(res["reduce_scatter"].numpy(), np.array_split(full, n)[r])
        np.testing.assert_allclose(res["reduce_scatter-mean"].numpy(),
                                   np.array_split(full / n, n)[r])
    # inputs unchanged: each worker returned its input after the collectives
    for r, x in enumerate(xs):
        assert torch.equal(x, torch.arange(6, dtype=torch.float64).reshape(3, 2) * (r + 1) + r)


def test_torch_backend_groups(shared):
    torch = pytest.importorskip("torch")
    sess = shared(4, num_groups=2, collectives="torch")
    got = sess.run(torch_group_suite, timeout=120)
    for r, res in enumerate(got):
        g = r // 2
        members = [2 * g + 1.0, 2 * g + 2.0]  # each rank's fill value, r + 1
        assert torch.equal(res["allreduce"], torch.full((4,), sum(members)))
        assert [t[0].item() for t in res["allgather"]] == members
        assert torch.equal(res["broadcast"], torch.full((4,), members[1]))
        if r % 2 == 0:
            assert [t[0].item() for t in res["gather"]] == members
        else:
            assert res["gather"] is None
        assert torch.equal(res["reduce_scatter"], torch.full((2,), members[1]))
        assert torch.equal(res["world"], torch.full((4,), 10.0))


# -- the controller's helpers for Disco's idioms -------------------------------------------------


def test_session_broadcast_from_scatter_from_and_gather_to(shared):
    sess = shared(3)
    value = np.arange(100_000, dtype=np.float64)  # large: the arena path to the source
    ref = sess.broadcast_from(value, src=2)
    for got in ref.gather():
        assert_same(got, value)
    parts = sess.scatter_from([{"rank": r} for r in range(3)], src=1)
    assert parts.gather() == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    gathered = sess.gather_to(parts, dst=2)
    assert gathered.gather() == [None, None, [{"rank": 0}, {"rank": 1}, {"rank": 2}]]
    assert gathered.get(worker=2)[1] == {"rank": 1}


def test_session_helpers_refuse_bad_ranks_and_lengths(shared):
    sess = shared(3)
    with pytest.raises(ValueError):
        sess.broadcast_from(1, src=3)
    with pytest.raises(ValueError):
        sess.scatter_from([1, 2], src=0)


def one_complex_prod(values: list[complex]) -> np.ndarray:
    return unison.allreduce(np.array([values[unison.rank()]], np.complex64), "prod")


def test_a_one_element_complex_product_has_numpys_bits(shared):
    """numpy multiplies a one-element complex array in place with other rounding than out
    of place (here inf where x0 * x1 * x2 is finite); the fold must give numpy's a * b * c."""
    values = [4.548312e16j, 3.2715196e10 - 7.156942e16j, 104535 + 16472j]
    xs = [np.array([v], np.complex64) for v in values]
    with np.errstate(over="ignore"):
        want = xs[0] * xs[1] * xs[2]
    assert np.isfinite(want).all()
    for got in shared(3).run(one_complex_prod, values):
        assert got.tobytes() == want.tobytes(), (got, want)


def rank_sum(i: int) -> Any:
    return unison.allreduce(i * 10 + unison.rank())


def rank_list(i: int) -> Any:
    return unison.allgather((i, unison.rank()))


def rank_broadcast(i: int) -> Any:
    return unison.broadcast((i, unison.rank()), src=i % unison.world_size())


def rank_barrier(i: int) -> int:
    unison.barrier()
    return i


def test_collectives_of_calls_queued_back_to_back(shared):
    """Calls queued without waiting: a worker that finished a collective runs the next call's
    at once, while its peers may still be in the last phase of this one. That is a peer that
    passed, not one that left: every call gives its own right answer."""
    sess = shared(3)
    want = {rank_sum: lambda i: [30 * i + 3] * 3,
            rank_list: lambda i: [[(i, 0), (i, 1), (i, 2)]] * 3,
            rank_broadcast: lambda i: [(i, i % 3)] * 3,
            rank_barrier: lambda i: [i] * 3}
    refs = [(fn, i, sess.call(fn, i)) for i in range(60) for fn in want]
    for fn, i, ref in refs:
        assert ref.gather(timeout=QUICK) == want[fn](i), (fn.__name__, i)
