"""Message kinds and their encoding, shared by the controller and the workers.

    controller                                   worker
    ----------                                   ------
    (CALL,  frees, ref_id, fn_id, args, kwargs) -> regs[ref_id] = fns[fn_id](*args, **kwargs)
    (DEFINE, frees, fn_id, fn_pickle)           -> fns[fn_id] = loads(fn_pickle)
    (PUT,   frees, ref_id, value)               -> regs[ref_id] = value
    (GET,   frees, req_id, ref_id)              -> reply (req_id, OK, regs[ref_id])
    (SYNC,  frees, req_id)                      -> reply (req_id, OK, [unreported errors])
    (NOP,   frees)                              -> nothing (carries frees to every worker)
    (SHUTDOWN, frees)                           -> leave the loop
                              reply <- (req_id, OK | ERR, payload)

Every message is one tuple, pickled once whatever the number of workers. ``frees`` is a
tuple of ids to drop before the message runs (or None): that is how dropped Refs are
batched onto the next message instead of costing a round trip each.

Encoding is pickle protocol 5. The standard pickler is tried first, as it is the fastest;
anything it cannot take, or that it would send by reference to the controller's ``__main__``
(which a worker never imports), goes through cloudpickle, by value. A Ref inside the
arguments pickles as a lookup in the receiving worker's register file.
"""

from __future__ import annotations

import io
import pickle
import sys
import threading
import traceback
from typing import TYPE_CHECKING, Any

import cloudpickle

if TYPE_CHECKING:
    from unison.refs import Ref

CALL, DEFINE, PUT, GET, SYNC, NOP, SHUTDOWN = range(1, 8)
OK, ERR = 0, 1
READY_REQ = -1  # the req_id of the hello a worker sends once its loop is up

_MAIN = b"__main__"
_local = threading.local()


OOB_MIN = 1 << 16
"""Buffers (numpy arrays, PickleBuffers) this large travel out of band, beside the pickle."""


def dumps(obj: object, buffers: list[pickle.PickleBuffer] | None = None) -> bytes:
    """Pickle for the other side: plain pickle where it is right, cloudpickle where needed.

    With ``buffers``, large pickle-5 buffers are appended there instead of copied in."""
    callback = None
    if buffers is not None:
        start = len(buffers)

        def callback(pb: pickle.PickleBuffer) -> bool:
            if pb.raw().nbytes < OOB_MIN:
                return True
            buffers.append(pb)
            return False

    try:
        if "torch" in sys.modules:
            data = _dumps_with_tensors(obj, callback)
        else:
            data = pickle.dumps(obj, protocol=5, buffer_callback=callback)
        if _MAIN not in data:
            return data
    except Exception:
        pass
    if buffers is not None:
        del buffers[start:]
    refs = getattr(_local, "refs", None)
    if refs is not None:
        refs.clear()  # the retry sees every Ref again
    out: bytes = cloudpickle.dumps(obj, protocol=5, buffer_callback=callback)
    return out


def _dumps_with_tensors(obj: object, callback: Any) -> bytes:
    """Plain pickle where CPU torch tensors travel as numpy arrays: out of band, so a large
    one is copied once into shared memory instead of being pickled in-band."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=5, buffer_callback=callback)
    global _tensor_table
    if _tensor_table is None:
        import copyreg

        import torch

        _tensor_table = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}
    pickler.dispatch_table = _tensor_table
    pickler.dump(obj)
    return out.getvalue()


_tensor_table: dict[type, Any] | None = None


def _reduce_tensor(t: Any) -> Any:
    import torch

    simple = (type(t) is torch.Tensor and t.device.type == "cpu" and not t.requires_grad
              and t.layout is torch.strided and not t.is_quantized
              and not t.is_neg() and not t.is_conj())
    if simple:
        try:
            return (tensor_from_numpy, (t.contiguous().numpy(),))
        except (TypeError, RuntimeError):
            pass  # a dtype numpy lacks (bfloat16): torch's own pickling
    return t.__reduce_ex__(5)


def tensor_from_numpy(arr: Any) -> Any:
    """A CPU tensor over a received array's memory (copy-on-write shared memory: no copy)."""
    import torch

    return torch.from_numpy(arr)


def dumps_with_refs(obj: object) -> tuple[bytes, list[pickle.PickleBuffer], list[Ref]]:
    """Pickle call arguments out of band and say which Refs they hold, for checking."""
    refs: list[Ref] = []
    buffers: list[pickle.PickleBuffer] = []
    _local.refs = refs
    try:
        return dumps(obj, buffers), buffers, refs
    finally:
        _local.refs = None


def loads(data: bytes | memoryview, buffers: list[Any] | None = None) -> Any:
    return pickle.loads(data, buffers=buffers)


def ref_reduce(ref: Ref) -> tuple[object, tuple[int]]:
    """How a Ref pickles: as a lookup, by id, in the register file of the worker that reads it."""
    refs = getattr(_local, "refs", None)
    if refs is None:
        raise TypeError(
            "a unison Ref can only travel as an argument of a call in the session that made it; "
            "use ref.get() or ref.gather() to fetch its value"
        )
    refs.append(ref)
    return (_lookup, (ref._id,))


# -- worker side of Ref arguments -------------------------------------------------------------

registers: dict[int, Any] = {}
"""The register file of this process, when it is a worker: id -> object."""


class Failed:
    """What a register holds when the call that should have filled it raised."""

    __slots__ = ("error",)

    def __init__(self, error: tuple[Any, ...]) -> None:
        self.error = error


def _lookup(ref_id: int) -> Any:
    try:
        obj = registers[ref_id]
    except KeyError:
        raise LookupError(f"Ref #{ref_id} is not held by this worker (freed already?)") from None
    if isinstance(obj, Failed):
        raise ValueError(
            f"argument Ref #{ref_id} holds no value on this worker: the call that made it "
            f"raised {obj.error[1]}: {obj.error[2]}"
        )
    return obj


# -- errors across the process boundary -------------------------------------------------------


class RemoteError(Exception):
    """Stands in for a worker's exception that could not be pickled back."""


def pack_error(exc: BaseException, where: str) -> tuple[bytes | None, str, str, str, str]:
    """A worker-side exception as (pickled exception or None, type, message, traceback, where)."""
    try:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except Exception as broken:  # a user exception whose str() or repr() itself raises
        tb = f"(the traceback could not be formatted: {type(broken).__name__}: {broken})\n"
    exc.__traceback__ = None  # frames hold locals that may not pickle, and they are in tb
    blob: bytes | None
    try:
        blob = dumps(exc)
        pickle.loads(blob)
    except Exception:
        blob = None
    try:
        message = str(exc)
    except Exception:
        message = f"<str() of this {type(exc).__qualname__} failed>"
    return (blob, type(exc).__qualname__, message, tb, where)


def unpack_error(error: tuple[Any, ...]) -> BaseException:
    blob, type_name, message = error[0], error[1], error[2]
    if blob is not None:
        try:
            exc = pickle.loads(blob)
            if isinstance(exc, BaseException):
                return exc
        except Exception:
            pass
    return RemoteError(f"{type_name}: {message}")
