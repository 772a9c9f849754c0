"""The interface every benchmarked system offers, and the worker loop's command set that the
multiprocessing baselines share.

A system starts N local worker processes and offers the benchmark's operations:

    call(fn, args)    every worker runs ``fn(*args)``; wait until all have (dispatch)
    gather_small()    every worker runs ``small_value()``; return the N small ints, rank order
    put(array)        every worker receives ``array``, reads one byte of each of its pages
                      (``touch``) and keeps it; wait until all have
    hold(nbytes)      every worker makes ``make_block(nbytes)`` and keeps it (fetch's setup)
    fetch()           every worker's held block, copied to the controller, in rank order
    worker_pids()     the workers' process ids (for the idle CPU measurement)

The baselines are written the way a careful user would write them, with no tricks that
would favour or handicap them. Their workers start with the ``spawn`` method, ignore Ctrl-C
(the controller handles it and stops them) and leave when the controller goes away.
``close()`` stops everything it started, gracefully when asked, else at once.
"""

from __future__ import annotations

import abc
import multiprocessing
import signal
from collections.abc import Callable, Sequence
from typing import Any

from harness.tasks import make_block, noop, small_value, touch


class System(abc.ABC):
    """N workers driven by one controller, as the benchmark sees them."""

    name: str = ""
    description: str = ""
    workloads: frozenset[str] | None = None
    """The benchmark's workloads (measure.WORKLOADS) this system offers; None: all of them.
    The others are skipped for it (no cells: "-" in the table)."""

    @abc.abstractmethod
    def start(self, n: int) -> None:
        """Start ``n`` workers; returns once they can take commands (they may still boot)."""

    @abc.abstractmethod
    def call(self, fn: Callable[..., object], args: Sequence[Any]) -> None:
        """Every worker runs ``fn(*args)``; return when all have."""

    def dispatch(self) -> None:
        """The dispatch workload: every worker runs ``noop()``."""
        self.call(noop, ())

    @abc.abstractmethod
    def gather_small(self) -> list[int]:
        """Every worker runs ``small_value()``; return the results in rank order."""

    @abc.abstractmethod
    def put(self, value: Any) -> None:
        """Every worker receives ``value``, reads one byte of each of its pages (``touch``:
        data mapped lazily pays its page faults here) and keeps it (dropping the previous
        one); return when all have."""

    @abc.abstractmethod
    def hold(self, nbytes: int) -> None:
        """Every worker makes ``make_block(nbytes)`` and keeps it; return when all have."""

    @abc.abstractmethod
    def fetch(self) -> list[Any]:
        """Every worker's held block, copied to the controller, in rank order."""

    @abc.abstractmethod
    def worker_pids(self) -> list[int]:
        """The process id of each worker, in rank order."""

    @abc.abstractmethod
    def close(self, graceful: bool = True) -> None:
        """Stop everything ``start`` started. ``graceful=False``: at once, after an error or
        Ctrl-C. Idempotent."""


# -- worker side, shared by the multiprocessing baselines -------------------------------------

CALL, RUN, PUT, HOLD, FETCH, STOP = range(6)
"""Command kinds, each sent as ``(kind, fn_or_value, args)``: run fn and ack / run fn and
reply its result / keep a value, ``touch`` it and ack / keep ``make_block(*args)`` and ack /
reply the kept block / leave."""

_kept: dict[int, Any] = {}  # a worker's put value (under PUT) and block (under HOLD)


def execute(op: int, obj: Any, args: Sequence[Any]) -> Any:
    """Run one command on a worker; return the reply (None for an ack)."""
    if op == CALL:
        obj(*args)
        return None
    if op == RUN:
        return obj(*args)
    if op == PUT:
        _kept[PUT] = obj
        touch(obj)  # as unison's workers must (its put maps the data lazily)
        return None
    if op == HOLD:
        _kept.pop(HOLD, None)  # free the old block before making the next
        _kept[HOLD] = make_block(*args)
        return None
    if op == FETCH:
        return _kept[HOLD]
    raise ValueError(f"unknown command {op}")


def worker_setup() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def spawn() -> Any:
    return multiprocessing.get_context("spawn")


def stop_processes(procs: list[Any], graceful: bool) -> None:
    """Join the processes (briefly, when graceful), then terminate and kill what is left."""
    for p in procs:
        if graceful:
            p.join(3.0)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)


def died(procs: list[Any]) -> RuntimeError | None:
    for rank, p in enumerate(procs):
        if p.exitcode is not None:
            return RuntimeError(f"worker {rank} (pid {p.pid}) exited with code {p.exitcode}")
    return None


class CommandSystem(System):
    """A baseline that sends one command to every worker and collects one reply from each:
    the workloads differ only in the command."""

    _procs: list[Any]

    @abc.abstractmethod
    def roundtrip(self, op: int, obj: Any = None, args: Sequence[Any] = ()) -> list[Any]:
        """Send ``(op, obj, args)`` to every worker; return their replies in rank order."""

    def call(self, fn: Callable[..., object], args: Sequence[Any]) -> None:
        self.roundtrip(CALL, fn, tuple(args))

    def gather_small(self) -> list[int]:
        return self.roundtrip(RUN, small_value)

    def put(self, value: Any) -> None:
        self.roundtrip(PUT, value)

    def hold(self, nbytes: int) -> None:
        self.roundtrip(HOLD, None, (nbytes,))

    def fetch(self) -> list[Any]:
        return self.roundtrip(FETCH)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]
