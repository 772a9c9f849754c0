"""The codec (unison.protocol) on its own: what a message may hold and how it comes back,
in one process. Calls, results and collectives all go through these functions.
"""

from __future__ import annotations

import datetime
import enum
import fractions
import math
import pickle
import sys
import threading
from typing import Any

import numpy as np
import pytest

from unison import protocol
from unison.channel import Reply
from unison.channel import arena as arena_module
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


def test_arrays_past_max_buffers_are_pickled_in_band(monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver maps each buffer apart (Linux allows a process about 65,000 mappings):
    past MAX_BUFFERS in one message, the rest travel in band, and all come back."""
    monkeypatch.setattr(protocol, "MAX_BUFFERS", 3)
    sent = [np.full(protocol.OOB_MIN // 8, float(i)) for i in range(5)]
    buffers: list[pickle.PickleBuffer] = []
    data = protocol.dumps(sent, buffers)
    assert len(buffers) == 3 and len(data) > 2 * protocol.OOB_MIN
    got = protocol.loads(data, [b.raw() for b in buffers])
    assert [a.tolist() for a in got] == [a.tolist() for a in sent]


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


def test_a_tensor_keeps_its_attributes_and_its_channels_last_layout() -> None:
    """What torch's own pickling keeps, the out-of-band path keeps too: attributes set on a
    tensor, and a channels-last layout (its strides), besides the values."""
    torch = pytest.importorskip("torch")
    named = torch.arange(6.0)
    named.name_in_model = "layer3.q_proj"
    out = _round_trip(named)
    assert torch.equal(out, named) and out.name_in_model == "layer3.q_proj"
    for shape, layout in [((2, 3, 4, 5), torch.channels_last),
                          ((2, 3, 4, 5, 6), torch.channels_last_3d)]:
        t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        t = t.contiguous(memory_format=layout)
        for oob in (True, False):
            out = _round_trip(t, oob)
            assert torch.equal(out, t) and out.stride() == t.stride(), (shape, oob)


class _Rounded:
    def __init__(self, x: float) -> None:
        self.x = x


def test_a_reducer_registered_after_the_first_message_is_used() -> None:
    """copyreg registrations made at any time count, with torch imported as without."""
    import copyreg

    pytest.importorskip("torch")
    assert _round_trip(_Rounded(1.25)).x == 1.25  # the table is made (torch is imported)
    copyreg.pickle(_Rounded, lambda r: (_Rounded, (round(r.x),)))
    try:
        assert _round_trip(_Rounded(1.25)).x == 1
    finally:
        del copyreg.dispatch_table[_Rounded]
    assert _round_trip(_Rounded(1.25)).x == 1.25


class _StubSession:
    """Enough of a Session for a Ref to be made and dropped."""

    def __init__(self) -> None:
        self._frees: list[int] = []


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


class _Handover:
    """Hands its messages over as it pickles (a drained buffer, a one-shot token): pickled
    twice, the second state, emptied, is what would arrive."""

    def __init__(self, msgs: list[str], inner: object = None) -> None:
        self.msgs, self.inner, self.pickled = msgs, inner, 0

    def __getstate__(self) -> dict[str, Any]:
        self.pickled += 1
        msgs, self.msgs = self.msgs, []
        return {"msgs": msgs, "inner": self.inner, "pickled": self.pickled}


def test_a_script_class_is_pickled_once_where_main_holds_it_or_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``__main__`` class's reducer ran in plain pickle, then again in cloudpickle (which
    sent the second, emptied, state): on the controller, where plain pickle names
    ``__main__``, and on a worker, where plain pickle fails on the class."""
    script = type("Script", (_Handover,), {"__module__": "__main__"})
    monkeypatch.setattr(sys.modules["__main__"], "Script", script, raising=False)
    sent = script(["a", "b"])
    got = _round_trip(sent)  # the controller's case
    assert (got.msgs, got.pickled, sent.pickled) == (["a", "b"], 1, 1)
    monkeypatch.delattr(sys.modules["__main__"], "Script")
    sent = script(["c"])
    got = _round_trip((5, protocol.OK, sent))[2]  # a worker's reply
    assert (got.msgs, got.pickled, sent.pickled) == (["c"], 1, 1)


def test_an_importable_value_holding_a_script_object_is_pickled_once() -> None:
    """The outer reducer (an importable class's, which cloudpickle need not take) ran
    before plain pickle met the ``__main__`` object inside, and again in cloudpickle's."""
    script = type("Script", (), {"__module__": "__main__"})  # (not in __main__: a worker's)
    sent = _Handover(["a", "b"], script())
    got = _round_trip({"box": sent})["box"]
    assert (got.msgs, got.pickled, sent.pickled) == (["a", "b"], 1, 1)
    assert type(got.inner).__name__ == "Script"
    sent = _Handover(["c"])
    args = protocol.dumps_with_refs(((sent, script()), {}))[0]  # a call's arguments
    got = protocol.loads(args)[0][0]
    assert (got.msgs, got.pickled, sent.pickled) == (["c"], 1, 1)


class _CountingSet(set):  # type: ignore[type-arg]
    """A set whose iteration (what a set's C reduction calls) counts."""

    iterated = 0

    def __iter__(self) -> Any:
        type(self).iterated += 1
        return super().__iter__()


def test_a_container_subclass_whose_method_its_c_reduction_calls_is_pickled_once() -> None:
    """A set's reduction lists it (a deque's iterates it, a Counter's copies it): a method
    the subclass overrides ran in the first pass, then again in cloudpickle's, where a
    ``__main__`` object sat beside it."""
    script = type("Script", (), {"__module__": "__main__"})
    _CountingSet.iterated = 0
    got = _round_trip([_CountingSet({1, 2}), script()])
    assert got[0] == {1, 2} and _CountingSet.iterated == 1


class _Meta(type):
    pass


class _Tagged(metaclass=_Meta):
    class Inner(metaclass=_Meta):
        pass


class _Color(enum.Enum):
    RED = 1


@pytest.mark.parametrize("value", [
    _Tagged, _Tagged.Inner, [_Tagged, _Tagged.Inner, _Tagged], _Color, _Color.RED,
    fractions.Fraction, fractions.Fraction(3, 7), np.dtype("f8"), np.arange(3),
])
def test_a_class_of_a_metaclass_is_pickled_by_name_as_pickle_does(value: Any) -> None:
    """The first pass names such a class by a reducer of its own (a lookup that missed
    cost a KeyError each time): the bytes are plain pickle's."""
    assert protocol.dumps(value) == pickle.dumps(value, 5)


def test_a_script_class_of_a_metaclass_still_travels_by_value(
        monkeypatch: pytest.MonkeyPatch) -> None:
    script = _Meta("Script", (), {"__module__": "__main__", "x": 5})
    monkeypatch.setattr(sys.modules["__main__"], "Script", script, raising=False)
    data = protocol.dumps([script, _Tagged])
    monkeypatch.delattr(sys.modules["__main__"], "Script")  # as on a worker
    got = protocol.loads(data)  # (by name, it would fail: __main__ has no Script now)
    assert got[0].__name__ == "Script" and type(got[0]) is _Meta and got[0].x == 5
    assert got[1] is _Tagged


class _Dated(datetime.date):
    pass


def test_a_reducer_given_to_a_class_after_its_first_send_is_the_one_that_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first pass kept a C ``__reduce__`` it had found for a class made in Python:
    one assigned later was ignored, and the old state arrived."""
    assert _round_trip(_Dated(2020, 1, 1)) == datetime.date(2020, 1, 1)
    monkeypatch.setattr(_Dated, "__reduce__", lambda self: (str, ("patched",)), raising=False)
    assert _round_trip(_Dated(2020, 1, 1)) == "patched"


class _PicklesInside:
    """A reducer that pickles something of its own: a call's arguments (a nested send), or
    a value that must go by value (a class of ``__main__``'s)."""

    def __init__(self, nested_call: bool) -> None:
        self.nested_call = nested_call

    def __reduce__(self) -> Any:
        if self.nested_call:
            protocol.dumps_with_refs(((1,), {}))
        else:
            protocol.dumps(type("Script", (), {"__module__": "__main__"})())
        return (int, (7,))


def _ref(i: int) -> Ref:
    ref = Ref.__new__(Ref)
    ref._id, ref._freed, ref._session, ref.workers = i, True, None, (0,)
    return ref


@pytest.mark.parametrize("nested_call", [True, False])
def test_a_reducer_that_pickles_something_itself_leaves_the_outer_refs_alone(
        nested_call: bool) -> None:
    """The Refs an argument list holds are counted in a per-thread list: a reducer that
    pickled arguments itself reset it (the Ref after it then raised a misleading error),
    and one whose pickle gave way to cloudpickle emptied it (a Ref went unchecked)."""
    first, second = _ref(5), _ref(6)
    seen = protocol.dumps_with_refs(((first, _PicklesInside(nested_call), second), {}))[2]
    assert seen == [first, second]  # (loading needs a worker's register file)


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


# -- marshal for plain messages: a CALL and a reply of a plain value ---------------------------

def _command(data: bytes) -> tuple[Any, ...]:
    """A command as the worker reads it (worker.serve)."""
    if data[0] == protocol.PICKLED:
        return pickle.loads(data)  # type: ignore[no-any-return]
    return protocol.loads_plain(data)  # type: ignore[no-any-return]


@pytest.mark.parametrize("frees", [None, (7,), tuple(range(3, 40))])
@pytest.mark.parametrize("args", [None, (1, -(2**70), 2.5, "s✓\ud800", None, True, 1 + 2j),
                                  [(0,), (9, "s")], {"a": 1, "b": True},
                                  [(0,), (9, 2.5), {"c": 9, "d": None}, ("c",)],
                                  [(), (("<f4", None, b"\x00\x00\xc0?"),), {}, (), (0,)],
                                  b"the pickle of (args, kwargs)"])
@pytest.mark.parametrize("ranks", [None, (1, 3)])
def test_a_call_reads_back_exactly(frees: Any, args: Any, ranks: Any) -> None:
    data = protocol.call_msg(frees, 5, 3, args, ranks, 12)
    assert data[0] != protocol.PICKLED  # marshalled
    got = _command(data)
    assert got == (protocol.CALL, frees, 5, 3, args, ranks, 12)
    if type(args) is tuple:
        assert [type(a) for a in got[4]] == [type(a) for a in args]  # True stays a bool
    if type(args) is dict:
        assert [type(a) for a in got[4].values()] == [int, bool]


@pytest.mark.parametrize("frees", [None, (7,), tuple(range(3, 40))])
def test_a_get_reads_back_exactly(frees: Any) -> None:
    data = protocol.get_msg(frees, 5, 2**40)
    assert data[0] != protocol.PICKLED  # marshalled, as a CALL
    got = _command(data)
    assert got == (protocol.GET, frees, 5, 2**40)
    assert protocol.read_get(got) == (5, 2**40)


@pytest.mark.parametrize("value", [7, None, -0.0, "✓", b"\x80", (1, [2.5, {"k": ()}]), [],
                                   {"a": (1, 2), 3: None}])
def test_a_put_of_a_plain_value_is_marshalled_and_reads_back_exactly(value: Any) -> None:
    data = protocol.put_msg((4,), 9, (value,))
    assert data[0] != protocol.PICKLED
    ref_id, got = protocol.read_put(_command(data))
    assert ref_id == 9 and type(got) is tuple and len(got) == 1
    assert repr(got[0]) == repr(value) and type(got[0]) is type(value)  # -0.0 stays -0.0


class _Int(int):
    pass


def _holds_itself() -> list[Any]:
    x: list[Any] = [1]
    x.append(x)
    return x


_twice = [1]


@pytest.mark.parametrize(("value", "plain"), [
    (None, True), (True, True), (2**80, True), (math.nan, True), ("s" * 10_000, True),
    (b"", True), ((), True), ((1, (2, (3,))), True), ({"k": [1, 2.5]}, True),
    (list(range(64)), True), (list(range(65)), False), ([[0] * 40, [0] * 40], False),
    ((_twice, _twice), False), ({"a": _twice, "b": _twice}, False), (_holds_itself(), False),
    ((("t",),) * 2, True),  # a tuple met twice: it cannot change, so two copies read the same
    (b"b" * protocol.PLAIN_BYTES, True), (b"b" * (protocol.PLAIN_BYTES + 1), False),
    ([b"b" * 40_000, b"c" * 40_000], False),  # PLAIN_BYTES in all: pickled, out of band
    ({b"k" * 40_000: b"v" * 40_000}, False), ("s" * (protocol.PLAIN_BYTES + 1), True),
    (_Int(3), False), ((1, _Int(3)), False), (complex(1, 2), False), ({1, 2}, False),
    (np.int64(3), False), (range(3), False),
])
def test_is_plain_takes_what_marshal_carries_as_pickle_would(value: Any, plain: bool) -> None:
    """What goes by marshal (a CALL's arguments aside): exact types only, 64 items at most,
    and no list or dict met twice, whose one object pickle keeps and marshal would split."""
    assert protocol.is_plain(value) is plain
    if plain:
        got = protocol.loads_plain(protocol.dumps_plain(value, protocol.PLAIN))
        assert repr(got) == repr(value)


def test_every_other_command_is_a_pickle() -> None:
    """The worker reads a command by its first byte: a pickle's is always PICKLED."""
    for data in (protocol.define_msg(None, 3, b"fn"), protocol.put_msg((1,), 4, b"v"),
                 protocol.sync_msg(None, 6), protocol.nop_msg((7,)),
                 protocol.shutdown_msg(None, 8)):
        assert data[0] == protocol.PICKLED


@pytest.mark.parametrize("value", [0, -1, 2**63, -(10**30), None, 1.5, -0.0, math.inf, True,
                                   False, "7✓", b"\x807", ""])
def test_a_plain_reply_reads_back_exactly(value: Any) -> None:
    data = protocol.dumps_plain((41, protocol.OK, value), protocol.PLAIN)  # as serve replies
    assert data[0] != protocol.PICKLED
    got_id, status, payload = protocol.read_reply(data)
    assert (got_id, status, payload) == (41, protocol.OK, value)
    assert type(payload) is type(value)  # a bool stays a bool, an int an int
    if isinstance(value, float):
        assert math.copysign(1, payload) == math.copysign(1, value)


def test_nan_comes_back_in_a_plain_reply() -> None:
    nan = protocol.read_reply(protocol.dumps_plain((1, protocol.OK, math.nan), protocol.PLAIN))[2]
    assert math.isnan(nan)


def test_a_large_plain_reply_mapped_where_the_worker_put_it_reads_back() -> None:
    """The shm channel hands a large body over as a Reply of a view, without buffers."""
    big = b"\x80" * 100_000
    data = bytearray(protocol.dumps_plain((6, protocol.OK, big), protocol.PLAIN))
    assert protocol.read_reply(Reply(memoryview(data), [])) == (6, protocol.OK, big)


def test_a_pickled_reply_reads_back_too() -> None:
    assert protocol.read_reply(protocol.dumps((3, protocol.ERR, "x"))) == (3, protocol.ERR, "x")


@pytest.mark.parametrize("cut", [1, 5, -1])
def test_a_truncated_plain_reply_is_refused(cut: int) -> None:
    data = protocol.dumps_plain((41, protocol.OK, 123456789), protocol.PLAIN)
    with pytest.raises((ValueError, EOFError)):
        protocol.read_reply(data[:cut])


def test_a_result_is_plain_only_small_and_of_plain_values() -> None:
    """What a worker sends back by marshal (run's quick path): tuples, lists and dicts of
    plain values, nested too, 64 items at most over the nesting; a container holding
    itself runs out of items (pickle, which keeps the cycle), as does anything else."""
    from unison.worker import _plain

    cyclic: list[Any] = [1]
    cyclic.append(cyclic)
    assert _plain((1, "a", None, True, b"x", 1.5)) and _plain({"k": [1.5, (b"x",)], 2: ()})
    assert _plain([]) and _plain(list(range(64)))
    assert not _plain(cyclic) and not _plain(list(range(65)))
    assert not _plain([[0] * 40, [0] * 40])  # 82 over the nesting
    assert not _plain((1, object())) and not _plain({"k": {1, 2}})


@pytest.mark.parametrize("shape", ["alone", "in a tuple", "twice in a tuple", "in a list"])
def test_large_bytes_are_pickled_out_of_band_and_read_back_exactly(shape: str) -> None:
    """pickle writes a bytes object into its stream, whatever its size; ``dumps`` with
    buffers sends a large one that ``bytes_apart`` wrapped beside it (one copy into shared
    memory), alone or as an item of a tuple (a result, a call's arguments), one buffer for
    one object held twice. In a list it stays in the stream: a list rebuilt would not be
    the one another part may hold."""
    big = bytes(range(256)) * (protocol.OOB_MIN // 256)
    other = b"\x80" * (protocol.OOB_MIN + 7)
    value: Any = {"alone": big, "in a tuple": (1, big, other, b"small"),
                  "twice in a tuple": (big, big), "in a list": [big]}[shape]
    bufs: list[pickle.PickleBuffer] = []
    data = protocol.dumps(protocol.bytes_apart(value), bufs)
    got = pickle.loads(data, buffers=[bytes(b.raw()) for b in bufs])
    assert got == value and type(got) is type(value)
    if shape == "in a list":
        assert bufs == [] and len(data) > len(big)
        return
    assert len(data) < 200 and [b.raw().nbytes for b in bufs] == {
        "alone": [len(big)], "in a tuple": [len(big), len(other)],
        "twice in a tuple": [len(big)]}[shape]
    if shape == "twice in a tuple":
        assert got[0] is got[1]
    if type(got) is tuple:
        assert [type(v) for v in got] == [type(v) for v in value]
    assert protocol.dumps(value) == pickle.dumps(value, protocol=5)  # no buffers: as before


class _Sub(np.ndarray):
    pass


@pytest.mark.parametrize("value", [
    np.arange(12, dtype=np.float64).reshape(3, 4), np.array([True, False]),
    np.array([1 + 2j], dtype=np.complex64), np.arange(5, dtype=">i4"),  # big-endian kept
    np.array([1.5, -0.0, np.nan], dtype=np.float16), np.zeros((0, 3), dtype=np.uint8),
    np.array(7.25), np.array(["2026-12-06T08:00"], dtype="datetime64[ns]"),
    np.float64(-0.0), np.int8(-3), np.bool_(True), np.complex128(1j), np.uint64(2**64 - 1),
    np.datetime64("2026-12-06", "D"), np.timedelta64(5, "ms"),
])
@pytest.mark.parametrize("shared_arrays", [False, True])
def test_a_small_numpy_value_reads_back_exactly_from_its_array_payload(
        value: Any, shared_arrays: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's or GET's reply of a small numpy array or scalar goes by marshal as
    (dtype, shape, bytes), status ARRAY: the same type, dtype (byte order and unit too),
    shape and bits; an array of its own, writable, as pickle's would be. Where this
    process holds shared arrays, each array is first looked for among them (an empty one,
    a time's: no memoryview of them is needed for that)."""
    if shared_arrays:  # one elsewhere, alive
        monkeypatch.setattr(arena_module, "_shared_ranges", ((8, 16, lambda: True),))
    payload = protocol.array_payload(value)
    assert payload is not None
    data = protocol.dumps_plain((5, protocol.ARRAY, payload), protocol.PLAIN)
    got_id, status, got = protocol.read_reply(data)
    assert (got_id, status) == (5, protocol.OK)
    assert type(got) is type(value) and got.dtype == value.dtype
    assert got.tobytes() == value.tobytes() and np.shape(got) == np.shape(value)
    if type(got) is np.ndarray:
        assert got.flags.writeable and got.flags.owndata and got.flags.c_contiguous
        got[...] = 0  # its own: the reply's bytes are not behind it


@pytest.mark.parametrize("value", [
    np.zeros(protocol.OOB_MIN // 8), np.arange(12.0).reshape(3, 4)[:, ::2],
    np.asfortranarray(np.arange(6.0).reshape(2, 3)), np.array([{}, 1], dtype=object),
    np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]), np.zeros(2).view(_Sub),
    np.array(["ab"]), np.void(b"ab"), 1.5, [np.float64(1)],
    np.zeros(2, dtype=np.dtype(np.float64, metadata={"unit": "m"})),
])
def test_other_numpy_values_are_left_to_pickle(value: Any) -> None:
    """Large arrays (out of band instead), arrays not in C order, objects, records,
    strings, subclasses, a dtype with metadata, and anything not numpy's: no array
    payload."""
    assert protocol.array_payload(value) is None


def test_an_array_in_a_shared_array_is_left_to_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small array that lies in a shared array (sess.empty, or a slice of one) travels
    by reference, in the pickle: by value, the workers' writes to it would be lost."""
    whole = np.zeros(16)
    start = whole.__array_interface__["data"][0]
    monkeypatch.setattr(arena_module, "_shared_ranges",
                        ((start, start + whole.nbytes, lambda: whole),))
    assert protocol.array_payload(whole) is None and protocol.array_payload(whole[4:8]) is None
    assert protocol.array_payload(np.zeros(16)) is not None  # another array's memory
