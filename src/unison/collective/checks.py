"""The checks every collectives backend shares: argument validation, and the vocabulary in
which ranks compare what they call.

    user arguments --> check_op / member / check_peer / check_scatter_values (Value/TypeError)
    what a rank calls (kind, op, root) --> descriptor() --> one 64-bit word      \\ published in
    the data it passes (shape, dtype) --> shape_signature / array_signature      / shared memory
    peers' words differ --> describe(descriptor) names both calls in the CollectiveError

Both backends publish the same words through the shared-memory barrier (the torch backend
arrives at it before every torch op), so a mismatch reads the same whichever backend runs.
Everything here is pure: no shared memory, no processes, so it is unit-tested directly.
"""

from __future__ import annotations

import functools
import math
import operator
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from unison.errors import CollectiveError

__all__ = [
    "KINDS",
    "OPS",
    "PYTHON_SIGNATURES",
    "CallScope",
    "array_signature",
    "check_members",
    "check_op",
    "check_peer",
    "check_scatter_values",
    "describe",
    "descriptor",
    "member",
    "op_ufunc",
    "reduce_python",
    "scatter_values",
    "shape_signature",
]

OPS = ("sum", "prod", "min", "max", "mean")
"""The reduction ops, in the order their index is encoded in a descriptor."""
KINDS = ("barrier", "allreduce", "reduce_scatter", "allgather", "broadcast", "scatter", "gather")
"""The collectives a descriptor can name (its low byte is an index in this tuple)."""


def check_op(op: Any) -> str:
    """``op`` if it names a reduction; ValueError that lists the valid ones otherwise."""
    if isinstance(op, str) and op in OPS:
        return op
    raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")


def into(out: Any, result: Any) -> Any:
    """Write a reduction's ``result`` into ``out`` (allreduce's ``out=``) and return ``out``.
    ``out`` must be an array of the result's kind (numpy array, or torch tensor), shape and
    dtype: a ValueError that says which differs otherwise. Checked after the collective, so
    a wrong ``out`` on one worker never leaves its peers waiting. Nothing to do where the
    reduction wrote into ``out`` itself."""
    if result is out:
        return out
    if not hasattr(result, "shape"):
        raise ValueError(f"out= takes an array, and this reduction's result is a "
                         f"{type(result).__name__}: leave out=None")
    want = f"{type(result).__name__} of shape {tuple(result.shape)} and dtype {result.dtype}"
    if not isinstance(out, type(result)) or not hasattr(out, "shape"):
        raise ValueError(f"out= must be the result's kind, shape and dtype ({want}), not a "
                         f"{type(out).__name__}; or leave it None for a new result")
    if out.shape != result.shape or out.dtype != result.dtype:
        raise ValueError(f"out= must be the result's kind, shape and dtype ({want}), not of "
                         f"shape {tuple(out.shape)} and dtype {out.dtype}")
    if isinstance(out, np.ndarray):
        if not out.flags.writeable:
            raise ValueError("out= is read-only: pass a writeable array (or a copy, "
                             "out.copy()), or leave it None for a new result")
        np.copyto(out, result)
    else:
        out.copy_(result)
    return out


def _index(r: Any) -> int:
    """``r`` as a rank: any integer, a numpy one too, but not a bool; -1 for anything else."""
    try:
        return -1 if isinstance(r, bool) else operator.index(r)
    except TypeError:
        return -1


def member(ranks: tuple[int, ...], r: Any, group: bool, what: str) -> int:
    """``r`` is a rank in the scope (group-local with group=True): its global rank."""
    i = _index(r)
    if not 0 <= i < len(ranks):
        scope = "group" if group else "world"
        raise ValueError(f"{what}={r!r} is not a rank of the {scope} (0..{len(ranks) - 1})")
    return ranks[i]


def check_members(call_ranks: tuple[int, ...], ranks: tuple[int, ...], group: bool) -> None:
    """Every rank a collective needs runs this call; else no peer outside it would ever come."""
    if not set(ranks) <= set(call_ranks):
        raise CollectiveError(
            f"this call runs on workers {list(call_ranks)}, but a "
            f"{'group' if group else 'world'} collective needs workers {list(ranks)}: "
            "call it on the whole session (or the whole group with group=True)"
        )


def check_peer(peer: Any, me: int, n: int, what: str) -> int:
    """``peer`` as a global rank other than ``me``, for send (``what``="send") or recv: any
    integer, a numpy one too (as a broadcast's root), but not a bool."""
    i = _index(peer)
    if not 0 <= i < n or i == me:
        role = "destination" if what == "send" else "source"
        raise ValueError(f"{what} needs a {role} rank in 0..{n - 1} other than {me}")
    return i


def scatter_values(xs: Any) -> list[Any]:
    """A scatter's values as a list, made once (a generator is read once), in rank order: a
    dict would send its keys, a set its elements in no order, a str its characters, each
    worker a wrong value with no error; they are refused. An array gives its rows (axis 0)."""
    if type(xs) is list:
        return xs
    if isinstance(xs, (Mapping, set, frozenset, str, bytes, bytearray)):
        raise TypeError(
            f"scatter needs a list (or tuple, or array) of values, one per worker in rank "
            f"order; got {type(xs).__name__}. To send the same value to every worker, use "
            "broadcast().")
    try:
        return list(xs)
    except TypeError:
        raise TypeError(f"scatter needs a list of values, one per worker in rank order, "
                        f"got {type(xs).__name__}") from None


def check_scatter_values(xs: Any, size: int) -> list[Any]:
    """The source of a scatter passes one value per worker of the scope (``scatter_values``),
    checked before anything reaches a peer."""
    values = None if xs is None else scatter_values(xs)
    if values is None or len(values) != size:
        raise ValueError(f"scatter on the source needs one value per worker ({size})")
    return values


_UFUNCS: dict[str, Any] = {
    "sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "mean": np.add,
}


def op_ufunc(op: str) -> Any:
    """The numpy ufunc that reduces by ``op`` (mean sums, then divides): the shared-memory
    backend's, and the torch backend's for dtypes gloo lacks."""
    return _UFUNCS[check_op(op)]


@functools.lru_cache(maxsize=256)
def descriptor(kind: str, op: str | None = None, root: int | None = None) -> int:
    """What a rank calls, as one number: kind, op and root (as the caller passed it)."""
    return (KINDS.index(kind) | (0 if op is None else OPS.index(op) + 1) << 8
            | (0 if root is None else root + 1) << 16)


def describe(desc: int) -> str:
    """A descriptor as the call that made it, e.g. "allreduce(op='sum')"."""
    kind, op, root = desc & 0xFF, (desc >> 8) & 0xFF, desc >> 16
    if kind >= len(KINDS) or op > len(OPS):
        return f"an unknown collective ({desc:#x})"
    args = []
    if op:
        args.append(f"op={OPS[op - 1]!r}")
    if root:
        args.append(f"{'dst' if KINDS[kind] == 'gather' else 'src'}={root - 1}")
    return f"{KINDS[kind]}({', '.join(args)})"


def shape_signature(shape: Sequence[int], dtype: str) -> int:
    """Shape and dtype as one number below 2**56, the same in every process (unlike hash())."""
    sig = zlib.crc32(dtype.encode())
    for d in shape:
        sig = (sig * 1_000_003 + d + 1) & 0xFFFF_FFFF_FFFF
    return sig


def array_signature(a: np.ndarray) -> int:
    """Shape and dtype of a numpy array (byte order and datetime units count too)."""
    key = (a.shape, a.dtype)
    sig = _SIGNATURES.get(key)
    if sig is None:
        if len(_SIGNATURES) >= 1024:
            _SIGNATURES.clear()
        sig = _SIGNATURES[key] = (shape_signature(a.shape, a.dtype.str) << 8) | a.dtype.num
    return sig


_SIGNATURES: dict[tuple[tuple[int, ...], np.dtype[Any]], int] = {}  # a collective's hot path

PYTHON_SIGNATURES = {t: shape_signature((), f"python {t.__name__}") << 8 for t in (int, bool)}
"""The signature an allreduce of Python ints or bools meets with (reduce_python), unlike any
array's or tensor's: a rank that passes another kind raises on every rank."""


def reduce_python(values: Sequence[int], op: str) -> int | float:
    """An allreduce of Python ints (or bools), every rank's value in rank order: Python's own
    sum, product, min, max or mean, exact at any size, where an int64 would wrap (and bools
    sum as a logical or). Every backend reduces them so."""
    if op == "sum":
        return sum(values)
    if op == "prod":
        return math.prod(values)
    if op == "min":
        return min(values)
    if op == "max":
        return max(values)
    return sum(values) / len(values)  # mean: a float, as numpy's mean of integers


class CallScope:
    """Which call a worker runs, and which ranks a collective in it takes: the part both
    backends (shared memory, and torch across hosts) keep alike."""

    def __init__(self, rank: int, n: int, groups: int) -> None:
        self.rank, self.n, self.groups = rank, n, groups
        self.gsize = n // groups
        first = rank // self.gsize * self.gsize
        self._scopes = {False: tuple(range(n)), True: tuple(range(first, first + self.gsize))}
        self._call = 0  # the controller's id of the call this worker runs now
        self._call_ranks: tuple[int, ...] | None = None

    def begin(self, call_id: int, ranks: tuple[int, ...] | None) -> None:
        self._call, self._call_ranks = call_id, ranks

    def scope(self, group: bool) -> tuple[int, tuple[int, ...]]:
        """(which generation counter, the ranks taking part) for a collective."""
        if self._call == 0:
            raise RuntimeError("unison collectives only work inside a function a worker runs")
        ranks = self._scopes[group]
        if self._call_ranks is not None:
            check_members(self._call_ranks, ranks, group)
        return (1 if group else 0), ranks
