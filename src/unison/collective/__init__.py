"""Worker-to-worker collectives, called inside a function that the workers run.

    unison.allreduce(x, op="sum")        every worker gets x0 op x1 op ... (rank order)
    unison.allgather(x)                  [x0, x1, ...] on every worker
    unison.broadcast(x, src=0)           x of worker src, on every worker
    unison.scatter(xs, src=0)            xs[r] (from worker src) on worker r
    unison.gather(x, dst=0)              [x0, x1, ...] on worker dst, None elsewhere
    unison.reduce_scatter(x, op="sum")   share r (np.array_split along axis 0) of the allreduce
    unison.barrier()
    unison.send(x, dst); unison.recv(src)            point to point, by global rank
    unison.send_to_next_group(x); unison.recv_from_prev_group()   pipeline stages

``group=True`` keeps a collective inside the worker's group (src/dst are then ranks in the
group). Every collective returns new objects and leaves its input unchanged.

Backends: shared memory (default: numpy arrays of any dtype and shape, CPU torch tensors,
numbers, and any picklable object for the moving collectives); torch.distributed
(``Session(collectives="torch")``, and always for CUDA tensors: gloo on CPU, NCCL on CUDA).
Both implement the Collectives interface (collective/base.py); the checks they share are in
collective/checks.py. The functions below pick a backend per call:

    unison.allreduce(x)  -->  _backend(x)  -->  TorchCollectives   (torch session, or CUDA x)
                                           -->  ShmCollectives     (otherwise)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from unison import trace as _trace
from unison.collective.base import Collectives
from unison.collective.shm import ShmCollectives
from unison.errors import CollectiveError

if TYPE_CHECKING:
    from unison.collective.cluster import DistLocal

__all__ = [
    "CollectiveError", "Collectives", "allgather", "allreduce", "barrier", "broadcast", "gather",
    "recv", "recv_from_prev_group", "reduce_scatter", "scatter", "send", "send_to_next_group",
]

_local: ShmCollectives | DistLocal | None = None
_torch: Collectives | None = None  # TorchCollectives, made on a worker when the session asks
_torch_default = False
_missing = ""  # why a worker of a session has no collectives, if it has none


def setup(spec: dict[str, Any] | None, rank: int, n: int, groups: int) -> Collectives | None:
    """Called once by the worker at start with the session's collective spec. Returns the
    backend the worker loop tells where each call begins and ends: the shared-memory one,
    which the torch backend relies on for exactly that."""
    global _local, _torch, _torch_default, _missing
    if spec is None:
        _missing = (
            "this session has no shared-memory collectives: the platform lacks memfd_create "
            "(see README, Platforms); move data through the controller with put/scatter/gather"
        )
        return None
    if spec.get("backend") == "none":
        _missing = spec["why"]
        return None
    if spec.get("backend") == "cluster":  # workers on several hosts: torch.distributed only
        from unison.collective import cluster

        _local, _torch = cluster.setup(spec, rank, n, groups)
        _torch_default = True
        return _torch
    _local = ShmCollectives(spec["fd"], rank, n, groups)
    if spec.get("torch_address"):
        from unison.collective.torch import TorchCollectives

        _torch = TorchCollectives(_local, spec["torch_address"], spec.get("timeout", 300.0))
        _torch_default = spec.get("backend") == "torch"
    return _local


def _backend(*values: Any) -> Collectives:
    """The backend for a collective on ``values``: torch when the session asked for it or a
    value is a CUDA tensor, shared memory otherwise (timed, while a trace runs)."""
    chosen = _choose(*values)
    if _trace.events is not None:
        return _Timed(chosen)  # type: ignore[return-value]
    return chosen


class _Timed:
    """A backend whose every collective is recorded in the trace (unison.trace)."""

    def __init__(self, backend: Collectives) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        op = getattr(self._backend, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with _trace.collective(name):
                return op(*args, **kwargs)

        return timed


def _choose(*values: Any) -> Collectives:
    if _local is None:
        if _missing:
            raise CollectiveError(_missing)
        raise RuntimeError(
            "unison collectives only work inside a function that a unison worker runs "
            "(pass the function to sess.call or sess.run)"
        )
    if _torch is not None and (_torch_default or any(getattr(v, "is_cuda", False) for v in values)):
        return _torch
    if any(getattr(v, "is_cuda", False) for v in values):
        raise CollectiveError("CUDA tensors need the torch backend: Session(collectives='torch')")
    assert isinstance(_local, ShmCollectives)  # a cluster session always takes torch's
    return _local


def allreduce(x: Any, op: str = "sum", *, group: bool = False) -> Any:
    """x0 op x1 op ... over the workers (sum, prod, min, max or mean), on every worker."""
    return _backend(x).allreduce(x, op, group)


def allgather(x: Any, *, group: bool = False) -> list[Any]:
    """Every worker's x, as a list in rank order, on every worker."""
    return list(_backend(x).allgather(x, group))


def broadcast(x: Any, src: int = 0, *, group: bool = False) -> Any:
    """Worker ``src``'s x on every worker (the others' x is ignored, and may be None)."""
    return _backend(x).broadcast(x, src, group)


def scatter(xs: Sequence[Any] | None, src: int = 0, *, group: bool = False) -> Any:
    """Element r of worker ``src``'s list, on worker r (the others pass None)."""
    return _backend(*(xs or ())).scatter(xs, src, group)


def gather(x: Any, dst: int = 0, *, group: bool = False) -> list[Any] | None:
    """Every worker's x, as a list in rank order, on worker ``dst``; None on the others."""
    return _backend(x).gather(x, dst, group)


def reduce_scatter(x: Any, op: str = "sum", *, group: bool = False) -> Any:
    """Share r (``np.array_split`` along axis 0) of the reduction, on worker r."""
    return _backend(x).reduce_scatter(x, op, group)


def barrier(*, group: bool = False) -> None:
    """Wait until every worker (of the group) got here."""
    _backend().barrier(group)


def send(x: Any, dst: int) -> None:
    """Send x to worker ``dst`` (global rank). Eager: returns once x is copied out, whatever
    its size; it waits only while 64 earlier messages to ``dst`` are still untaken."""
    _backend(x).send(x, dst)


def recv(src: int) -> Any:
    """The next object worker ``src`` sent to this worker."""
    return _backend().recv(src)


def send_to_next_group(x: Any) -> None:
    """Send x to the worker of the same group rank in the next group (a pipeline stage)."""
    me = _require()
    if me.rank + me.gsize >= me.n:
        raise ValueError("the last group has no next group to send to")
    me.send(x, me.rank + me.gsize)


def recv_from_prev_group() -> Any:
    """The next object sent by the same group rank in the previous group."""
    me = _require()
    if me.rank < me.gsize:
        raise ValueError("the first group has no previous group to receive from")
    return me.recv(me.rank - me.gsize)


def _require() -> ShmCollectives | DistLocal:
    _backend()
    assert _local is not None
    return _local
