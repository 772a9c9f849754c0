"""Which functions the workers hold, and whether their copy still matches the controller's.

A function is sent to the workers once (DEFINE) and later calls name it by id. That is only
right while the workers' copy behaves as the controller's would at the moment of the call:

    by reference   (a function or class that an importable module holds under its name, as
                   cloudpickle decides it) the workers import it: always current
                   (``sess.call(Model, path)`` sends no DEFINE per call)
    by value       (a lambda, closure, ``__main__`` function, one its module's name no longer
                   holds: under a decorator's wrapper; one of a module registered with
                   ``cloudpickle.register_pickle_by_value`` or not in ``sys.modules``)
                   current only while everything it captured (closure cells, the globals its
                   code names, defaults, and the same for any by-value function or module
                   among them) is what was sent:
        all immutable  -> kept by strong reference and compared by identity (cheap, and an id
                          can never be reused while we hold the object)
        else           -> pickled again at every call and compared byte for byte (a dict or an
                          array changed in place is seen; an unchanged one costs a pickle)
    anything else  (bound methods, callable objects, partials, a class of ``__main__`` or
                   made on the fly)  pickled and sent every time

Nothing here is guessed from ``id()`` alone: a stale copy on the workers is impossible.
"""

from __future__ import annotations

import collections
import io
import types
import warnings
from collections.abc import Callable
from typing import Any

import cloudpickle

from unison.protocol import in_shared, reduce_code
from unison.session.signals import raised_by_a_signal

try:  # cloudpickle's own choice of by reference or by value (2.0 on): see _by_reference
    from cloudpickle.cloudpickle import _should_pickle_by_reference as _cloudpickle_by_reference
except ImportError:
    _cloudpickle_by_reference = None

__all__ = ["FunctionCache"]

BIG_CAPTURE = 1 << 20  # a re-sent by-value function this large earns a warning

_CACHEABLE = (types.FunctionType, types.BuiltinFunctionType)
_KEYS = (*_CACHEABLE, type)  # what an entry may be kept for (a class: by reference only)
_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes, range,
                    type(Ellipsis), types.CodeType})
_MISSING = object()
_MAX_TUPLE = 64  # larger tuples are compared by pickle instead of walked


class _Plan:
    """What to look at, at each call, to prove that a by-value function would pickle the
    same: for it and every by-value function it reaches, its code, defaults and attribute
    dict (and keyword-only defaults: _KwPlan); every closure cell's object; every global
    it names. All of them immutable, so the same objects pickle the same (held here, so no
    address can be reused)."""

    __slots__ = ("cells", "funcs", "names")

    def __init__(self) -> None:
        self.funcs: list[tuple[Any, types.CodeType, Any]] = []
        self.cells: list[tuple[Any, Any]] = []
        self.names: list[tuple[dict[str, Any], str, Any]] = []

    def holds(self) -> bool:
        """True while everything is what it was when the plan was made."""
        for fn, code, defaults in self.funcs:
            if fn.__code__ is not code or fn.__defaults__ is not defaults or fn.__dict__:
                return False
        for cell, value in self.cells:
            try:
                if cell.cell_contents is not value:
                    return False
            except ValueError:  # an empty cell
                if value is not _MISSING:
                    return False
        for names, name, value in self.names:  # noqa: SIM110 (a plain loop: the hot path)
            if names.get(name, _MISSING) is not value:
                return False
        return True


class _KwPlan(_Plan):
    """A plan where some function takes keyword-only arguments: its ``__kwdefaults__``, None
    when the plan was made (a dict, even empty, may change in place: compared by pickle),
    must still be None. Checked only here, so that other plans pay nothing for it: where
    the code takes none (the code is checked), keyword-only defaults change no call. (A
    loop and a call more than _Plan's own, for these functions alone.)"""

    __slots__ = ()

    def holds(self) -> bool:
        """_Plan.holds, and every function's keyword-only defaults still None."""
        for fn, _, _ in self.funcs:
            if fn.__kwdefaults__ is not None:
                return False
        return _Plan.holds(self)


class _Entry:
    __slots__ = ("blob", "fn_id", "plan")

    def __init__(self, fn_id: int, plan: _Plan | None, blob: bytes | None) -> None:
        self.fn_id = fn_id
        self.plan = plan  # immutable captures, checked by identity
        self.blob = blob  # the pickle sent, when some capture is mutable


class FunctionCache:
    """Function -> id on the workers, for the functions whose copy there is provably current.

    Not thread-safe: the session calls it under its send lock."""

    def __init__(self, size: int = 512) -> None:
        self._size = size
        self._entries: collections.OrderedDict[Callable[..., Any], _Entry] = (
            collections.OrderedDict()
        )
        self._warned: set[Any] = set()
        self.last: Callable[..., Any] | None = None
        """The function the last lookup found current, else None; ``last_id`` its id and
        ``last_plan`` what proves its copy current at each call (None: nothing, as for a
        module-level function, sent by reference; else a script's function's plan). The
        session's send tests ``fn is last`` and the plan before it calls ``lookup``: a
        round that calls the same function again then touches no entry, no LRU order and
        no frame of this class (in a round trip at N=2, ``lookup`` cost 0.8 µs:
        docs/benchmarks.md, "Issue 9, eighteenth pass"). It stays last in the LRU order."""
        self.last_id = 0
        self.last_plan: _Plan | None = None

    def lookup(self, fn: Callable[..., Any]) -> tuple[int, bytes | None]:
        """``(fn_id, None)`` if the workers' copy is current; else ``(0, pickle or None)``,
        with the pickle when it was already made to compare (so it is made once)."""
        self.last = None
        entry = self._entries.get(fn) if isinstance(fn, _KEYS) else None
        if entry is None:
            return 0, None
        plan = entry.plan
        if entry.blob is not None:  # something captured is mutable: compare the pickles
            blob = pickle_function(fn)
            if blob != entry.blob:
                return 0, blob
        elif plan is None or plan.holds():
            self.last, self.last_id, self.last_plan = fn, entry.fn_id, plan
        else:
            return 0, None
        self._entries.move_to_end(fn)
        return entry.fn_id, None

    def pickle(
        self, fn: Callable[..., Any], blob: bytes | None = None
    ) -> tuple[bytes, _Entry | None]:
        """``fn``'s pickle for a DEFINE, and what will prove the workers' copy current (None:
        it is not kept, but sent at every call). The proof is taken first: a capture that
        another thread changes while the DEFINE waits for room in the ring then fails it at
        the next call (a resend); one taken after the send would hold the new value beside
        the old pickle, for good. ``blob``, a pickle ``lookup`` made before the proof, is
        kept only where that pickle itself is the proof (compared at each call)."""
        proof = self._prove(fn)
        if blob is None or proof is None or proof.blob is None:
            blob = pickle_function(fn)
        if proof is not None:
            if proof.blob is not None:
                proof.blob = blob
            elif proof.plan is None and not isinstance(fn, types.BuiltinFunctionType) and (
                    not _by_reference(fn)):
                proof = None  # its module let go of it meanwhile: it may have gone by value
        return blob, proof

    def store(
        self, fn: Callable[..., Any], fn_id: int, blob: bytes, proof: _Entry | None
    ) -> tuple[list[int], bool]:
        """Remember that the workers now hold ``fn`` as ``fn_id``, sent as ``blob`` with the
        ``proof`` that ``pickle`` gave. Returns the ids the workers may drop (the replaced
        definition, and the least recently used one past the cache's size), and whether
        ``fn`` was re-sent, replacing one (``warn_big`` then, once the ids are queued)."""
        self.last = None  # this entry goes last now, and one may go
        if proof is None:
            return [], False
        old = self._entries.pop(fn, None)
        drop = [] if old is None else [old.fn_id]
        proof.fn_id = fn_id
        self._entries[fn] = proof
        if len(self._entries) > self._size:
            drop.append(self._entries.popitem(last=False)[1].fn_id)
        return drop, old is not None

    def _prove(self, fn: Callable[..., Any]) -> _Entry | None:
        """What proves a copy of ``fn`` current, from what it captures now (no id yet)."""
        if not self.cacheable(fn):
            return None
        if _by_reference(fn):
            return _Entry(0, None, None)
        plan = _Plan()
        if _captures(fn, plan, set()):  # (a builtin: nothing to check)
            if any(code.co_kwonlyargcount for _, code, _ in plan.funcs):
                plan.__class__ = _KwPlan
            return _Entry(0, plan if plan.funcs or plan.cells or plan.names else None, None)
        return _Entry(0, None, b"")  # compared with its pickle, set once made

    @staticmethod
    def cacheable(fn: object) -> bool:
        return isinstance(fn, _CACHEABLE) or (isinstance(fn, type) and _by_reference(fn))

    def warn_big(self, fn: Callable[..., Any], size: int) -> None:
        """Warn (once per function) that ``fn``, re-sent, pickles to ``size`` bytes, where
        that is over BIG_CAPTURE."""
        if size <= BIG_CAPTURE:
            return
        key = getattr(fn, "__code__", fn)
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(
            f"{getattr(fn, '__qualname__', fn)!r} was sent to the workers again because "
            f"something it captures changed, and its pickle is {size / 2**20:.1f} MiB. Large "
            "data captured by a function travels at every change: put it on the workers once "
            "with sess.put(value) and pass the Ref as an argument instead.",
            RuntimeWarning, stacklevel=3,
        )


def pickle_function(fn: Callable[..., Any]) -> bytes:
    """The function as the workers receive it (raises TypeError if it cannot be pickled)."""
    out = io.BytesIO()
    try:
        _Pickler(out, protocol=5).dump(fn)
    except Exception as exc:
        if raised_by_a_signal(exc):  # a signal handler's, not the function's fault
            raise
        raise TypeError(f"the function {fn!r} cannot be pickled for the workers: {exc}") from exc
    return out.getvalue()


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle, keeping each code object's file name (cloudpickle writes
    "<dynamic-code>"), so that tracebacks, stacks() and timeouts name the user's file; and
    refusing a ``sess.empty`` array the function reaches, which would arrive as a copy."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is types.CodeType:
            return reduce_code(obj)
        if in_shared(obj):
            raise TypeError(
                "a sess.empty() array must be passed as an argument: captured by the "
                "function it reaches the workers as a copy, and their writes would be lost"
            )
        return super().reducer_override(obj)


def _by_reference(obj: Any) -> bool:
    """Whether cloudpickle sends ``obj`` (a function, class or module) as an import of its
    module, so that the workers' copy is always current. Asked of cloudpickle itself, whose
    choice it is: not a module's function that its module no longer holds under its name
    (under a decorator's wrapper of the same name, a class made by ``type(...)``), nor one of
    a module not in ``sys.modules`` (``types.ModuleType(...)``) or registered with
    ``cloudpickle.register_pickle_by_value``. Those go by value, with what they captured
    then, and must be proved current like any other. In doubt (an error, or a cloudpickle
    without that function: pyproject asks for 2.2 or later, which has it), by value: always
    right, only slower."""
    if _cloudpickle_by_reference is None:
        return False
    try:
        return bool(_cloudpickle_by_reference(obj))
    except Exception as exc:
        if raised_by_a_signal(exc):  # a signal handler's: never swallowed
            raise
        return False


def _captures(fn: Any, plan: _Plan, seen: set[int]) -> bool:
    """Add what by-value ``fn`` captured to ``plan``; False if any of it is mutable."""
    if isinstance(fn, types.BuiltinFunctionType):
        owner = fn.__self__
        return owner is None or isinstance(owner, types.ModuleType)
    if id(fn) in seen:
        return True
    seen.add(id(fn))
    if fn.__kwdefaults__ is not None or fn.__dict__:  # a dict, even empty, may change in place
        return False
    code, defaults = fn.__code__, fn.__defaults__
    plan.funcs.append((fn, code, defaults))
    if defaults and not all(_immutable(d, plan, seen) for d in defaults):
        return False
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:
            value = _MISSING
        plan.cells.append((cell, value))
        if value is not _MISSING and not _immutable(value, plan, seen):
            return False
    names = fn.__globals__
    for name in _global_names(code):
        value = names.get(name, _MISSING)
        plan.names.append((names, name, value))
        if value is not _MISSING and not _immutable(value, plan, seen):
            return False
    return True


def _immutable(value: Any, plan: _Plan, seen: set[int]) -> bool:
    """Whether ``value`` pickles the same for as long as it is the same object."""
    kind = type(value)
    if kind in _ATOMS:
        return True
    if kind is tuple or kind is frozenset:
        return len(value) <= _MAX_TUPLE and all(_immutable(v, plan, seen) for v in value)
    if kind is types.FunctionType:
        return _by_reference(value) or _captures(value, plan, seen)
    if kind is types.BuiltinFunctionType:
        return _captures(value, plan, seen)
    if isinstance(value, type) or kind is types.ModuleType:  # a module by value: its dict
        return _by_reference(value)
    return False


_names_of: dict[int, tuple[types.CodeType, tuple[str, ...]]] = {}


def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """Every name the code (and code nested in it) may look up as a global, as cloudpickle
    finds them; attribute names come along, and simply are not in the globals. Kept by the
    code's id (hashing a code object is slow) beside the code itself, so a reused id is seen."""
    hit = _names_of.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    found: dict[str, None] = dict.fromkeys(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found.update(dict.fromkeys(_global_names(const)))
    if len(_names_of) > 4096:  # code made on the fly (exec) must not pile up
        _names_of.clear()
    names = tuple(found)
    _names_of[id(code)] = (code, names)
    return names
