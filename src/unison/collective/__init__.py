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

Every worker calls the same collectives in the same order, one at a time: a thread of a
worker that calls one while another of its threads is inside one raises RuntimeError (which
would meet a peer's first was chance).

``group=True`` keeps a collective inside the worker's group (src/dst are then ranks in the
group). Every collective returns new objects and leaves its input unchanged, except that
``allreduce(x, out=buf)`` writes its result into buf (which may be x).

Backends: shared memory (numpy arrays of any dtype and shape, CPU torch tensors, numbers,
and any picklable object for the moving collectives) and torch.distributed (tensors; gloo on
CPU, NCCL on CUDA). Both implement the Collectives interface (collective/base.py); the checks
they share are in collective/checks.py. The functions below pick a backend per call, by the
call's scope (the world, or with group=True the worker's group; send/recv: the world) and
whether a value is a CUDA tensor:

    unison.allreduce(x, group=g) --> _backend(g, x) --> TorchCollectives   (CUDA x, or a scope
                                                         that is not on shared memory)
                                                    --> ShmCollectives     (otherwise)

Which scopes are on shared memory is the session's choice, the same on every worker:

    launcher="local"       every scope, unless Session(collectives="torch") (then none)
    workers joining over   the world when every worker is on one host; the groups when every
      TCP (Ray, connect)   group is (collective/cluster.py); collectives="torch" sets up
                           torch.distributed for the rest, which otherwise raise
                           CollectiveError saying so

A CUDA tensor always goes through torch.distributed, which needs collectives="torch".
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from unison import _native
from unison import trace as _trace
from unison.collective.base import Collectives
from unison.collective.checks import into as _into
from unison.collective.checks import scatter_values as _scatter_values
from unison.collective.shm import ShmCollectives
from unison.collective.torch import TorchCollectives
from unison.errors import CollectiveError

__all__ = [
    "CollectiveError", "Collectives", "allgather", "allreduce", "barrier", "broadcast", "gather",
    "recv", "recv_from_prev_group", "reduce_scatter", "scatter", "send", "send_to_next_group",
]

_running: list[Any] = [0, None]  # the call this worker runs now (0: none) and its ranks
_begun = [0]  # the call the backends were last told of (``_begin``)
_top: Collectives | None = None  # what ``setup`` returned: the backend to tell
_shm: ShmCollectives | None = None  # shared memory, where this worker has a segment
_torch: Collectives | None = None  # torch.distributed, where the session set it up
_on_shm = (False, False)  # (world, group): which scopes run on shared memory
_why = ("", "")  # (world, group): why a scope has no backend, where it has none
_inside = [""]
"""The collective a thread of this worker is inside ("": none): set and cleared around each
function below, written out (a decorator's frame, or even a thread id, would cost a small
allreduce's hot path more than these two stores). Not a lock: a Cancelled or
KeyboardInterrupt landing between a lock's acquire and the try would leave it held, refusing
every later collective; the store right before the try leaves no such gap (``_at_once``)."""
_NO_MEMFD = ("this session has no shared-memory collectives: the platform lacks memfd_create "
             "(see README, Platforms); move data through the controller with put/scatter/gather")


def setup(spec: dict[str, Any] | None, rank: int, n: int, groups: int, running: list[Any],
          *, watch_peers: bool = False) -> Collectives | None:
    """Called once by the worker at start with the session's collective spec. Returns the
    backend the worker loop tells where each call ends (the torch backends pass that on to
    the shared-memory one, which relies on it). ``running``: the worker's ``[call id, ranks]``
    of the call it runs now (0: none), which the loop keeps; a call's first collective tells
    the backends of it (``_begin``). ``watch_peers``: waits look at the peers' pids
    themselves (inline worker 0: the controller that would set the abort flag is the thread
    waiting)."""
    global _shm, _torch, _on_shm, _why, _running, _top
    _running, _begun[0] = running, 0
    if spec is None:
        _why = (_NO_MEMFD, _NO_MEMFD)
        return None
    ordered = _native.ordered_memory()  # this worker's own CPU: a cluster's hosts may differ
    if spec.get("backend") == "cluster":  # workers that join over TCP, maybe on several hosts
        from unison.collective import cluster

        if not ordered:  # torch for every scope, where the session has it
            spec = {**spec, "shared": None}
        _shm, _torch, _on_shm = cluster.setup(spec, rank, n, groups)
        _why = cluster.missing(spec.get("shared")) if ordered else _unordered()
        _top = _torch or _shm
        return _top
    _shm = ShmCollectives(spec["fd"], rank, n, groups, watch_peers=watch_peers)
    if spec.get("torch_address"):
        from unison.collective.torch import TorchCollectives

        _torch = TorchCollectives(_shm, spec["torch_address"], spec.get("timeout", 300.0),
                                  spec.get("store_fd", -1))
    on = spec.get("backend") != "torch" and ordered
    _on_shm = (on, on)
    if not ordered:
        _why = _unordered()
    _top = _shm
    return _shm


def _unordered() -> tuple[str, str]:
    """Why a collective has no backend on a CPU without x86's memory order."""
    why = (_native.unordered_why("collectives through shared memory")
           + ": open the session with Session(..., collectives='torch')")
    return why, why


def start_torch() -> None:
    """torch.distributed's gloo groups, the world's and every group's, made by every worker
    in the session's first call (where it has torch collectives): init_process_group and
    new_group need every rank, so made lazily by a first collective on one group's view,
    they waited for the other workers, who never came, until gloo's timeout (300 s)."""
    if _torch is None:
        return
    torch = _torch
    assert isinstance(torch, TorchCollectives)
    dist = torch._dist()
    torch._pg(dist, "gloo", False)
    if torch.groups > 1:
        torch._pg(dist, "gloo", True)


def idle_hook() -> Callable[[], None] | None:
    """What a worker runs now and then while it waits for its next command (its channel's
    ``on_idle``): a cluster's mark of the call it ended (cluster.DistLocal.idle)."""
    local = getattr(_torch, "dist_local", None)  # (a ClusterCollectives' only)
    return None if local is None else local.idle


def teardown() -> None:
    """Forget the backends ``setup`` made (worker 0 inline in the controller, whose process
    outlives its session)."""
    global _shm, _torch, _on_shm, _why, _running, _top
    if _shm is not None:
        _shm.release()
    _shm, _torch, _on_shm, _why = None, None, (False, False), ("", "")
    _running, _top, _begun[0] = [0, None], None, 0


def _begin() -> None:
    """The first collective of the call this worker runs now: the backends learn of the
    call here, not from the worker loop before every call, most of which run none (that
    method call was 8% of a worker's instructions per call: issue 9, seventeenth pass).
    Outside a call (a thread that outlived its call, say), none may run."""
    call = _running[0]
    if not call:
        raise RuntimeError(
            "unison collectives only work inside a function that a unison worker runs, "
            "while it runs (not from a thread it left behind): call them from the function "
            "itself, or join its threads before it returns"
        )
    if _top is not None:
        _top.begin(call, _running[1])
    _begun[0] = call


def _backend(group: bool, *values: Any) -> Collectives:
    """The backend for a collective of ``group``'s scope on ``values`` (timed, while a trace
    runs)."""
    chosen = _choose(group, *values)
    if _trace.events is not None:
        scope = chosen.rank // chosen.gsize if group else -1
        return _Timed(chosen, scope)  # type: ignore[return-value]
    return chosen


class _Timed:
    """A backend whose every collective is recorded in the trace (unison.trace), with its
    scope: -1 the world, else the worker's group."""

    def __init__(self, backend: Collectives, scope: int) -> None:
        self._backend = backend
        self._scope = scope

    def __getattr__(self, name: str) -> Any:
        op = getattr(self._backend, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with _trace.collective(name, self._scope):
                return op(*args, **kwargs)

        return timed


def _choose(group: bool, *values: Any) -> Collectives:
    if group is not False and group is not True:  # 2 or "yes" failed as an IndexError deep in
        raise TypeError(f"group must be True (the worker's group) or False (every worker), "
                        f"not {group!r}")
    if _running[0] != _begun[0]:
        _begin()
    cuda = False
    for v in values:  # not any(...): a generator costs a collective's hot path 0.2 us
        if getattr(v, "is_cuda", False):
            cuda = True
            break
    scope = 1 if group else 0
    if _on_shm[scope] and not cuda:
        assert _shm is not None
        return _shm
    if _torch is not None:
        return _torch
    if cuda:
        raise CollectiveError("CUDA tensors need the torch backend: Session(collectives='torch')")
    if _why[scope]:
        raise CollectiveError(_why[scope])
    raise RuntimeError(
        "unison collectives only work inside a function that a unison worker runs "
        "(pass the function to sess.call or sess.run)"
    )


def allreduce(x: Any, op: str = "sum", *, group: bool = False, out: Any = None) -> Any:
    """x0 op x1 op ... over the workers (sum, prod, min, max or mean), on every worker.

    ``out``: an array (a tensor, for a tensor x) of the result's shape and dtype to write
    the result into and return, instead of a new one, as MPI's ``Allreduce(x, out)`` and
    numpy's ``out=`` do: a loop of small allreduces then makes no array per call. It may be
    x itself. A wrong one raises ValueError once the collective is done (its contents are
    then unspecified, as they are after any error)."""
    if _inside[0]:
        _at_once("allreduce")
    _inside[0] = "allreduce"
    try:
        if (type(x) is np.ndarray and (group is False or group is True) and _on_shm[group]
                and _trace.events is None and _running[0] == _begun[0]):
            return _shm.allreduce(x, op, group, out)  # type: ignore[union-attr]  # _backend's
        _refuse_masked(x, "allreduce")
        if isinstance(x, int) and type(x) is not int and type(x) is not bool:
            x = int(x)  # an IntEnum, an int subclass: exact, as a Python int (int64 would wrap)
        result = _backend(group, x).allreduce(x, op, group)
        return result if out is None else _into(out, result)
    finally:
        _inside[0] = ""


def allgather(x: Any, *, group: bool = False) -> list[Any]:
    """Every worker's x, as a list in rank order, on every worker."""
    if _inside[0]:
        _at_once("allgather")
    _inside[0] = "allgather"
    try:
        return list(_backend(group, x).allgather(x, group))
    finally:
        _inside[0] = ""


def broadcast(x: Any, src: int = 0, *, group: bool = False) -> Any:
    """Worker ``src``'s x on every worker (the others' x is ignored, and may be None)."""
    if _inside[0]:
        _at_once("broadcast")
    _inside[0] = "broadcast"
    try:
        return _backend(group, x).broadcast(x, src, group)
    finally:
        _inside[0] = ""


def scatter(xs: Iterable[Any] | None, src: int = 0, *, group: bool = False) -> Any:
    """Element r of worker ``src``'s values (a list, a tuple, any iterable, or an array's
    rows), on worker r (the others pass None). A dict, set or str is refused (TypeError)."""
    if _inside[0]:
        _at_once("scatter")
    _inside[0] = "scatter"
    try:
        # a list made once (a generator is read once; ``xs or ()`` failed on an array)
        values = None if xs is None else _scatter_values(xs)
        return _backend(group, *(() if values is None else values)).scatter(values, src, group)
    finally:
        _inside[0] = ""


def gather(x: Any, dst: int = 0, *, group: bool = False) -> list[Any] | None:
    """Every worker's x, as a list in rank order, on worker ``dst``; None on the others."""
    if _inside[0]:
        _at_once("gather")
    _inside[0] = "gather"
    try:
        return _backend(group, x).gather(x, dst, group)
    finally:
        _inside[0] = ""


def reduce_scatter(x: Any, op: str = "sum", *, group: bool = False) -> Any:
    """Share r (``np.array_split`` along axis 0) of the reduction, on worker r."""
    if _inside[0]:
        _at_once("reduce_scatter")
    _inside[0] = "reduce_scatter"
    try:
        _refuse_masked(x, "reduce_scatter")
        return _backend(group, x).reduce_scatter(x, op, group)
    finally:
        _inside[0] = ""


def _at_once(name: str) -> None:
    """Two threads of one worker in collectives at once would take each other's places in
    the sequence every worker must follow (which thread's allreduce meets a peer's first
    is chance), or write one message slot twice: wrong results with no error."""
    raise RuntimeError(
        f"a thread of this worker called {name} while another of its threads is inside "
        f"{_inside[0]}: a worker's collectives (send and recv too) run one at a time, in the "
        "same order on every worker; call them from one thread of the worker, or let a "
        "thread left inside one finish first"
    )


def _refuse_masked(x: Any, name: str) -> None:
    """A masked array's reduction would take its raw elements, the masked ones too, and
    give a plain array back: a wrong result with no error (both backends)."""
    ma = sys.modules.get("numpy.ma")
    if ma is not None and isinstance(x, ma.MaskedArray):
        raise TypeError(
            f"{name} of a masked array would reduce its masked elements too and drop the "
            "mask: pass x.filled(v) with the value the op should ignore (0 for a sum, 1 for "
            "a product), and reduce the mask apart if the result needs one"
        )


def barrier(*, group: bool = False) -> None:
    """Wait until every worker (of the group) got here."""
    if _inside[0]:
        _at_once("barrier")
    _inside[0] = "barrier"
    try:
        _backend(group).barrier(group)
    finally:
        _inside[0] = ""


def send(x: Any, dst: int) -> None:
    """Send x to worker ``dst`` (global rank). Eager: returns once x is copied out, whatever
    its size; it waits only while 64 earlier messages to ``dst`` are still untaken. A cycle
    of such waits, of recvs (each worker receiving first from the next), or of either with
    a collective (a worker in a recv from a peer that waits in a barrier for it), raises
    CollectiveError instead of hanging (shared-memory collectives)."""
    if _inside[0]:
        _at_once("send")
    _inside[0] = "send"
    try:
        _backend(False, x).send(x, dst)
    finally:
        _inside[0] = ""


def recv(src: int) -> Any:
    """The next object worker ``src`` sent to this worker."""
    if _inside[0]:
        _at_once("recv")
    _inside[0] = "recv"
    try:
        return _backend(False).recv(src)
    finally:
        _inside[0] = ""


def send_to_next_group(x: Any) -> None:
    """Send x to the worker of the same group rank in the next group (a pipeline stage)."""
    me = _choose(False)
    if me.rank + me.gsize >= me.n:
        raise ValueError("the last group has no next group to send to")
    send(x, me.rank + me.gsize)


def recv_from_prev_group() -> Any:
    """The next object sent by the same group rank in the previous group."""
    me = _choose(False)
    if me.rank < me.gsize:
        raise ValueError("the first group has no previous group to receive from")
    return recv(me.rank - me.gsize)
