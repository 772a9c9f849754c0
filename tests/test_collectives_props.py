"""Property tests of the shared-memory collectives: for random shapes (0 to 3 dimensions),
dtypes, ops, numbers of workers (1 to 4) and groups (every divisor), every rank's result
equals numpy's, computed on the controller from the same per-rank inputs.

Starting a session is slow next to one collective, so there is one session per
(workers, groups) configuration for the whole module; hypothesis draws the data and the
configuration, the inputs go to the workers with ``sess.scatter``, and a module-level
function runs the collective on each worker's own input (a Ref argument becomes the worker's
own object).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import unison

CONFIGS = [(1, 1), (2, 1), (2, 2), (3, 1), (3, 3), (4, 1), (4, 2), (4, 4)]
UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
OPS = [*UFUNCS, "mean"]
DTYPES = ["int8", "int32", "int64", "uint16", "float32", "float64", "complex64", "bool"]
TIMEOUT = 30.0  # per call: a hang fails as TimeoutError instead of stalling the run

# one settings for every property: the leak check (a function-scoped autouse fixture) runs
# once per test, not per example, which is what it is meant to do
PROPS = settings(max_examples=35, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow])


# -- one session per configuration, for the whole module ---------------------------------------


# -- what numpy says --------------------------------------------------------------------------


def members(n: int, groups: int, rank: int, group: bool) -> list[int]:
    """The ranks a collective of ``rank`` combines, in order."""
    if not group:
        return list(range(n))
    size = n // groups
    first = rank // size * size
    return list(range(first, first + size))


def expected_reduce(xs: list[np.ndarray], op: str) -> np.ndarray:
    """The ufunc folded in rank order; mean = sum / N, in float64 for integer (and bool)
    input as numpy's mean."""
    with np.errstate(all="ignore"):
        if op == "mean":
            if xs[0].dtype.kind in "biu":
                xs = [x.astype(np.float64) for x in xs]
            total = np.asarray(functools.reduce(np.add, xs))
            return np.asarray(total / len(xs), dtype=total.dtype)
        return np.asarray(functools.reduce(UFUNCS[op], xs), dtype=xs[0].dtype)


def assert_same(got: Any, want: np.ndarray, what: str) -> None:
    assert isinstance(got, np.ndarray), f"{what}: got a {type(got).__name__}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, want {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    if got.tobytes() != want.tobytes():
        # bits differ: the values must still match (NaN as NaN, 0.0 as -0.0 apart)
        np.testing.assert_array_equal(got, want, err_msg=what)
        raise AssertionError(f"{what}: equal values but other bits: {got!r} vs {want!r}")


# -- functions the workers run ------------------------------------------------------------------


def reduce_checked(x: Any, kind: str, op: str, group: bool) -> tuple[Any, bool]:
    """The collective's result, and whether the input was left unchanged."""
    before = x.copy()
    if kind == "allreduce":
        out = unison.allreduce(x, op, group=group)
    else:
        out = unison.reduce_scatter(x, op, group=group)
    unchanged = x.dtype == before.dtype and x.tobytes() == before.tobytes()
    assert out is not x
    return out, unchanged


def reduce_number(x: Any, op: str, group: bool) -> Any:
    return unison.allreduce(x, op, group=group)


def move(mine: dict[str, Any], kind: str, root: int, group: bool) -> Any:
    if kind == "allgather":
        return unison.allgather(mine["x"], group=group)
    if kind == "broadcast":
        return unison.broadcast(mine["x"], root, group=group)
    if kind == "gather":
        return unison.gather(mine["x"], root, group=group)
    return unison.scatter(mine["scatter"], root, group=group)


def exchange(steps: list[tuple[str, int, Any]]) -> list[Any]:
    """Run this worker's part of a message schedule, in order: ("send", dst, obj) or
    ("recv", src, None). Every worker follows the same global order, so nothing deadlocks
    even though a send waits while the pair's mailbox still holds an earlier message."""
    got = []
    for what, peer, obj in steps:
        if what == "send":
            unison.send(obj, peer)
        else:
            got.append(unison.recv(peer))
    return got


# -- strategies ---------------------------------------------------------------------------------

shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
split_shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=5)


@st.composite
def dtype_and_op(draw: st.DrawFn) -> tuple[np.dtype[Any], str]:
    op = draw(st.sampled_from(OPS))
    allowed = [d for d in DTYPES if not (op in ("min", "max") and d.startswith("complex"))]
    return np.dtype(draw(st.sampled_from(allowed))), op


def elements(dtype: np.dtype[Any]) -> st.SearchStrategy[Any]:
    if dtype.kind in "fc":
        return hnp.from_dtype(dtype, allow_nan=False, allow_infinity=False)
    return hnp.from_dtype(dtype)


@st.composite
def config_and_group(draw: st.DrawFn) -> tuple[int, int, bool]:
    n, groups = draw(st.sampled_from(CONFIGS))
    return n, groups, draw(st.booleans()) if groups > 1 else False


leaves = (st.none() | st.booleans() | st.integers() | st.text(max_size=6)
          | st.binary(max_size=12) | st.floats(allow_nan=False))
objects = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                max_size=3),
    max_leaves=6,
)
small_arrays = hnp.arrays(st.sampled_from(["int16", "float64", "complex64", "bool"]),
                          hnp.array_shapes(min_dims=0, max_dims=2, max_side=4))


def same_object(got: Any, want: Any) -> bool:
    if isinstance(want, np.ndarray):
        return (isinstance(got, np.ndarray) and got.dtype == want.dtype
                and got.shape == want.shape and got.tobytes() == want.tobytes())
    return type(got) is type(want) and got == want


# -- properties ---------------------------------------------------------------------------------


@PROPS
@given(cfg=config_and_group(), dt_op=dtype_and_op(), shape=shapes, data=st.data())
def test_allreduce_matches_numpy(shared, cfg, dt_op, shape, data):
    n, groups, group = cfg
    dtype, op = dt_op
    xs = [data.draw(hnp.arrays(dtype, shape, elements=elements(dtype)), label=f"x{r}")
          for r in range(n)]
    sess = shared(n, groups)
    got = sess.run(reduce_checked, sess.scatter(xs), "allreduce", op, group, timeout=TIMEOUT)
    for r, (out, unchanged) in enumerate(got):
        scope = members(n, groups, r, group)
        want = expected_reduce([xs[j] for j in scope], op)
        assert_same(out, want, f"rank {r}, {op} over {scope}")
        assert unchanged, f"rank {r}: allreduce changed its input"
        assert out.tobytes() == got[scope[0]][0].tobytes(), "members got other bits"


@PROPS
@given(cfg=config_and_group(), dt_op=dtype_and_op(), shape=split_shapes, data=st.data())
def test_reduce_scatter_matches_numpy(shared, cfg, dt_op, shape, data):
    n, groups, group = cfg
    dtype, op = dt_op
    xs = [data.draw(hnp.arrays(dtype, shape, elements=elements(dtype)), label=f"x{r}")
          for r in range(n)]
    sess = shared(n, groups)
    got = sess.run(reduce_checked, sess.scatter(xs), "reduce_scatter", op, group,
                   timeout=TIMEOUT)
    for r, (out, unchanged) in enumerate(got):
        scope = members(n, groups, r, group)
        share = np.array_split(expected_reduce([xs[j] for j in scope], op), len(scope))
        assert_same(out, share[scope.index(r)], f"rank {r}, {op} share over {scope}")
        assert unchanged, f"rank {r}: reduce_scatter changed its input"


@PROPS
@given(cfg=config_and_group(), op=st.sampled_from(OPS), data=st.data())
def test_allreduce_of_python_numbers_is_a_python_number(shared, cfg, op, data):
    n, groups, group = cfg
    kind = data.draw(st.sampled_from([int, float]), label="kind")
    if kind is int:
        xs = data.draw(st.lists(st.integers(-1000, 1000), min_size=n, max_size=n), label="xs")
    else:
        xs = data.draw(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=n,
                                max_size=n), label="xs")
    sess = shared(n, groups)
    got = sess.run(reduce_number, sess.scatter(xs), op, group, timeout=TIMEOUT)
    for r, out in enumerate(got):
        scope = members(n, groups, r, group)
        want = expected_reduce([np.asarray(xs[j]) for j in scope], op)[()].item()
        assert type(out) is type(want), (r, type(out), type(want))
        assert out == want, (r, out, want)


@PROPS
@given(cfg=config_and_group(), kind=st.sampled_from(["allgather", "broadcast", "gather",
                                                     "scatter"]), data=st.data())
def test_moving_collectives_deliver_objects(shared, cfg, kind, data):
    n, groups, group = cfg
    size = n // groups if group else n
    root = data.draw(st.integers(0, size - 1), label="root")
    values = objects | small_arrays
    xs = data.draw(st.lists(values, min_size=n, max_size=n), label="xs")
    lists = data.draw(st.lists(st.lists(values, min_size=size, max_size=size), min_size=n,
                               max_size=n), label="scatter lists")
    sess = shared(n, groups)
    mine = [{"x": xs[r], "scatter": lists[r] if (r % size if group else r) == root else None}
            for r in range(n)]
    got = sess.run(move, sess.scatter(mine), kind, root, group, timeout=TIMEOUT)
    for r, out in enumerate(got):
        scope = members(n, groups, r, group)
        src = scope[root]
        if kind == "allgather" or (kind == "gather" and r == src):
            assert isinstance(out, list) and len(out) == len(scope), (r, out)
            assert all(same_object(o, xs[j]) for o, j in zip(out, scope)), (r, out)
        elif kind == "gather":
            assert out is None, (r, out)
        elif kind == "broadcast":
            assert same_object(out, xs[src]), (r, out, xs[src])
        else:
            assert same_object(out, lists[src][scope.index(r)]), (r, out)


@PROPS
@given(cfg=st.sampled_from([c for c in CONFIGS if c[0] > 1]), data=st.data())
def test_send_recv_deliver_every_message_in_order(shared, cfg, data):
    n, groups = cfg
    # ((src, dst), object) messages; every worker sends and receives its own in this order
    pairs = [(s, d) for s in range(n) for d in range(n) if s != d]
    msgs = data.draw(st.lists(st.tuples(st.sampled_from(pairs), objects | small_arrays),
                              max_size=8), label="messages")
    plans: list[list[tuple[str, int, Any]]] = [[] for _ in range(n)]
    for (src, dst), obj in msgs:
        plans[src].append(("send", dst, obj))
        plans[dst].append(("recv", src, None))
    sess = shared(n, groups)
    got = sess.run(exchange, sess.scatter(plans), timeout=TIMEOUT)
    for r in range(n):
        want = [obj for (_, d), obj in msgs if d == r]
        assert len(got[r]) == len(want)
        assert all(same_object(g, w) for g, w in zip(got[r], want)), (r, got[r], want)
