"""Message kinds and their encoding, shared by the controller and the workers.

    controller                                   worker
    ----------                                   ------
    (CALL,  frees, ref_id, fn_id, args, ranks, req_id)
                                                -> regs[ref_id] = fns[fn_id](*args, **kwargs)
                 (args: None, plain values, Refs by id (see call_msg), or the pickle of
                  (args, kwargs));
                 with a req_id (run): reply (req_id, OK | ERR, result) instead, keep nothing
    (DEFINE, frees, fn_id, fn_pickle)           -> fns[fn_id] = loads(fn_pickle)
    (PUT,   frees, ref_id, value)               -> regs[ref_id] = value
                 (value: its pickle; or, marshalled in place, (value,), {rank: value}, or
                  [a small numpy value's array payload])
    (GET,   frees, req_id, ref_id)              -> reply (req_id, OK, regs[ref_id])
    (SYNC,  frees, req_id)                      -> reply (req_id, OK, [unreported errors])
    (NOP,   frees)                              -> nothing (carries frees to every worker)
    (SHUTDOWN, frees, req_id)                   -> reply like SYNC, then leave the loop
                              reply <- (req_id, OK | ERR, payload)
                 (or (req_id, ARRAY, (dtype, shape, bytes[, False])): OK, a small numpy
                  value; False: a read-only array)

Every message is one tuple, encoded once whatever the number of workers. ``frees`` is a
tuple of ids to drop before the message runs (or None): that is how dropped Refs are
batched onto the next message instead of costing a round trip each.

Encoding is pickle protocol 5, each of a value's reducers run once whichever the encoder (a
reducer may hand over what it pickles: run twice, the second, emptied, state arrived, with
no error). A first pass, the standard pickler (C, the fastest), runs only reducers known to
give the same again: C's, the standard library's, numpy's and torch's, a class's default
(``_first_reducer``). At the first object that needs more (a reducer of other Python code,
a class of ``__main__`` or one that cloudpickle sends by value) it gives way, before
anything of that object ran, to one cloudpickle pass, which runs every reducer once. It also
gives way where it fails, or where it would send anything by reference to the controller's
``__main__`` (which a worker never imports): what it ran then runs again, which such
reducers allow. A Ref inside the arguments pickles as a lookup in the receiving worker's
register file (one among plain arguments, positional or keyword, goes by its id inside the
CALL, with no pickle: see call_msg).

A CALL, a GET, and a PUT or a reply of a plain value (None, bool, int, float, str, short
bytes, or a small tuple, list or dict of them: is_plain) are encoded with marshal instead (version
PLAIN): every field they hold is of a type marshal takes, and it does the same work as
pickle with less set-up (for a CALL, about half the instructions to write and 40% fewer to
read: docs/benchmarks.md, "Issue 9, seventh pass"). Everything else is pickled. A reader
tells the two apart by the first byte: a pickle's is always PICKLED (its PROTO opcode), a
marshalled tuple's never is.
"""

from __future__ import annotations

import abc
import copyreg
import functools
import io
import marshal
import operator
import pickle
import sys
import threading
import traceback
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, SupportsIndex

import cloudpickle

try:  # cloudpickle's own choice of by reference or by value (2.0 on)
    from cloudpickle.cloudpickle import _should_pickle_by_reference
except ImportError:
    _should_pickle_by_reference = None

from unison.channel import MAX_BUFFERS, Reply, too_many_buffers
from unison.channel import arena as _arena
from unison.errors import RemoteError

if TYPE_CHECKING:
    from unison.refs import Ref

CALL, DEFINE, PUT, GET, SYNC, NOP, SHUTDOWN = range(1, 8)
OK, ERR, ARRAY = 0, 1, 2
"""A reply's status. ARRAY: OK, its value a small numpy array or scalar sent as
``array_payload`` makes it (read back here, in ``read_reply``, and in the router's decode)."""
READY_REQ = -1  # the req_id of the hello a worker sends once its loop is up
ON_CONTROLLER = "unpickling the reply on the controller"
"""The ``where`` of a packed error made on the controller, for a reply that would not
unpickle there: its traceback is the controller's, not the worker's."""

_dump = pickle.dumps


# -- messages: each kind is built and read here, and nowhere else ------------------------------
# The controller builds one with the frees it batches (None for none); the worker unpickles it
# once, reads (op, frees) = msg[0], msg[1], then the rest with the reader of that op.


SCALARS = frozenset({type(None), bool, int, float, str})
"""Values that marshal takes as they are (no buffers, no class to import)."""
CONTAINERS = frozenset({tuple, list, dict})
PLAIN_ITEMS = 64
PLAIN_BYTES = 1 << 16
"""Longer bytes take the pickle's way, out of band (``dumps``): one copy into shared memory,
where marshal wrote them twice on a run's reply and read them once. A 32 MiB bytes value
gathered from 2 workers took 87 ms that way, 50 this way; put, 40 and 24 (``python
benchmarks/large_reply.py``)."""


def is_plain(value: Any) -> bool:
    """Whether marshal carries ``value`` exactly as pickle would, and cheaply: one of
    SCALARS, bytes (exact types: a subclass is pickled), or a small tuple, list or dict
    (PLAIN_ITEMS items at most, nested ones counted) of such values, with PLAIN_BYTES of
    bytes at most in all. A list or dict met twice is not plain: marshal (version PLAIN)
    would make two of it where pickle keeps one object, whose change through one name
    shows through the other; nor is a container that holds itself. A long container costs
    nothing here: its length is read before its items."""
    kind = type(value)
    if kind in SCALARS:
        return True
    if kind is bytes:
        return len(value) <= PLAIN_BYTES
    if kind not in CONTAINERS:
        return False
    left, size, todo, seen = PLAIN_ITEMS, PLAIN_BYTES, [value], set()
    while todo:
        item: Any = todo.pop()
        kind = type(item)
        if kind in SCALARS:
            continue
        if kind is bytes:
            size -= len(item)
            if size < 0:
                return False
            continue
        if kind not in CONTAINERS:
            return False
        left -= len(item)
        if left < 0:
            return False
        if kind is not tuple:  # (a tuple cannot change: two copies of it read the same)
            if id(item) in seen:
                return False
            seen.add(id(item))
        if kind is dict:
            todo += item.keys()
            todo += item.values()
        else:
            todo += item
    return True


PICKLED = pickle.PROTO[0]  # 0x80: the first byte of every pickle; marshal's is another
dumps_plain, loads_plain = marshal.dumps, marshal.loads
"""marshal, for messages of plain values: a CALL, and a reply of a plain value; written
``dumps_plain(msg, PLAIN)``."""
PLAIN = 2
"""The marshal version: 3 and later add object references, whose table costs more to set up
than these messages take to write (docs/benchmarks.md, "Issue 9, seventh pass")."""


def call_msg(frees: tuple[int, ...] | None, ref_id: int, fn_id: int, args: Any,
             ranks: tuple[int, ...] | None, req_id: int = 0) -> bytes:
    """Run function ``fn_id`` into register ``ref_id``. ``args``: None, a tuple of plain
    values, a list ``[positions, values]``: plain values with the ids of Ref arguments at
    those positions, ``[positions, values, kwargs, names]``: the same with the keyword
    arguments, the ids of Refs under ``names``, ``[positions, values, kwargs, names,
    keys]``: the same with small numpy values as ``array_payload`` made them at ``keys``
    (positions and names), a dict: plain keyword values alone, or the pickle of ``(args,
    kwargs)``; ``ranks``: the call's workers if not all;
    ``req_id``: reply with the result (or error) at once, keeping nothing (``run``).
    Marshalled, not pickled; worker.serve unpacks the seven fields in place: the hot path."""
    return dumps_plain((CALL, frees, ref_id, fn_id, args, ranks, req_id), PLAIN)


def read_reply(data: bytes | memoryview | Reply) -> tuple[int, int, Any]:
    """A (non-empty) reply's ``(req_id, OK | ERR, payload)``, pickled or marshalled. A
    channel's Reply brings out-of-band buffers, or a large body mapped where the worker put
    it: either kind of body."""
    buffers = None
    if isinstance(data, tuple):
        data, buffers = data
    if data[0] == PICKLED:
        return pickle.loads(data, buffers=buffers)  # type: ignore[no-any-return]
    got = loads_plain(data)
    if got[1] == ARRAY:
        return got[0], OK, array_value(got[2])
    return got  # type: ignore[no-any-return]


_ARRAY_KINDS = frozenset("biufcmM")  # bool, integers, floats, complex, times: bytes alone


def array_payload(value: Any) -> tuple[Any, ...] | None:
    """A small numpy array or scalar as marshal carries it, ``(dtype, shape, bytes)`` (shape
    None: a scalar), with False after them for a read-only array (pickle gives one back
    read-only); None for anything else, which is pickled. Pickle took 5.5 us to write
    an array of 4 floats and 2.9 to read it (``timeit``): a run of one took 4.0-4.3x an
    int's run at N=2 that way, 1.8x this way (``python benchmarks/result_shapes.py``,
    the row ``array``). Only exact types, C order, under OOB_MIN bytes (larger ones go
    out of band), not in a shared array, and dtypes that are their bytes alone."""
    np = sys.modules.get("numpy")
    if np is None:  # (not imported: the value is no array)
        return None
    if type(value) is np.ndarray:
        if value.nbytes >= OOB_MIN or not value.flags.c_contiguous:
            return None
        if _arena._shared_ranges and _arena.lies_in_shared(
                value.__array_interface__["data"][0], value.nbytes):
            return None  # a shared array (sess.empty) goes by reference, or writes are lost
        shape: tuple[int, ...] | None = value.shape
    elif isinstance(value, np.generic) and type(value) is value.dtype.type:
        shape = None
    else:
        return None
    dtype = value.dtype
    if dtype.kind not in _ARRAY_KINDS or dtype.fields is not None or dtype.metadata:
        return None  # (its str would leave the fields or the metadata out)
    if shape is not None and not value.flags.writeable:
        return dtype.str, shape, value.tobytes(), False
    return dtype.str, shape, value.tobytes()


def array_value(payload: tuple[Any, ...]) -> Any:
    """``array_payload``'s value again: an array of its own (C order; writable, or over the
    payload's bytes where the sender's was read-only), or the scalar."""
    import numpy as np

    flat = np.frombuffer(payload[2], payload[0])
    shape = payload[1]
    if shape is None:
        return flat[0]
    if len(payload) > 3:  # read-only, as pickle would give it
        return flat.reshape(shape)
    return flat.reshape(shape).copy()


def define_msg(frees: tuple[int, ...] | None, fn_id: int, fn_pickle: bytes) -> bytes:
    """Load a function (cloudpickled) as ``fn_id``."""
    return _dump((DEFINE, frees, fn_id, fn_pickle), 5)


def read_define(msg: tuple[Any, ...]) -> tuple[int, bytes]:
    _, _, fn_id, fn_pickle = msg
    return fn_id, fn_pickle


def put_msg(frees: tuple[int, ...] | None, ref_id: int,
            value: bytes | tuple[Any] | dict[int, Any] | list[Any]) -> bytes:
    """Keep a value in register ``ref_id``. ``value``: its pickle (loaded with the
    message's out-of-band buffers); or, for plain values (``is_plain``), ``(value,)``, the
    same for every worker, or ``{rank: value}``, each worker's own (a scatter, in one
    message where it took one a worker and a NOP for the frees); or ``[payload]``, a small
    numpy value as ``array_payload`` made it. Plain ones ride inside the
    marshalled message: one encoding each way, where a pickle inside a pickle took two (a
    put of an int then sync took 1.35x a call's round at N=2 that way, 1.08x this way:
    ``python benchmarks/put_values.py``)."""
    if type(value) is bytes:
        return _dump((PUT, frees, ref_id, value), 5)
    return dumps_plain((PUT, frees, ref_id, value), PLAIN)


def read_put(msg: tuple[Any, ...]
             ) -> tuple[int, bytes | tuple[Any] | dict[int, Any] | list[Any]]:
    """A PUT's ``(ref_id, value)``, ``value`` as ``put_msg`` took it."""
    _, _, ref_id, value = msg
    return ref_id, value


def get_msg(frees: tuple[int, ...] | None, req_id: int, ref_id: int) -> bytes:
    """Reply ``(req_id, OK, value)`` of register ``ref_id``, or ``(req_id, ERR, error)``.
    Marshalled, as a CALL: plain ints only."""
    return dumps_plain((GET, frees, req_id, ref_id), PLAIN)


def read_get(msg: tuple[Any, ...]) -> tuple[int, int]:
    _, _, req_id, ref_id = msg
    return req_id, ref_id


def sync_msg(frees: tuple[int, ...] | None, req_id: int) -> bytes:
    """Reply ``(req_id, OK, [(ref_id, error), ...])`` of the unreported errors (or an ack)."""
    return _dump((SYNC, frees, req_id), 5)


def shutdown_msg(frees: tuple[int, ...] | None, req_id: int) -> bytes:
    """Reply as SYNC does, then leave the loop."""
    return _dump((SHUTDOWN, frees, req_id), 5)


def read_request(msg: tuple[Any, ...]) -> int:
    """The req_id of a SYNC or SHUTDOWN."""
    _, _, req_id = msg
    return int(req_id)


def nop_msg(frees: tuple[int, ...] | None) -> bytes:
    """Nothing to run: carries frees to every worker."""
    return _dump((NOP, frees), 5)

_MAIN = b"__main__"


class _Local(threading.local):
    refs: list[Ref] | None = None
    """The Refs met while a call's arguments pickle (``dumps_with_refs``); None outside.
    A class default: a missing attribute's lookup raised, and cost 0.4 µs a pickle (timeit
    of ``getattr(_local, "refs", None)``)."""


_local = _Local()


OOB_MIN = 1 << 16
"""Buffers (numpy arrays, PickleBuffers) this large travel out of band, beside the pickle;
so do smaller ones that lie in a shared array (``sess.empty``)."""


class _LargeBytes:
    """A bytes object that pickles as a buffer (pickle writes bytes into the stream, which
    it cannot be told otherwise): out of band, it is copied into shared memory once."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        return bytes, (pickle.PickleBuffer(self.data),)


class SharedCopyError(ValueError):
    """A call's argument, or a value put, that would reach the workers as a copy of memory
    they share with the controller (``sess.empty``): their writes to it would be lost."""


def dumps(obj: object, buffers: list[pickle.PickleBuffer] | None = None,
          shared: bool = False) -> bytes:
    """Pickle for the other side: plain pickle where it is right, cloudpickle where needed,
    each reducer run once (see the module's docstring).

    With ``buffers``, large pickle-5 buffers are appended there instead of copied in (and
    large bytes objects that ``bytes_apart`` wrapped). ``shared``: ``obj`` is what a call
    or a put hands the workers, where a ``sess.empty`` array goes by reference: a view of
    one that pickle would copy raises SharedCopyError instead."""
    callback = None
    if buffers is not None:
        start = len(buffers)

        def callback(pb: pickle.PickleBuffer) -> bool:
            raw = pb.raw()
            # a shared array (sess.empty) goes by reference whatever its size, or the
            # workers' writes to it would be lost
            if raw.nbytes < OOB_MIN and not (_arena._shared_ranges and _arena.is_shared(raw)):
                return True
            if len(buffers) - start >= MAX_BUFFERS:  # the receiver maps each one apart
                if _arena._shared_ranges and _arena.is_shared(raw):
                    raise SharedCopyError(str(too_many_buffers(MAX_BUFFERS + 1)))
                return True  # the rest in band: copied, as any value may be
            buffers.append(pb)
            return False

    check = shared and bool(_arena._shared_ranges)
    first, table = _tables(check)
    refs = _local.refs
    mark = 0 if refs is None else len(refs)  # (a reducer may pickle too: keep what is not ours)
    try:
        data = _first_pass(obj, callback, first)
        if _MAIN not in data and not (_by_value and _names_by_value(data)):
            return data
    except SharedCopyError:
        raise
    except Exception:
        pass  # (_Divert: nothing of that object ran; else only reducers that allow it)
    if buffers is not None:
        del buffers[start:]
    if refs is not None:
        del refs[mark:]  # the second pass sees every Ref of this value again
    out = io.BytesIO()
    (_CheckedPickler if check else _CloudPickler)(out, table, callback).dump(obj)
    return out.getvalue()


def _names_by_value(data: bytes) -> bool:
    """Whether a first pass's pickle may name something of a module registered with
    ``cloudpickle.register_pickle_by_value`` (the standard pickler sends its functions and
    classes by reference, so the workers would run their own import of it, not the
    controller's): then cloudpickle's pass takes the value. A name that merely appears in
    the data costs that pass, never a wrong result."""
    return any(name.encode() in data for name in list(_by_value))


class _Reused:
    """A first pass's pickler, used again (making one costs about a third of a small
    object's pickle: benchmarks/dumps_cost.py), its memo dropped after each: it holds what
    it pickled."""

    __slots__ = ("callback", "out", "pickler")

    def __init__(self) -> None:
        self.out = io.BytesIO()
        self.pickler = pickle.Pickler(self.out, protocol=5, buffer_callback=self.forward)
        self.callback: Callable[[pickle.PickleBuffer], bool] | None = None

    def forward(self, pb: pickle.PickleBuffer) -> bool:
        return self.callback is None or self.callback(pb)  # (True: in band)


_idle: list[_Reused] = []  # one for each pickle under way at once, at most


def _first_pass(obj: object, callback: Callable[[pickle.PickleBuffer], bool] | None,
                table: _FirstTable) -> bytes:
    """``obj`` pickled by the standard pickler over ``table``: raises _Divert where the
    second pass must take it."""
    try:
        here = _idle.pop()
    except IndexError:  # (none idle: the first, or another thread's is under way)
        here = _Reused()
    here.callback = callback
    pickler = here.pickler
    pickler.dispatch_table = table
    try:
        pickler.dump(obj)
        return here.out.getvalue()
    finally:
        pickler.memo = {}  # (clear_memo keeps its table's size: after a large pickle, every
        here.out.seek(0)   # later one would pay to clear that whole table)
        here.out.truncate()
        here.callback = None
        _idle.append(here)


class _CloudPickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle with ``_reducers`` over it, its table one dict (cloudpickle's ChainMap
    cost a Python call for each object it looked up): a tensor takes the same way whichever
    pickler met it (without them, torch pickled a tensor over a ``sess.empty`` array as a
    copy as soon as another argument came from ``__main__``)."""

    def __init__(self, out: io.BytesIO, table: dict[type, Any], callback: Any) -> None:
        self.dispatch_table = table  # before: the C pickler reads it as it is made (once
        super().__init__(out, protocol=5, buffer_callback=callback)  # made, it kept its own)


class _CheckedPickler(_CloudPickler):
    """The second pass where shared memory is checked: a numpy subclass's array is not in
    the table (it names exact types), so it is looked at here, as the first pass does."""

    def reducer_override(self, obj: Any) -> Any:
        if _ndarray_subclass(type(obj)) and in_shared(obj):
            raise _subclass_error(obj)
        return super().reducer_override(obj)


class _Divert(Exception):
    """The first pass met an object that only cloudpickle's may take, before any of its
    reducers ran."""


def _divert(obj: Any) -> Any:
    raise _Divert


_REDUCE_EX = operator.methodcaller("__reduce_ex__", 5)
"""What pickle calls for a type that no table names, called from C as pickle does."""
_BY_NAME = operator.attrgetter("__qualname__")
"""A class's reduction, where its metaclass is not ``type`` (an ABC's, an Enum's, numpy's
dtype): the name that pickle then saves it by, as it does a class no table names. A miss
in the table would cost a KeyError raised in Python for each such class pickled (a
Fraction's pickle took 3.5 µs with it, 2.5 without: ``python benchmarks/dumps_cost.py``)."""
_REDUCER_NAMES = ("__reduce_ex__", "__reduce__", "__getstate__", "__getnewargs_ex__",
                  "__getnewargs__", "__getattr__", "__getattribute__", "__class__", "__dict__")
"""What pickle's reduction of an instance looks up on it (and may so call)."""
_C_KINDS = (types.WrapperDescriptorType, types.MethodDescriptorType,
            types.BuiltinFunctionType, types.ClassMethodDescriptorType,
            types.GetSetDescriptorType, types.MemberDescriptorType)
_ABSENT = object()
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made at run time (C's are named by pickle)
_OBJECT_REDUCE_EX, _OBJECT_REDUCE = object.__dict__["__reduce_ex__"], object.__dict__["__reduce__"]
_PURE = frozenset(sys.stdlib_module_names) | {"numpy", "torch"}
"""Packages whose reducers give the same again (the standard library's, and those of the
arrays this module knows); any other Python code's may not, and takes the second pass."""


class _FirstTable(dict):  # type: ignore[type-arg]
    """The first pass's dispatch table: ``_reducers``, then each type met as
    ``_first_reducer`` judges it, once; with ``check``, a numpy subclass's checked first."""

    def __init__(self, reducers: dict[type, Any], check: bool) -> None:
        super().__init__(reducers)
        self.check = check

    def __missing__(self, kind: type) -> Any:
        reduce = _first_reducer(kind)
        if self.check and _ndarray_subclass(kind):
            reduce = functools.partial(_reduce_subclass_checked, reduce)
        self[kind] = reduce
        return reduce


def _ndarray_subclass(kind: type) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and kind is not np.ndarray and issubclass(kind, np.ndarray)


def _reduce_subclass_checked(then: Callable[[Any], Any], a: Any) -> Any:
    """An array of a numpy subclass (np.matrix, a masked array, the user's own), reduced by
    ``then``, unless it lies in shared memory: numpy pickles a subclass's elements into the
    pickle, so the workers would write to a copy."""
    if in_shared(a):
        raise _subclass_error(a)
    return then(a)


def _subclass_error(a: Any) -> SharedCopyError:
    return SharedCopyError(
        f"an array of numpy subclass {type(a).__name__} over a sess.empty() array would reach "
        "the workers as a copy (numpy pickles a subclass's elements by value), and their "
        "writes would be lost: "
        "pass np.asarray(x), a plain view that goes by reference, or np.array(x) to send a "
        "copy on purpose"
    )


def _first_reducer(kind: type) -> Any:
    """How the first pass reduces an instance of ``kind``: ``_REDUCE_EX`` (or the C
    ``__reduce__`` it would call) where every reducer that would run is C's, ``_PURE``'s or
    unison's own (all give the same again: ``ref_reduce``'s list is cleared before the
    second pass); ``_divert`` for the rest; ``_BY_NAME`` for a class of a metaclass (pickled
    by name, which runs nothing of it). Raises _Divert for a class that cloudpickle sends by
    value (a ``__main__`` one: so that its instance takes one pass, not two)."""
    try:
        registered = copyreg.dispatch_table.get(kind)
        if registered is not None:
            return registered if _pure(registered) else _divert
        if issubclass(kind, type):
            return _BY_NAME
        if _module_of(kind).startswith("unison."):
            return _REDUCE_EX
        if kind.__flags__ & _HEAPTYPE and (_should_pickle_by_reference is None
                                           or not _should_pickle_by_reference(kind)):
            raise _Divert  # not kept in the table, which would hold a class made at run time
        if kind.__flags__ & _HEAPTYPE:  # a C base's reduction (a set's, a deque's) may call
            base = next(k for k in kind.__mro__ if not k.__flags__ & _HEAPTYPE)  # any method
            if base is not object and not issubclass(base, BaseException) and any(
                    isinstance(v, types.FunctionType) and not _pure(v)  # overridden over it
                    for k in kind.__mro__ if k.__flags__ & _HEAPTYPE for v in vars(k).values()):
                return _divert
        names = _REDUCER_NAMES + (("__iter__",) if issubclass(kind, list) else ()) + (
            ("items",) if issubclass(kind, dict) else ())  # (what their reduction calls)
        found = {name: next((k.__dict__[name] for k in kind.__mro__ if name in k.__dict__),
                            _ABSENT) for name in names}
        if not all(attr is _ABSENT or _pure(attr) for attr in found.values()):
            return _divert
    except _Divert:
        raise
    except Exception:
        return _divert
    reduce = found["__reduce__"]
    if (found["__reduce_ex__"] is _OBJECT_REDUCE_EX and type(reduce) is types.MethodDescriptorType
            and reduce is not _OBJECT_REDUCE and not kind.__flags__ & _HEAPTYPE):  # (a class
        # made in Python may be given another __reduce__ later: _REDUCE_EX looks it up)
        return reduce  # what object.__reduce_ex__ calls, without it (datetime's: faster)
    return _REDUCE_EX


def _pure(attr: Any) -> bool:
    """Whether ``attr`` (a reducer, or what an instance's reduction looks up) is C's or
    ``_PURE``'s."""
    if type(attr) in _C_KINDS:
        return True
    attr = getattr(attr, "__func__", attr)  # (a classmethod, a staticmethod)
    return (isinstance(attr, types.FunctionType)
            and _module_of(attr).partition(".")[0] in _PURE)


def _module_of(obj: Any) -> str:
    module = getattr(obj, "__module__", None)
    return module if isinstance(module, str) else ""


def bytes_apart(obj: Any) -> Any:
    """``obj`` with a large bytes object wrapped to go out of band in ``dumps`` with
    buffers: ``obj`` itself (a value put, a result), or an item of it where it is a tuple
    (a call's positional arguments, a result). Only there: a list rebuilt would not be the
    object another part of ``obj`` may hold. One wrapper for each bytes object, so that one
    held twice still arrives as one object."""
    if type(obj) is tuple:
        for v in obj:
            if type(v) is bytes and len(v) >= OOB_MIN:
                wrapped: dict[int, _LargeBytes] = {}
                return tuple(wrapped.setdefault(id(v), _LargeBytes(v))
                             if type(v) is bytes and len(v) >= OOB_MIN else v for v in obj)
        return obj
    return _LargeBytes(obj) if type(obj) is bytes and len(obj) >= OOB_MIN else obj


_by_value: set[str] = getattr(getattr(cloudpickle, "cloudpickle", None),
                              "_PICKLE_BY_VALUE_MODULES", set())
_Tables = tuple["_FirstTable", dict[type, Any]]
_Made = tuple[dict[type, Any], set[str], dict[tuple[bool, bool], _Tables]]
_made: _Made | None = None
"""copyreg's table and the by-value modules as the tables were made from them, and the tables
(by torch imported, ``check``): one object, swapped whole, so that no thread takes tables
made from another snapshot than the one it compared."""


def _tables(check: bool) -> tuple[_FirstTable, dict[type, Any]]:
    """The dispatch tables of the two passes: the first's, and copyreg's and cloudpickle's
    with ``_reducers(check)`` over them. Made again when a reducer is registered, or a
    module by value, since."""
    global _made
    made = _made
    if made is None or made[0] != copyreg.dispatch_table or made[1] != _by_value:
        made = _made = dict(copyreg.dispatch_table), set(_by_value), {}
    key = ("torch" in sys.modules, check)
    tables = made[2].get(key)
    if tables is None:
        reducers = _reducers(check)
        first = _FirstTable(reducers, check)
        table = {**made[0], **cloudpickle.Pickler._dispatch_table,
                 types.CodeType: reduce_code, **reducers}
        tables = made[2][key] = first, table
    return tables


def _reducers(check: bool) -> dict[type, Any]:
    """How this module pickles some types: CPU torch tensors as numpy arrays (once torch is
    imported); with ``check``, numpy arrays and tensors refused where a copy of shared
    memory would go (``in_shared``, ``_copy_error``)."""
    reducers: dict[type, Any] = {}
    if "torch" in sys.modules:
        import torch

        reducers[torch.Tensor] = _reduce_tensor_checked if check else _reduce_tensor
    np = sys.modules.get("numpy")
    if check and np is not None:
        reducers[np.ndarray] = _reduce_array_checked
    return reducers


def _reduce_array_checked(a: Any) -> Any:
    """A numpy array as pickle reduces it, unless pickle would copy shared memory: only a
    C or Fortran contiguous array goes out of band (by reference where shared), and only
    where its dtype lets numpy hand over a buffer (not datetimes, timedeltas, objects)."""
    if not a.flags.forc and in_shared(a):
        raise _copy_error("a non-contiguous view of a sess.empty() array", "np.array(x)")
    reduced = a.__reduce_ex__(5)
    if type(reduced[1][0]) is not pickle.PickleBuffer and in_shared(a):  # pickled in band
        raise SharedCopyError(
            f"a sess.empty() array of dtype {a.dtype} would reach the workers as a copy "
            "(numpy pickles datetime64, timedelta64 and object elements by value), and their "
            "writes would be lost: pass a view of it as plain numbers, a.view('i8') (or "
            "a.view(np.uint8) for a structured dtype), and view it back in the worker "
            "(x.view(dtype)); or np.array(a) to send a copy on purpose"
        )
    return reduced


def _copy_error(what: str, copy: str) -> SharedCopyError:
    return SharedCopyError(
        f"{what} would reach the workers as a copy, and their writes would be lost: pass "
        f"a contiguous slice, or {copy} to send a copy on purpose"
    )


def _touches_shared(addr: int, shape: tuple[int, ...], strides: tuple[int, ...],
                    itemsize: int) -> bool:
    low = high = addr
    for n, step in zip(shape, strides):
        if step < 0:
            low += step * (n - 1)
        else:
            high += step * (n - 1)
    return _arena.touches_shared(low, high + itemsize - low)


def in_shared(obj: Any) -> bool:
    """Whether ``obj`` is a numpy array or CPU tensor whose elements touch memory shared
    with the workers (``sess.empty``). Costs a look at a type where nothing is shared."""
    if not _arena._shared_ranges:
        return False
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        return bool(obj.nbytes) and _touches_shared(
            obj.__array_interface__["data"][0], obj.shape,
            obj.strides, obj.itemsize)
    torch = sys.modules.get("torch")
    if (torch is None or not isinstance(obj, torch.Tensor) or obj.device.type != "cpu"
            or obj.layout is not torch.strided or not obj.numel()):
        return False
    size = obj.element_size()
    return _touches_shared(obj.data_ptr(), tuple(obj.shape),
                           tuple(step * size for step in obj.stride()), size)


def _reduce_tensor_checked(t: Any) -> Any:
    return _reduce_tensor(t, True)


def _reduce_tensor(t: Any, check: bool = False) -> Any:
    """A CPU tensor as a numpy array over its memory where it can be; ``check``: refused
    where that is not so and its memory is shared (``_refuse_tensor``), as it would be
    copied."""
    import torch

    simple = (type(t) is torch.Tensor and t.device.type == "cpu" and not t.requires_grad
              and t.layout is torch.strided and not t.is_quantized
              and not t.is_neg() and not t.is_conj()
              and not t.__dict__)  # attributes set on it: torch's pickling keeps them
    if simple:
        try:
            if not t.is_contiguous():  # channels-last: its memory in order, as an array,
                for layout, to_memory, back in (  # and how to see its dimensions again
                        (torch.channels_last, (0, 2, 3, 1), (0, 3, 1, 2)),
                        (torch.channels_last_3d, (0, 2, 3, 4, 1), (0, 4, 1, 2, 3))):
                    if t.dim() == len(back) and t.is_contiguous(memory_format=layout):
                        return (tensor_from_numpy, (t.permute(*to_memory).numpy(), back))
                view = t.numpy()  # (its strides kept: a transpose arrives as one)
                if view.flags.f_contiguous:
                    return (tensor_from_numpy, (view,))
                if check:
                    _refuse_tensor(t, "a non-contiguous view of a sess.empty() array")
            return (tensor_from_numpy, (t.contiguous().numpy(),))
        except (TypeError, RuntimeError):
            pass  # a dtype numpy lacks (bfloat16): torch's own pickling
    if check:
        _refuse_tensor(t, "a tensor over a sess.empty() array that torch pickles itself (it "
                          "requires grad, or numpy lacks its dtype)")
    return t.__reduce_ex__(5)


def _refuse_tensor(t: Any, what: str) -> None:
    """Raise where a CPU tensor that would be copied has its elements in shared memory."""
    if in_shared(t):
        raise _copy_error(what, "t.clone()")


def tensor_from_numpy(arr: Any, permute: tuple[int, ...] | None = None) -> Any:
    """A CPU tensor over a received array's memory (copy-on-write shared memory: no copy);
    ``permute``: a channels-last tensor's dimensions, from its memory's order."""
    import torch

    t = torch.from_numpy(arr)
    return t if permute is None else t.permute(*permute)


def dumps_with_refs(obj: object) -> tuple[bytes, list[pickle.PickleBuffer], list[Ref]]:
    """Pickle call arguments out of band and say which Refs they hold, for checking."""
    refs: list[Ref] = []
    buffers: list[pickle.PickleBuffer] = []
    outer, _local.refs = _local.refs, refs  # (a reducer may send a call)
    try:
        return dumps(obj, buffers, shared=True), buffers, refs
    finally:
        _local.refs = outer


def loads(data: bytes | memoryview | Reply, buffers: list[Any] | None = None) -> Any:
    """Unpickle a message; a channel's ``Reply`` brings its own out-of-band buffers."""
    if isinstance(data, tuple):
        data, buffers = data
    return pickle.loads(data, buffers=buffers)


def reduce_code(code: types.CodeType) -> tuple[Any, ...]:
    """cloudpickle's reduction of a code object, kept in its own file (cloudpickle writes
    "<dynamic-code>"), so that tracebacks, stacks() and timeouts name the user's file: for
    a function's (session.fncache) and for an argument's, a script class's method. Before
    (an audit, issue 9, forty-ninth pass), an argument's showed "<dynamic-code>" and no line."""
    make, args = cloudpickle.cloudpickle._code_reduce(code)
    return code_in_file, (code.co_filename, make, args)


def code_in_file(filename: str, make: Callable[..., types.CodeType],
                 args: tuple[Any, ...]) -> types.CodeType:
    """A code object as cloudpickle rebuilds it, back in its own file (see
    session.fncache). Here, in a module every worker has imported, because unpickling a
    function by value imports the module of this: from unison.session it cost each worker
    75 ms (asyncio and the rest) at the session's first function of a script."""
    return make(*args).replace(co_filename=filename)


def ref_reduce(ref: Ref) -> tuple[object, tuple[int]]:
    """How a Ref pickles: as a lookup, by id, in the register file of the worker that reads it."""
    refs = _local.refs
    if refs is None:
        raise TypeError(
            "a unison Ref can only travel as an argument of a call in the session that made it; "
            "use ref.get() or ref.gather() to fetch its value"
        )
    refs.append(ref)
    global _lookup
    if _lookup is None:  # once: an import statement took 0.6 us for each Ref pickled
        from unison.worker import lookup  # the receiving worker's register file

        _lookup = lookup
    return (_lookup, (ref._id,))


_lookup: Callable[[int], Any] | None = None


# -- errors across the process boundary -------------------------------------------------------


def pack_error(exc: BaseException, where: str,
               interrupts: bool = False) -> tuple[bytes | None, str, str, str, str]:
    """A worker-side exception as (blob, type, message, traceback, where).

    The blob always unpickles (see unpack_error): it holds the exception pickled as well as
    it can be (plainly, else by value with cloudpickle, else rebuilt from its class, args and
    attributes), beside a RemoteError that stands in for it where that cannot be loaded.

    It never raises, whatever the user's exception does (a worker would die of its own
    error report, WorkerDied where a WorkerError was due): a ``str()``, ``repr()`` or
    traceback that raises, even SystemExit, gives a placeholder; every text is an exact
    str (a str subclass of the script's would not pickle); failing all that, the error
    names the exception's type alone. ``interrupts``: a KeyboardInterrupt met here is
    raised on (worker 0 inline: it is the controller's Ctrl-C, see worker.serve)."""
    try:
        return _pack_error(exc, where, interrupts)
    except BaseException as broken:
        _interrupt(broken, interrupts)
        try:
            type_name = _exact(type(exc).__qualname__)
        except BaseException as again:
            _interrupt(again, interrupts)
            type_name = "BaseException"
        message = (f"<this {type_name} could not be reported: "
                   f"{type(broken).__name__} while packing it>")
        return (None, type_name, message, "", _exact(where) if isinstance(where, str) else "?")


def _pack_error(exc: BaseException, where: str,
                interrupts: bool) -> tuple[bytes | None, str, str, str, str]:
    type_name = _exact(type(exc).__qualname__)
    try:
        tb = _exact("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    except BaseException as broken:  # a user exception whose str() or repr() itself raises
        _interrupt(broken, interrupts)
        tb = f"(the traceback could not be formatted: {type(broken).__name__})\n"
    exc.__traceback__ = None  # frames hold locals that may not pickle, and they are in tb
    message = safe_str(exc, interrupts)
    attributes = {_exact(str(k)): safe_repr(v, interrupts)
                  for k, v in _attributes(exc).items()}
    stand_in = RemoteError(type_name, message, tb, attributes)
    blob: bytes | None = None
    for make in (dumps, _dumps_by_value, _dumps_rebuilt):
        try:
            candidate = make(exc)
            if _loads_exception(candidate, _beyond_error) is not None:
                blob = candidate
                break
        except BaseException as broken:  # a __reduce__ may raise anything, even SystemExit
            _interrupt(broken, interrupts)
            continue
    return (pickle.dumps((blob, stand_in), protocol=5), type_name, message, tb, _exact(where))


def safe_str(value: object, interrupts: bool = False) -> str:
    """``str(value)`` as an exact str, or a placeholder where it raises (anything but a
    KeyboardInterrupt with ``interrupts``, see pack_error): for error reports, which must
    not fail on the value they report."""
    try:
        return _exact(str(value))
    except BaseException as broken:
        _interrupt(broken, interrupts)
        return f"<str() of this {type(value).__qualname__} failed: {type(broken).__name__}>"


def _exact(text: str) -> str:
    """An exact str of ``text``, a str or a subclass's instance (``str.__str__`` copies
    without calling the subclass's own methods): a subclass from the user's script pickles
    by reference, which no controller can load."""
    return text if type(text) is str else str.__str__(text)


def _interrupt(exc: BaseException, interrupts: bool) -> None:
    """Raise ``exc`` on if it is the controller's Ctrl-C (worker 0 inline). A worker
    process ignores SIGINT, so there a KeyboardInterrupt is the user code's, an error."""
    if interrupts and isinstance(exc, KeyboardInterrupt):
        raise exc


def unasked(error: tuple[Any, ...]) -> tuple[Any, ...]:
    """A packed ``unison.Cancelled`` that the function raised of itself, with no
    ``ref.cancel()`` of its call behind it (a sixth field): the controller reports it as an
    error, where an asked one is a CancelledError."""
    return (*error[:5], True)


def was_unasked(error: tuple[Any, ...]) -> bool:
    return len(error) > 5 and error[5] is True


def unpack_error(error: tuple[Any, ...],
                 signalled: Callable[[BaseException], bool] = lambda exc: False,
                 ) -> BaseException:
    """The worker's exception, rebuilt; or the RemoteError standing in for it, also where
    rebuilding it here raises anything, SystemExit too (a ``__reduce__`` that exits off a
    worker). Before (an audit, issue 9, forty-ninth pass), such a SystemExit got out of
    ``run`` and ``sync``, the rank's error was lost, and a script that did not catch it
    ended with status 0 and no word. ``signalled`` tells an exception of the controller's
    own (Ctrl-C, a signal handler's), which is raised on."""
    packed, type_name, message = error[0], error[1], error[2]
    stand_in: BaseException = RemoteError(type_name, message, error[3] if len(error) > 3 else "")
    if packed is not None:
        try:
            blob, stand_in = pickle.loads(packed)
        except BaseException as broken:
            if signalled(broken):
                raise
            blob = None
        if blob is not None:
            exc = _loads_exception(blob, signalled)
            if exc is not None:
                return exc
    return stand_in


def _beyond_error(exc: BaseException) -> bool:
    """pack_error's check: what is not an Exception goes on to its own handler."""
    return not isinstance(exc, Exception)


def _loads_exception(blob: bytes, signalled: Callable[[BaseException], bool]
                     ) -> BaseException | None:
    try:
        obj = pickle.loads(blob)
    except BaseException as broken:
        if signalled(broken):
            raise
        return None
    return obj if isinstance(obj, BaseException) else None


def _dumps_by_value(exc: BaseException) -> bytes:
    out: bytes = cloudpickle.dumps(exc, protocol=5)
    return out


def _dumps_rebuilt(exc: BaseException) -> bytes:
    """For an exception whose ``__init__`` does not take its ``args`` back (so that pickle's
    ``cls(*args)`` fails): its class, args and attributes, rebuilt without calling
    ``__init__``. An attribute that will not pickle fails it (RemoteError then shows every
    attribute's repr), rather than arriving silently without it."""
    return dumps(_Rebuild(type(exc), exc.args, _attributes(exc)))


class _Rebuild:
    """Pickles as a call that rebuilds an exception from its parts."""

    def __init__(self, cls: type[BaseException], args: tuple[Any, ...],
                 state: dict[str, Any]) -> None:
        self.parts = (cls, args, state)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_exception, self.parts)


def _rebuild_exception(cls: type[BaseException], args: tuple[Any, ...],
                       state: dict[str, Any]) -> BaseException:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


def _attributes(exc: BaseException) -> dict[str, Any]:
    return dict(getattr(exc, "__dict__", None) or {})


def safe_repr(value: object, interrupts: bool = False) -> str:
    """``repr(value)``, at most 1,000 characters, as safe_str gives ``str()``."""
    try:
        text = _exact(repr(value))
    except BaseException as broken:
        _interrupt(broken, interrupts)
        return f"<repr() of this {type(value).__qualname__} failed: {type(broken).__name__}>"
    return text if len(text) <= 1000 else text[:1000] + "..."


_CLASS_KEEP = frozenset({
    "__module__", "__doc__", "__qualname__", "__dict__", "__weakref__", "_abc_impl",
    "__annotations__", "__annotate__", "__annotate_func__", "__annotations_cache__",
})
"""What a class built by cloudpickle may hold that its pickled state never carries: never
deleted (with any descriptor of a slot, ``__dict__`` or ``__weakref__``)."""
_forget_deleted = False
_built: weakref.WeakSet[type] = weakref.WeakSet()
"""The classes cloudpickle built in this process from a pickle (its skeletons)."""


def _own_classes_stay() -> None:
    """cloudpickle gives a class pickled by value a tracker id, and a later pickle of it
    with that id, unpickled in the process that made the class, set the state it carried
    on the original: fetching a worker's object of a script class reverted the controller's
    class to what the workers got (a method or attribute changed since came back old), and
    a change a worker made to its copy landed in the controller's. Now state is set only
    on a class that cloudpickle built here from a pickle (a worker's copy, updated by each
    later one). Pickled back, each wrapper names cloudpickle's own function. (cloudpickle
    3.0 on, which keeps both functions in ``cloudpickle.cloudpickle``: pyproject's floor.)"""
    from cloudpickle import cloudpickle as module

    lookup = getattr(module, "_lookup_class_or_track", None)
    setstate = getattr(module, "_class_setstate", None)
    if lookup is None or setstate is None or getattr(setstate, "__wrapped__", None):
        return
    plain = (type, abc.ABCMeta)
    descriptors = (types.MemberDescriptorType, types.GetSetDescriptorType)

    @functools.wraps(lookup)
    def lookup_class_or_track(class_tracker_id: Any, class_def: type) -> type:
        _built.add(class_def)  # before it is tracked: another thread may find it at once
        found: type = lookup(class_tracker_id, class_def)
        if found is not class_def:
            _built.discard(class_def)
        return found

    @functools.wraps(setstate)
    def class_setstate(obj: Any, state: Any) -> Any:
        if obj not in _built:
            return obj  # this process's own class: it is the current one
        obj = setstate(obj, state)
        if (_forget_deleted and type(obj) in plain and isinstance(state, tuple)
                and isinstance(state[0], dict)):  # (see forget_deleted_class_attributes)
            given = state[0]
            for name, value in list(obj.__dict__.items()):
                if (name not in given and name not in _CLASS_KEEP
                        and not isinstance(value, descriptors)):
                    try:
                        delattr(obj, name)
                    except (AttributeError, TypeError):
                        pass
        return obj

    module.__dict__["_lookup_class_or_track"] = lookup_class_or_track
    module.__dict__["_class_setstate"] = class_setstate


def forget_deleted_class_attributes() -> None:
    """Make a class that cloudpickle rebuilds here from a later pickle (the same class
    tracker id: it reuses the class it built first) lose the attributes that its new state
    no longer has. cloudpickle only sets what the state holds, so a method or attribute
    deleted from a script's class stayed on the workers, and they ran it. Only in a worker
    process, and only for classes whose metaclass is ``type`` or ``ABCMeta`` (an enum or
    another metaclass adds attributes that the state leaves out: left as cloudpickle
    builds them)."""
    global _forget_deleted
    _forget_deleted = True


_own_classes_stay()
