"""The codec (unison.protocol) on its own: what a message may hold and how it comes back,
in one process. Calls, results and collectives all go through these functions.
"""

from __future__ import annotations

import math
import pickle
import threading
from typing import Any

import numpy as np
import pytest

from unison import protocol
from unison.channel import Reply
from unison.errors import RemoteError
from unison.refs import Ref


def _round_trip(obj: Any, oob: bool = True) -> Any:
    buffers: list[pickle.PickleBuffer] | None = [] if oob else None
    data = protocol.dumps(obj, buffers)
    return protocol.loads(data, [b.raw() for b in buffers] if buffers else None)


@pytest.mark.parametrize("value", [
    None, True, 0, -(2**70), 1.5, "text ✓", b"\x00bytes", (1, "a"), [1, [2, [3]]],
    {"k": {1, 2}}, frozenset({3}), range(5), complex(1, 2),
])
def test_plain_values_round_trip(value: Any) -> None:
    assert _round_trip(value) == value


def test_nan_and_infinities_round_trip() -> None:
    out = _round_trip([math.nan, math.inf, -math.inf])
    assert math.isnan(out[0]) and out[1:] == [math.inf, -math.inf]


def test_lambdas_and_closures_travel_by_value() -> None:
    base = 40
    add = lambda x: x + base
    data = protocol.dumps(add)
    assert b"cloudpickle" in data  # not a reference a worker could not resolve
    assert protocol.loads(data)(2) == 42


def test_module_functions_travel_by_reference() -> None:
    data = protocol.dumps(np.add)
    assert b"cloudpickle" not in data
    assert protocol.loads(data) is np.add


def test_a_small_array_stays_in_band() -> None:
    a = np.arange(10, dtype=np.int32)
    buffers: list[pickle.PickleBuffer] = []
    data = protocol.dumps(a, buffers)
    assert buffers == []
    np.testing.assert_array_equal(protocol.loads(data), a)


def test_a_large_array_goes_out_of_band_and_comes_back_over_its_buffer() -> None:
    a = np.arange(protocol.OOB_MIN, dtype=np.float64).reshape(-1, 8)
    buffers: list[pickle.PickleBuffer] = []
    data = protocol.dumps({"x": a, "tag": 1}, buffers)
    assert len(buffers) == 1 and len(data) < 1000  # the data is beside the pickle, not in it
    raw = bytearray(buffers[0].raw())  # as a channel delivers it: a writable buffer
    out = protocol.loads(data, [raw])
    np.testing.assert_array_equal(out["x"], a)
    assert out["tag"] == 1
    assert np.shares_memory(out["x"], np.frombuffer(raw, dtype=np.float64))  # no copy


def test_a_large_array_without_a_buffer_list_is_pickled_in_band() -> None:
    a = np.ones(protocol.OOB_MIN, dtype=np.uint8)
    data = protocol.dumps(a)
    assert len(data) > a.nbytes
    np.testing.assert_array_equal(protocol.loads(data), a)


def test_a_reply_carries_its_own_buffers() -> None:
    a = np.arange(protocol.OOB_MIN, dtype=np.int64)
    buffers: list[pickle.PickleBuffer] = []
    data = protocol.dumps(a, buffers)
    reply = Reply(data, [memoryview(bytearray(b.raw())) for b in buffers])
    np.testing.assert_array_equal(protocol.loads(reply), a)


def test_cpu_torch_tensors_round_trip_in_and_out_of_band() -> None:
    torch = pytest.importorskip("torch")
    small = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    large = torch.ones(protocol.OOB_MIN, dtype=torch.int16)
    buffers: list[pickle.PickleBuffer] = []
    data = protocol.dumps([small, large], buffers)
    assert len(buffers) == 1  # the large one only
    out = protocol.loads(data, [bytearray(b.raw()) for b in buffers])
    assert all(isinstance(t, torch.Tensor) for t in out)
    assert torch.equal(out[0], small) and torch.equal(out[1], large)
    bf16 = torch.ones(3, dtype=torch.bfloat16)  # numpy has no bfloat16: torch's own pickling
    assert torch.equal(_round_trip(bf16), bf16)


class _StubSession:
    """Enough of a Session for a Ref to be made and dropped."""

    def _release(self, ref_id: int) -> None:
        pass


def test_a_ref_is_refused_outside_a_call() -> None:
    ref = Ref(_StubSession(), 7, (0,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="only travel as an argument of a call"):
        protocol.dumps([ref])


def test_a_ref_inside_call_arguments_is_counted() -> None:
    ref = Ref(_StubSession(), 7, (0, 1))  # type: ignore[arg-type]
    _, buffers, refs = protocol.dumps_with_refs(((ref, 3), {}))
    assert refs == [ref] and buffers == []
    with pytest.raises(TypeError):
        protocol.dumps(ref)  # only inside dumps_with_refs


class _Custom(Exception):
    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code {code}")
        self.code, self.detail = code, detail


class _Unpicklable(Exception):
    """Holds a lock: it will not pickle plainly, by value, or rebuilt from its parts."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_an_exception_round_trips_with_its_type_and_message() -> None:
    error = protocol.pack_error(_raised(ValueError("bad value")), "worker 1")
    assert error[1:3] == ("ValueError", "bad value")
    assert "Traceback" in error[3] and "bad value" in error[3]
    assert error[4] == "worker 1"
    back = protocol.unpack_error(error)
    assert type(back) is ValueError and str(back) == "bad value"


def test_an_exception_whose_init_takes_other_arguments_is_rebuilt_with_its_attributes() -> None:
    back = protocol.unpack_error(protocol.pack_error(_raised(_Custom(3, "why")), "w"))
    assert type(back) is _Custom
    assert (str(back), back.code, back.detail) == ("code 3", 3, "why")


def test_an_exception_that_cannot_travel_becomes_a_remote_error() -> None:
    error = protocol.pack_error(_raised(_Unpicklable("stuck")), "w")
    back = protocol.unpack_error(error)
    assert isinstance(back, RemoteError)
    assert (back.type_name, back.message) == ("_Unpicklable", "stuck")
    assert "lock" in back.attributes and "stuck" in back.traceback


def test_an_error_without_a_blob_unpacks_to_a_remote_error() -> None:
    back = protocol.unpack_error((None, "KeyError", "'k'", "Traceback ...\n"))
    assert isinstance(back, RemoteError)
    assert "KeyError" in str(back)
