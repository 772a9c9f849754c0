"""Arguments checked before anything changes: a bad one raises ValueError or TypeError that
says what to do, and no worker is started, nothing is sent, nothing is marked closed."""

from __future__ import annotations

import itertools
import operator
import os
from collections.abc import Iterable, Mapping
from typing import Any, SupportsIndex

from unison import _native, placement
from unison.debug import logs as _logs
from unison.protocol import CONTAINERS, array_payload, is_plain

__all__ = ["MAX_WORKERS", "as_rank", "call_parts", "check_env", "check_sizes", "cpu_plan",
           "plain_args", "ref_names", "ref_positions", "shape", "values_per_worker"]

MAX_WORKERS = 4096
"""The most workers one session takes: the controller holds fds and tables for each, made
at start, so a mistyped size (10**10) filled its memory before any error. Far more than
one controller can drive well (ten times a large node's cores)."""


def check_sizes(num_workers: object, num_groups: object) -> tuple[int, int]:
    """(num_workers, num_groups) as ints: a numpy integer is taken, as every rank argument
    takes one (a bool or a float is not)."""
    sizes = []
    for name, v in (("num_workers", num_workers), ("num_groups", num_groups)):
        if isinstance(v, bool) or not isinstance(v, SupportsIndex):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        v = operator.index(v)
        if v < 1:
            raise ValueError(f"{name} must be at least 1, got {v}")
        sizes.append(v)
    num_workers, num_groups = sizes
    if num_workers > MAX_WORKERS:
        raise ValueError(
            f"num_workers ({num_workers}) is above the {MAX_WORKERS} one session takes (its "
            "controller keeps fds and tables per worker): open several sessions, or fewer "
            "workers each running more of the work"
        )
    if num_workers % num_groups:
        raise ValueError(
            f"num_workers ({num_workers}) must be divisible by num_groups ({num_groups}), "
            "so that every group has the same size"
        )
    return num_workers, num_groups


def as_rank(value: object, what: str) -> int:
    """An int index (numpy integers too, as sequences take them); never a bool."""
    if isinstance(value, bool):
        raise TypeError(f"{what}, not bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what}, not {type(value).__name__}") from None


def _rank_key(key: object, n: int, what: str) -> int:
    try:
        rank = as_rank(key, f"{what} keys are int ranks")
    except TypeError:
        raise ValueError(f"{what} has key {key!r}, which is not a rank in 0..{n - 1}") from None
    if not 0 <= rank < n:
        raise ValueError(f"{what} has key {key!r}, which is not a rank in 0..{n - 1}")
    return rank


def check_env(n: int, env: Mapping[int, Mapping[str, str]] | None) -> dict[int, dict[str, str]]:
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise TypeError("env must map a rank to a dict of environment variables, e.g. {0: {...}}")
    out = {}
    for key, values in env.items():
        rank = _rank_key(key, n, "env")
        if not isinstance(values, Mapping):
            raise TypeError(
                f"env[{key!r}] must be a dict of environment variables, e.g. "
                f"{{{key!r}: {{'NAME': 'value'}}}}, got {type(values).__name__}"
            )
        out[rank] = {str(k): str(v) for k, v in values.items()}
        for name, value in out[rank].items():
            _check_variable(key, name, value)
    return out


def _check_variable(key: object, name: str, value: str) -> None:
    """A variable the OS can set (else the worker died at start with a traceback)."""
    if not name or "=" in name or "\0" in name or "\0" in value:
        raise ValueError(
            f"env[{key!r}] has {name!r}: {value!r}, which no process can hold (a variable's "
            "name must be non-empty, without '=' or a NUL byte; its value without a NUL byte)"
        )
    if name == "UNISON_PURE" and value.strip().lower() not in _native._YES + _native._NO:
        raise ValueError(  # (the worker's _native.pure_asked would raise as it started)
            f"env[{key!r}]: UNISON_PURE={value!r} is neither on ({', '.join(_native._YES)}) "
            f"nor off ({', '.join(repr(v) for v in _native._NO)}): set it to 1 for pure "
            "Python, or leave it out")
    if name == _logs.ENV:  # unison's own: a worker would ignore or trip over a bad one
        try:
            _logs.parse_levels(value)
        except ValueError as exc:
            raise ValueError(f"env[{key!r}]: {exc}") from None


def cpu_plan(n: int, plan: bool | Mapping[int, Iterable[int]] | None, *,
             children: bool = False, inline: bool = False) -> dict[int, list[int]]:
    """Rank -> the CPUs it may use (a rank left out: all the controller may use). None, the
    default, is unison.placement's ``spread_plan``: local workers (``children``) held one
    to a CPU while calm, only where the session's processes outnumber the CPUs. True:
    every worker pinned, round robin (worker 0 ``inline`` is the controller: not it, whose
    CPUs are the controller's to set; before, True with inline_worker0 was refused)."""
    if plan is None:
        return placement.spread_plan(n, children=children, inline=inline)
    if plan is False:
        return {}
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError("cpu_affinity needs os.sched_getaffinity, which this platform lacks")
    if plan is True:
        return placement.round_robin(range(1 if inline else 0, n))
    usable = sorted(os.sched_getaffinity(0))
    if not isinstance(plan, Mapping):
        raise TypeError("cpu_affinity must be True or map a rank to a list of CPU numbers")
    out = {}
    for key, cpus in plan.items():
        rank = _rank_key(key, n, "cpu_affinity")
        if isinstance(cpus, (str, bytes)) or not isinstance(cpus, Iterable):
            raise TypeError(f"cpu_affinity[{key!r}] must be a list of CPU numbers, e.g. [0, 1]")
        chosen = [as_rank(c, "a CPU is named by an int") for c in cpus]
        missing = sorted(set(chosen) - set(usable))
        if not chosen or missing:
            raise ValueError(
                f"cpu_affinity[{key!r}] = {chosen} names CPUs this process cannot use "
                f"({missing or 'none given'}); the usable CPUs are {usable}"
            )
        out[rank] = chosen
    return out


_PLAIN = frozenset({int, float, bool, type(None), str, complex})


def plain_args(args: tuple[Any, ...]) -> bool:
    """Arguments that pickle small and alike everywhere: numbers, short strings, and short
    bytes and small tuples, lists and dicts of plain values (``protocol.is_plain`` of all
    the arguments as one: no list or dict among them twice, which pickle would keep as
    one object)."""
    if len(args) > 8:
        return False
    plain = _PLAIN
    for a in args:
        t = type(a)
        if t not in plain or (t is str and len(a) > 256):
            return (t in CONTAINERS or t is bytes) and is_plain(args)
    return True


def ref_positions(args: tuple[Any, ...], ref: type) -> tuple[int, ...] | None:
    """Where the arguments of type ``ref`` (unison.Ref) sit, where every other one is as
    ``plain_args`` takes it; None where one is neither (the arguments are pickled then)."""
    if len(args) > 8:
        return None
    plain, where = _PLAIN, []
    for i, a in enumerate(args):
        t = type(a)
        if t is ref:
            where.append(i)
        elif t not in plain or (t is str and len(a) > 256):
            return None
    return tuple(where)


def ref_names(kwargs: dict[str, Any], ref: type) -> tuple[str, ...] | None:
    """``ref_positions`` of keyword arguments: the names of those that are Refs. Its loop,
    for names (on the way of ``call(f, x=ref)``, where building the positional form cost
    0.1 of a round: 1.32x -> 1.42x one without arguments at N=2, benchmarks/ref_args.py)."""
    if len(kwargs) > 8:
        return None
    plain, where = _PLAIN, []
    for k, a in kwargs.items():
        t = type(a)
        if t is ref:
            where.append(k)
        elif t not in plain or (t is str and len(a) > 256):
            return None
    return tuple(where)


def call_parts(args: tuple[Any, ...], kwargs: dict[str, Any], ref: type
               ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[int, ...], tuple[str, ...],
                          tuple[int | str, ...]] | None:
    """The arguments as a CALL carries them without a pickle, where ``ref_positions`` or
    ``ref_names`` met one of another kind: ``(args, kwargs, Ref positions, Ref names,
    numpy keys)``, each small numpy array or scalar replaced by its
    ``protocol.array_payload`` (the keys say where: positions and names); tuples, lists,
    dicts, bytes and long strings as ``protocol.is_plain`` takes them, each and all
    together (no list among them twice). None, at the first that must be pickled, and
    where one numpy value comes twice: pickle gives the worker one object, whose change
    through one argument shows through the other, where two payloads would make two."""
    if len(args) > 8 or len(kwargs) > 8:
        return None
    where: list[int] = []
    names: list[str] = []
    arrays: list[int | str] = []
    loose = []
    sent: set[int] = set()  # ids of the numpy values taken, each at most once (alive: args)
    values: list[Any] | None = None
    kw: dict[str, Any] | None = None
    key: Any
    for key, a in itertools.chain(enumerate(args), kwargs.items()):
        t = type(a)
        if t is ref:
            (where if type(key) is int else names).append(key)
        elif t in _PLAIN and (t is not str or len(a) <= 256):
            continue
        elif t in CONTAINERS or t is bytes or t is str:
            if not is_plain(a):
                return None
            loose.append(a)
        else:
            payload = array_payload(a)
            if payload is None or id(a) in sent:
                return None
            sent.add(id(a))
            arrays.append(key)
            if type(key) is int:
                values = list(args) if values is None else values
                values[key] = payload
            else:
                kw = dict(kwargs) if kw is None else kw
                kw[key] = payload
    if len(loose) > 1 and not is_plain(tuple(loose)):
        return None
    return (args if values is None else tuple(values), kwargs if kw is None else kw,
            tuple(where), tuple(names), tuple(arrays))


def shape(value: object) -> tuple[int, ...]:
    """An array shape: an int or a sequence of ints, none negative."""
    dims = (value,) if not isinstance(value, (tuple, list)) else tuple(value)
    out = tuple(as_rank(d, "an array's shape is made of ints") for d in dims)
    if any(d < 0 for d in out):
        raise ValueError(f"an array's shape cannot have negative sizes: {value!r}")
    return out


def values_per_worker(values: object, what: str) -> list[Any]:
    """A sequence of values, one per worker: a dict (its keys) or a set (no order) would be
    spread silently wrong, so they are refused."""
    if isinstance(values, (Mapping, set, frozenset, str, bytes, bytearray)):
        raise TypeError(
            f"{what} needs a list (or tuple, or array) of values, one per worker in rank order; "
            f"got {type(values).__name__}. To send the same value to every worker, use put()."
        )
    try:
        return list(values)  # type: ignore[call-overload,no-any-return]
    except TypeError:
        raise TypeError(
            f"{what} needs a list of values, one per worker, got {type(values).__name__}"
        ) from None


def inline_worker0(n: int, launcher: object, channel: str, collectives: str) -> None:
    """What ``inline_worker0=True`` needs: local workers on shared memory, and a process
    that is no unison worker (RuntimeError: worker 0 would take over that worker's own)."""
    from unison import channel as channels
    from unison import worker

    if worker._identity:  # set for a worker process's life (and inside inline worker 0's calls)
        raise RuntimeError(
            "Session(inline_worker0=True) inside a function that a unison worker runs: "
            "worker 0's Refs, rank and collectives would be this worker's own, and the "
            "outer session's would be lost. Inside a unison worker, open Session(n) "
            "without inline_worker0")
    if launcher != "local":
        raise ValueError("inline_worker0 runs worker 0 in this process: it needs the local "
                         "launcher (launcher='local'), not workers elsewhere")
    if channel not in ("auto", "shm") or not channels.shm_ok(n):
        raise ValueError("inline_worker0 needs the shared-memory channel (channel='shm' "
                         "or 'auto' on a platform that has it)")
    if collectives != "shm":
        raise ValueError("inline_worker0 supports collectives='shm' only: torch.distributed "
                         "would set up its process group inside the controller")
