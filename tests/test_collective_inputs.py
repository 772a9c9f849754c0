"""Bad input to the in-worker collectives (issue 9, forty-seventh pass: an audit of bad
input): a TypeError or ValueError that says what was wrong, the same on either backend,
never a wrong value on a peer, nor an error from deep inside (an IndexError, a KeyError,
torch's RuntimeError)."""

from __future__ import annotations

import errno
import socket
from typing import Any

import numpy as np
import pytest

import unison

QUICK = 60.0


def backend_session(shared: Any, backend: str) -> unison.Session:
    """A shared session of 2 workers on ``backend`` ("torch": gloo, where torch is)."""
    if backend == "torch":
        pytest.importorskip("torch.distributed")
        return shared(2, collectives="torch")
    return shared(2)


def outcome(fn: Any) -> tuple[str, Any]:
    """("ok", the result) or (the exception's class name, its message)."""
    try:
        return "ok", fn()
    except Exception as e:  # (the torch backend's TypeError is a CollectiveError too)
        return ("TypeError" if isinstance(e, TypeError) else type(e).__name__), str(e)


def scatter_from_0(make: Any, torch: bool) -> tuple[str, Any]:
    def values() -> Any:
        if not torch:
            return make()
        import torch as t

        return make(t.tensor)
    return outcome(lambda: unison.scatter(values() if unison.rank() == 0 else None, src=0))


BAD = {
    "dict": lambda T=int: {0: T(10), 1: T(20)},
    "dict of str keys": lambda T=int: {"a": T(10), "b": T(20)},
    "set": lambda T=int: {T(10), T(20)},
    "frozenset": lambda T=int: frozenset({T(10), T(20)}),
    "str": lambda T=int: "ab",
    "bytes": lambda T=int: b"ab",
}


@pytest.mark.parametrize("backend", ["shm", "torch"])
@pytest.mark.parametrize("bad", list(BAD))
def test_scatter_refuses_a_dict_set_or_str_before_a_peer_gets_anything(shared, backend, bad):
    """A dict sent its keys (worker 1 got 1, not the value; on torch the source too), one of
    str keys raised KeyError on the source after worker 1 had its value, a set went in no
    order. Now the source raises TypeError before any value leaves it."""
    sess = backend_session(shared, backend)
    make = BAD[bad]
    got = sess.run(scatter_from_0, make, backend == "torch", timeout=QUICK)
    assert got[0][0] == "TypeError", got
    assert "one per worker in rank order" in got[0][1]
    assert got[1][0] == "CollectiveError", got  # never a value
    assert sess.run(scatter_from_0, lambda T=int: [T(1), T(2)], backend == "torch",
                    timeout=QUICK) == [("ok", 1), ("ok", 2)]  # still usable


def scatter_iterable(kind: str) -> Any:
    if unison.rank() != 0:
        return unison.scatter(None)
    if kind == "ndarray":
        return unison.scatter(np.array([[1, 2], [3, 4]]))
    if kind == "tensor":
        import torch

        return unison.scatter(torch.tensor([[1, 2], [3, 4]]))
    if kind == "generator":
        return unison.scatter(np.array([i, i + 1]) for i in (1, 3))
    return unison.scatter((np.array([1, 2]), np.array([3, 4])))


@pytest.mark.parametrize("backend", ["shm", "torch"])
@pytest.mark.parametrize("kind", ["ndarray", "tensor", "generator", "tuple"])
def test_scatter_takes_an_array_a_tensor_or_a_generator(shared, backend, kind):
    """``xs or ()`` took an array's truth value (ValueError: ambiguous), a tensor's
    (RuntimeError), a generator's len (TypeError). Now each worker gets its row."""
    if kind == "tensor":
        pytest.importorskip("torch")
    sess = backend_session(shared, backend)
    got = sess.run(scatter_iterable, kind, timeout=QUICK)
    assert [np.asarray(g).tolist() for g in got] == [[1, 2], [3, 4]]


GROUP_CALLS = {
    "allreduce array": lambda g: unison.allreduce(np.ones(2), group=g),
    "allreduce int": lambda g: unison.allreduce(1, group=g),
    "allgather": lambda g: unison.allgather(0, group=g),
    "broadcast": lambda g: unison.broadcast(0, group=g),
    "barrier": lambda g: unison.barrier(group=g),
    "scatter": lambda g: unison.scatter([1, 2], group=g),
    "gather": lambda g: unison.gather(0, group=g),
    "reduce_scatter": lambda g: unison.reduce_scatter(np.ones(2), group=g),
}


def every_group_call(group: Any) -> dict[str, tuple[str, Any]]:
    return {name: outcome(lambda call=call: call(group)) for name, call in GROUP_CALLS.items()}


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_a_group_that_is_not_a_bool_is_a_type_error(shared, backend):
    """group=2 raised IndexError (an array's allreduce) or KeyError (the others), None a
    TypeError about tuple indices, 1.0 worked in allgather and failed in allreduce."""
    sess = backend_session(shared, backend)
    for group in (2, "yes", None, 1.0, 1, 0, np.True_):
        got = sess.run(every_group_call, group, timeout=QUICK)
        for rank_got in got:
            for name, (kind, text) in rank_got.items():
                assert kind == "TypeError", (group, name, kind, text)
                assert "group must be True" in text and repr(group) in text
    assert sess.run(every_group_call, False, timeout=QUICK)[0]["allreduce int"] == ("ok", 2)


def torch_misuse(which: str) -> tuple[str, Any]:
    import torch

    calls = {
        "reduce_scatter 0-d tensor": lambda: unison.reduce_scatter(torch.tensor(1.0)),
        "reduce_scatter 0-d array": lambda: unison.reduce_scatter(np.array(1.0)),
        "allreduce list": lambda: unison.allreduce([1, 2]),
        "allreduce object array": lambda: unison.allreduce(np.array([1, None])),
    }
    return outcome(calls[which])


@pytest.mark.parametrize("backend", ["shm", "torch"])
@pytest.mark.parametrize(("which", "error"), [
    ("reduce_scatter 0-d tensor", "ValueError"),
    ("reduce_scatter 0-d array", "ValueError"),
    ("allreduce list", "TypeError"),
    ("allreduce object array", "TypeError"),
])
def test_bad_reduction_input_raises_the_same_error_on_either_backend(shared, backend, which,
                                                                     error):
    """The torch backend raised torch's RuntimeError (tensor_split of a 0-d tensor) or a
    CollectiveError (a list) where the shared-memory backend raised ValueError/TypeError."""
    pytest.importorskip("torch")
    sess = backend_session(shared, backend)
    got = sess.run(torch_misuse, which, timeout=QUICK)
    assert [g[0] for g in got] == [error, error], got


def torch_allgather_str() -> tuple[str, Any]:
    return outcome(lambda: unison.allgather("x"))


def test_the_torch_backend_refuses_a_non_tensor_with_a_type_error(shared):
    sess = backend_session(shared, "torch")
    got = sess.run(torch_allgather_str, timeout=QUICK)
    assert [g[0] for g in got] == ["TypeError", "TypeError"], got


def narrow_inputs(dtype: str) -> list[np.ndarray]:
    """Rank 0's and rank 1's input: their sum wraps (as numpy's does), their product too."""
    top = int(np.iinfo(dtype).max)
    return [np.array([top - 5, 7, 3], dtype), np.array([6000, 9, 5], dtype)]


def reduce_narrow(dtype: str, op: str, as_tensor: bool) -> Any:
    x = narrow_inputs(dtype)[unison.rank()]
    if as_tensor:
        import torch

        return unison.allreduce(torch.from_numpy(x), op).numpy()
    return unison.allreduce(x, op), unison.reduce_scatter(x, op)


@pytest.mark.parametrize("backend", ["shm", "torch"])
@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64", "int16"])
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "mean"])
def test_dtypes_gloo_cannot_reduce_reduce_as_numpy_does(shared, backend, dtype, op):
    """gloo has no uint16, uint32, uint64 or int16: the torch backend raised its RuntimeError
    "Invalid scalar type" where the shared-memory one reduced them. Now both give numpy's
    result to the bit, wrapping as numpy wraps (a sum past the dtype's top)."""
    sess = backend_session(shared, backend)
    a, b = narrow_inputs(dtype)
    with np.errstate(all="ignore"):
        if op == "mean":
            want = (a.astype(np.float64) + b) / 2
        else:
            want = {"sum": np.add, "prod": np.multiply, "min": np.minimum,
                    "max": np.maximum}[op](a, b)
    got = sess.run(reduce_narrow, dtype, op, False, timeout=QUICK)
    for r, (full, share) in enumerate(got):
        assert full.dtype == want.dtype and full.tobytes() == want.tobytes(), (full, want)
        part = np.array_split(want, 2)[r]
        assert share.dtype == part.dtype and share.tobytes() == part.tobytes(), (share, part)
    if backend == "torch":
        got = sess.run(reduce_narrow, dtype, op, True, timeout=QUICK)
        assert all(g.tobytes() == want.tobytes() for g in got)


def test_check_scatter_values_lists_an_iterable_once_and_refuses_unordered_ones():
    from unison.collective import checks

    assert checks.check_scatter_values((i for i in "ab"), 2) == ["a", "b"]
    assert checks.check_scatter_values(np.arange(2), 2) == [0, 1]
    for bad in ({0: 1, 1: 2}, {1, 2}, frozenset({1, 2}), "ab", b"ab", bytearray(b"ab")):
        with pytest.raises(TypeError, match="one per worker in rank order"):
            checks.check_scatter_values(bad, 2)
    with pytest.raises(TypeError, match="one per worker in rank order, got int"):
        checks.check_scatter_values(5, 2)


def _moves(dtype: str, tensors: bool) -> list[Any]:
    """Rank r's allgather, broadcast from 1, gather to 0 and scatter from 0 of arrays of
    ``dtype`` (0-d, 1-d, 2-d), as numpy arrays (from tensors where ``tensors``)."""
    import torch

    r = unison.rank()

    def value(shape: tuple[int, ...], k: int) -> Any:
        a = (np.arange(int(np.prod(shape)), dtype=dtype) * (r + 1) + k).reshape(shape)
        return torch.from_numpy(a) if tensors else a

    def plain(v: Any) -> Any:
        return [plain(x) for x in v] if isinstance(v, list) else (
            None if v is None else np.asarray(v.numpy() if tensors else v))

    out = []
    for k, shape in enumerate([(), (5,), (2, 3)]):
        out.append(plain(unison.allgather(value(shape, k))))
        out.append(plain(unison.broadcast(value(shape, k) if r == 1 else None, src=1)))
        out.append(plain(unison.gather(value(shape, k), dst=0)))
        xs = [value(shape, k + q) for q in range(unison.world_size())] if r == 0 else None
        out.append(plain(unison.scatter(xs, src=0)))
    return out


@pytest.mark.parametrize("backend", ["shm", "torch"])
@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64", "int16", "complex64"])
def test_dtypes_gloo_cannot_move_move_as_shared_memory_does(shared, backend, dtype):
    """The torch backend's allgather, broadcast, gather and scatter of int16, uint16/32/64
    (and gather of complex) raised gloo's RuntimeError "Invalid scalar type"; shared memory
    moved them. They now go as their bytes, and come back as the dtype and shape sent."""
    pytest.importorskip("torch")
    sess = backend_session(shared, backend)
    for tensors in (False, True):
        got = sess.run(_moves, dtype, tensors, timeout=QUICK)
        want = [[np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape) * (q + 1) + k
                 for q in range(2)] for k, shape in enumerate([(), (5,), (2, 3)])]
        for r in range(2):
            for k in range(3):
                every, from_1, at_0, mine = got[r][4 * k: 4 * k + 4]
                for a, b in zip(every, want[k]):
                    assert a.dtype == dtype and a.shape == b.shape and (a == b).all()
                assert from_1.dtype == dtype and (from_1 == want[k][1]).all()
                if r == 0:
                    assert all((a == b).all() for a, b in zip(at_0, want[k]))
                else:
                    assert at_0 is None
                expect = want[k][0] - k + k + r  # the source's value(shape, k + r)
                assert mine.dtype == dtype and (mine == expect).all(), (r, k, mine, expect)


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_a_non_tensor_error_reaches_the_controller_as_each_ranks_type_error(shared, backend):
    """The torch backend's TypeError (a CollectiveError too) skipped CollectiveError's init,
    so it had no ``.peer``: the controller's WorkerError raised AttributeError instead, and
    a sync lost the errors (a review of the forty-seventh pass)."""
    sess = backend_session(shared, backend)
    with pytest.raises(unison.WorkerError) as info:
        sess.run(lambda: unison.allreduce([1.0, 2.0]), timeout=QUICK)
    assert sorted(info.value.errors) == [0, 1]
    assert all(isinstance(e, TypeError) for e in info.value.errors.values())
    sess.call(lambda: unison.allreduce([1.0, 2.0]))
    with pytest.raises(unison.WorkerError):
        sess.sync(timeout=QUICK)
    assert sess.sync(timeout=QUICK) is None


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_a_0d_narrow_integer_reduces_to_a_0d_result(shared, backend):
    """The torch backend's reduction of the dtypes gloo lacks gave a 0-d input back as shape
    (1,): numpy's ascontiguousarray makes a 0-d array 1-d (a review of the forty-seventh
    pass). A numpy scalar still comes back as a scalar, as on shared memory."""
    sess = backend_session(shared, backend)

    def zero_d():
        r = unison.rank()
        return [np.shape(unison.allreduce(v)) for v in (
            np.array(r + 1, np.uint16), np.int16(r + 1))]

    assert sess.run(zero_d, timeout=QUICK) == [[(), ()]] * 2


def test_a_local_sessions_torch_store_listens_only_on_loopback(shared):
    """A local session's torch rendezvous was a TCPStore made by ``init_method="tcp://"``,
    which listens on every interface whatever its host (an audit of security, issue 9,
    forty-seventh pass). Worker 0 now serves it on a socket bound to loopback."""
    psutil = pytest.importorskip("psutil")
    sess = backend_session(shared, "torch")
    assert sess.run(lambda: float(unison.allreduce(np.ones(1))[0]), timeout=QUICK) == [2.0] * 2
    pid = sess.run(__import__("os").getpid)[0]
    listening = [c.laddr for c in psutil.Process(pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening and all(a.ip == "127.0.0.1" for a in listening), listening


def test_a_local_sessions_torch_rendezvous_port_is_held_from_the_start(make_session):
    """The controller found a free port for a local session's torch rendezvous and let it go;
    worker 0 bound it again at the session's first call, so another process could take it
    in between, and the first torch collective failed. The controller now binds it and
    hands worker 0 the listening socket: the port is never free while the session lives."""
    pytest.importorskip("torch.distributed")
    sess = make_session(2, collectives="torch")
    port = int(sess._res.coll_spec["torch_address"].rpartition(":")[2])
    with socket.socket() as stranger, pytest.raises(OSError) as info:
        stranger.bind(("127.0.0.1", port))
    assert info.value.errno == errno.EADDRINUSE
    assert sess.run(lambda: float(unison.allreduce(np.ones(1))[0]), timeout=QUICK) == [2.0] * 2
    sess.close()
    with socket.socket() as after:  # (SO_REUSEADDR: past the closed connections' TIME_WAIT)
        after.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        after.bind(("127.0.0.1", port))  # nobody listens there any more


def flagged_tensor(which: str) -> Any:
    """A tensor with a view flag torch keeps apart from the memory: the negative bit
    (``conj().imag`` of one element, or 0-d: contiguous) or the conjugate bit (``conj()``)."""
    import torch

    if which == "conj":
        return torch.tensor([1 + 2j, 3 + 4j], dtype=torch.complex64).conj()
    return torch.tensor([1 + 2j] if which == "neg" else 1 + 2j).conj().imag


def move_flagged(which: str) -> dict[str, bool]:
    import torch

    t = flagged_tensor(which)
    want = t.resolve_conj().resolve_neg().clone()
    got = {
        "scatter": unison.scatter([t, t] if unison.rank() == 0 else None, src=0),
        "broadcast": unison.broadcast(t if unison.rank() == 0 else None, src=0),
        "allgather": unison.allgather(t)[0],
        "allreduce": unison.allreduce(t, "sum") / 2,
    }
    return {k: bool(torch.equal(v.resolve_conj().resolve_neg(), want)) for k, v in got.items()}


@pytest.mark.parametrize("backend", ["shm", "torch"])
@pytest.mark.parametrize("which", ["neg", "neg0d", "conj"])
def test_tensors_with_a_negative_or_conjugate_bit_move_as_their_values(shared, backend, which):
    """A tensor whose negative or conjugate bit is set (``z.conj().imag``, ``z.conj()``):
    torch keeps the sign or the conjugation apart from the memory, which gloo reads. Before
    (issue 9, forty-ninth pass; an audit of data fidelity), the torch backend's scatter
    sent the values unnegated (a wrong value, no error), a scatter of ``z.conj()`` hung its
    receivers until gloo's timeout, and the shared-memory backend's allreduce raised
    torch's "Can't call numpy()"."""
    sess = backend_session(shared, backend)
    assert sess.run(move_flagged, which, timeout=QUICK) == [
        {"scatter": True, "broadcast": True, "allgather": True, "allreduce": True}] * 2


def extremes_with_a_nan(op: str, where: int, dtype: str, as_tensor: bool) -> Any:
    x = np.array([1.0, 2.0, 3.0], dtype) + unison.rank()
    if unison.rank() == where:
        x[0] = np.nan
    if as_tensor:
        import torch

        return unison.allreduce(torch.from_numpy(x), op).numpy()
    return unison.allreduce(x, op)


@pytest.mark.parametrize("backend", ["shm", "torch"])
@pytest.mark.parametrize("op", ["min", "max"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_min_and_max_keep_a_nan_from_any_rank_as_numpy_does(shared, backend, op, dtype):
    """Before (issue 9, forty-ninth pass; an audit of data fidelity), the torch backend's
    min and max (gloo's, which compares and picks) lost a NaN on any rank but the first,
    and its max could come out below the largest value ([1, 4, 5] where numpy gives
    [nan, 4, 5]). Now both backends give numpy's result in rank order."""
    sess = backend_session(shared, backend)
    ufunc = np.minimum if op == "min" else np.maximum
    for where in (0, 1):
        inputs = [np.array([1.0, 2.0, 3.0], dtype) + r for r in range(2)]
        inputs[where][0] = np.nan
        want = ufunc(*inputs)
        for as_tensor in ([False, True] if backend == "torch" else [False]):
            for got in sess.run(extremes_with_a_nan, op, where, dtype, as_tensor,
                                timeout=QUICK):
                assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), got


MEAN_INPUTS = [-180.0, -200.875, -162.0]
"""Three ranks' values whose complex64 mean, divided in complex64, is 1 ulp off numpy's."""


def complex_mean() -> Any:
    return unison.allreduce(np.array([MEAN_INPUTS[unison.rank()] + 0j], np.complex64), "mean")


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_a_complex64_mean_is_numpys_to_the_bit(shared, backend):
    """numpy's mean divides by an intp count (in complex128, rounded once); unison divided
    in complex64: -180.95834 where numpy gives -180.95833 (an audit, issue 9, forty-ninth
    pass)."""
    if backend == "torch":
        pytest.importorskip("torch.distributed")
    sess = shared(3, collectives=backend)
    want = np.mean(np.stack([np.array([v + 0j], np.complex64) for v in MEAN_INPUTS]), axis=0)
    for got in sess.run(complex_mean, timeout=QUICK):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (got, want)
