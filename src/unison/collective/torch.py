"""Collectives through torch.distributed: gloo for CPU tensors, NCCL for CUDA tensors.

    first use in a call, on every worker:  init_process_group("gloo", tcp://host:port)
    (the session chose the port)           NCCL group and per-group subgroups made lazily,
                                           in the same order on every worker
    each collective:  shared-memory arrival barrier first (where the workers share a host),
                      which checks that every rank calls the same op, root, shape, dtype
                      and device; then the torch op

The user never calls init_process_group. The shared-memory barrier before each op means a
peer that raised or returned early fails the collective at once, instead of leaving the
others blocked in gloo or NCCL until their timeout; and a mismatch (a different collective,
op, root, shape or dtype) raises CollectiveError on every rank instead of reaching gloo,
which would abort the process.

A numpy array (or scalar) comes back as numpy, as the shared-memory backend gives it: the
CPU tensor's own memory (``Tensor.numpy()``, no copy), so ``allreduce(x, out=buf)`` takes a
numpy ``buf`` too. broadcast's and scatter's receivers get the kind the source passed.

Python ints and bools are no tensors: their allreduce moves the values as objects and
reduces them with Python's own arithmetic, exact at any size, as the shared-memory backend
does (an int64 tensor would wrap past 2**63, and a bool tensor sum as a logical or).

Barriers and point to point (send/recv) are delegated to the shared-memory backend, as are
``begin``/``end`` of a call; the argument checks come from collective/checks.py, as the
shared-memory backend's do.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from unison.collective.base import Collectives
from unison.collective.checks import (
    PYTHON_SIGNATURES,
    check_op,
    check_scatter_values,
    member,
    op_ufunc,
    reduce_python,
    shape_signature,
)
from unison.collective.shm import ShmCollectives
from unison.errors import CollectiveError

TORCH_SCATTER = 1
"""The signature a torch scatter's ranks meet with at the shared-memory barrier. Where the
backend is picked per value (a CUDA tensor takes torch in a scope on shared memory:
collective/__init__.py), a rank that passed None while the source passed CUDA tensors runs
the shared-memory scatter, which meets with 0: every rank raises CollectiveError, instead
of each waiting for the other."""


TORCH_BROADCAST = 2
"""The same for a torch broadcast's first meeting, where the receivers learn the shape."""


class TorchCollectives(Collectives):
    """One worker's torch.distributed backend; ``local`` supplies the barriers and the
    call context (scopes, peers)."""

    def __init__(self, local: ShmCollectives, address: str, timeout_s: float,
                 store_fd: int = -1) -> None:
        self.local = local
        self.store_fd = store_fd
        """Worker 0's: the socket listening at ``address``, which the controller bound
        (a port found free and let go could be taken before worker 0 bound it again)."""
        self.held = local.held
        self.rank, self.n = local.rank, local.n
        self.groups, self.gsize = local.groups, local.gsize
        self.address = address
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._groups: dict[tuple[str, int], Any] = {}
        self._ready = False

    def _dist(self) -> Any:
        import torch.distributed as dist

        if not self._ready:
            if not dist.is_initialized():
                dist.init_process_group("gloo", store=self._rendezvous(dist),
                                        rank=self.local.rank, world_size=self.local.n,
                                        timeout=self.timeout)
            self._ready = True
        return dist

    def _rendezvous(self, dist: Any) -> Any:
        """The store the workers meet at (``address``, loopback: a local session), served
        by worker 0 (``serve_store``) on the socket the controller bound (``store_fd``).
        ``init_method="tcp://..."`` made a TCPStore that listened on every interface:
        anyone on the network could read and write gloo's rendezvous (an audit, issue 9,
        forty-seventh pass)."""
        host, _, port = self.address.rpartition(":")
        if self.local.rank != 0:
            return dist.TCPStore(host, int(port), self.local.n, False, timeout=self.timeout)
        # a copy for the store, which closes what it serves (a start that failed closed
        # it): a second try must not serve a closed fd, or a number reused since
        sock = None if self.store_fd < 0 else socket.socket(fileno=os.dup(self.store_fd))
        return serve_store(host, int(port), self.local.n, sock, timeout=self.timeout)

    def _pg(self, dist: Any, backend: str, group: bool) -> Any:
        """The process group for a backend and scope, made on first use by every worker."""
        key = (backend, self.local.rank // self.local.gsize if group else -1)
        pg = self._groups.get(key)
        if pg is None:
            if not group and backend == "gloo":
                pg = dist.group.WORLD
            elif not group:
                pg = dist.new_group(backend=backend)
            else:
                size = self.local.gsize
                for g in range(self.local.groups):  # every worker makes every group, in order
                    made = dist.new_group(list(range(g * size, (g + 1) * size)), backend=backend)
                    self._groups[(backend, g)] = made
                pg = self._groups[key]
            self._groups[key] = pg
        return pg

    def _enter(self, group: bool, kind: str, tensors: Sequence[Any], op: str | None = None,
               root: int | None = None, sig: int = 0) -> tuple[Any, Any, tuple[int, ...]]:
        """Arrive at a shared-memory barrier that checks every rank calls the same ``kind``,
        ``op`` and ``root`` on a tensor of the same shape, dtype and device (gloo would abort
        the process on a mismatch), then return (dist, process group, ranks). ``sig``: what
        the data is, where no tensor says it."""
        cuda = any(getattr(t, "is_cuda", False) for t in tensors)
        if tensors:
            t = tensors[0]
            sig = shape_signature(tuple(t.shape), str(t.dtype)) << 1 | cuda
        ranks = self.local.arrive(group, kind, op, root, sig)
        return (*self._group(group, cuda), ranks)

    def _group(self, group: bool, cuda: bool) -> tuple[Any, Any]:
        """torch.distributed and the process group of ``group``'s scope for the data's
        device, once the ranks have met."""
        dist = self._dist()
        return dist, self._pg(dist, "nccl" if cuda else "gloo", group)

    def allreduce(self, x: Any, op: str, group: bool) -> Any:
        if type(x) is int or type(x) is bool:
            return self._allreduce_python(x, op, group)
        return _like(x, self._reduce(x, op, group, "allreduce"))

    def _reduce(self, x: Any, op: str, group: bool, kind: str) -> Any:
        """The reduction as a tensor (a Python float or complex for one); ``kind`` names
        the collective it serves, for the mismatch check."""
        check_op(op)
        t = _tensor(x)
        if kind == "reduce_scatter" and t.dim() == 0:  # (before the peers meet, as shm's)
            raise ValueError("reduce_scatter needs an array with a first axis to split")
        scalar = type(x) is float or type(x) is complex  # a Python number back, as shm gives
        dist, pg, ranks = self._enter(group, kind, [t], op=op)
        if op != "mean" and not t.is_cuda and str(t.dtype) in _NOT_GLOO:
            return _reduce_gathered(dist, pg, len(ranks), t, op)
        if op in ("min", "max") and not t.is_cuda and t.is_floating_point():
            return _extreme_gathered(dist, pg, len(ranks), t, op)
        out = t.clone()
        reduce_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM,
                     "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
                     "max": dist.ReduceOp.MAX}[op]
        torch = sys.modules["torch"]
        if op in ("sum", "prod") and out.dtype == torch.bool:
            # gloo adds bools as bytes: a True of value 2 (and 0, False, at 256 ranks);
            # numpy's, and the shared-memory backend's, sum is an or, its product an and
            reduce_op = dist.ReduceOp.MAX if op == "sum" else dist.ReduceOp.MIN
        back = None
        if op == "mean" and not (out.is_floating_point() or out.is_complex()):
            out = out.double()  # (as numpy's mean of integers; a complex one stays complex)
        elif op == "mean" and out.dtype in (torch.float16, torch.bfloat16):
            back, out = out.dtype, out.float()  # summed in float32, as numpy's float16 mean
            # (summed in float16, two ranks' 60000 made inf)
        dist.all_reduce(out, op=reduce_op, group=pg)
        if op == "mean":  # divided in double and rounded once, as numpy's mean (shm's _mean)
            wide = torch.complex128 if out.is_complex() else torch.float64
            out = (out.to(wide) / len(ranks)).to(out.dtype)
            if back is not None:
                out = out.to(back)
        return out.item() if scalar else out

    def _allreduce_python(self, x: int, op: str, group: bool) -> int | float:
        """Python ints (or bools) as the shared-memory backend reduces them: Python's own
        arithmetic on every rank's value (reduce_python), exact at any size, where an int64
        tensor would wrap (and a bool tensor sum as a logical or). Their signature tells an
        int from a bool and from any tensor, so a rank that passes another kind raises
        CollectiveError on every rank at the arrival."""
        check_op(op)
        dist, pg, ranks = self._enter(group, "allreduce", [], op=op,
                                      sig=PYTHON_SIGNATURES[type(x)])
        values: list[Any] = [None] * len(ranks)
        dist.all_gather_object(values, x, group=pg)
        return reduce_python(values, op)

    def reduce_scatter(self, x: Any, op: str, group: bool) -> Any:
        full = self._reduce(x, op, group, "reduce_scatter")  # gloo has none
        _, ranks = self.local.scope(group)
        k = ranks.index(self.local.rank)
        return _like(x, full.tensor_split(len(ranks))[k].clone())

    def allgather(self, x: Any, group: bool) -> list[Any]:
        t = _tensor(x)
        dist, pg, ranks = self._enter(group, "allgather", [t])
        w = _wire(t)
        out = [w.new_empty(w.shape) for _ in ranks]
        dist.all_gather(out, w.contiguous(), group=pg)
        return [_like(x, _unwire(o, t)) for o in out]

    def broadcast(self, x: Any, src: int, group: bool) -> Any:
        """The others' ``x`` is ignored and may be None (``sess.broadcast_from`` passes
        None): they learn the shape and dtype from the source through shared memory, as
        scatter's receivers do, then torch moves the data."""
        import torch

        _, ranks = self.local.scope(group)
        src_rank = member(ranks, src, group, "src")
        mine = _tensor(x) if self.local.rank == src_rank else None
        like = self.local.broadcast(
            None if mine is None else (tuple(mine.shape), mine.dtype, mine.is_cuda, _kind(x)),
            src, group, kind="broadcast", sig=TORCH_BROADCAST)
        if mine is not None:
            out = mine.clone()
        else:
            shape, dtype, cuda, _ = like
            device = (x.device if isinstance(x, torch.Tensor) and x.is_cuda == cuda
                      else torch.device("cuda", torch.cuda.current_device()) if cuda
                      else torch.device("cpu"))
            out = torch.empty(shape, dtype=dtype, device=device)
        # no second meeting: the first checked the call, and the shape is the source's
        dist, pg = self._group(group, out.is_cuda)
        out = out.contiguous()
        dist.broadcast(_wire(out), src_rank, group=pg)  # (its bytes: a view of out)
        return _as(like[3], out)  # the source's kind

    def scatter(self, xs: Sequence[Any] | None, src: int, group: bool) -> Any:
        _, ranks = self.local.scope(group)
        src_rank = member(ranks, src, group, "src")
        if self.local.rank == src_rank:
            values = check_scatter_values(xs, len(ranks))
            mine = [_tensor(v) for v in values]
            own = mine[ranks.index(src_rank)]
            for v in mine:  # gloo refuses it on the source alone, with the receivers
                if v.shape != own.shape or v.dtype != own.dtype:  # inside its scatter:
                    raise CollectiveError(  # they waited for its timeout (300 s)
                        f"the torch backend scatters values of one shape and dtype, and "
                        f"these hold {tuple(v.shape)} {v.dtype} beside {tuple(own.shape)} "
                        f"{own.dtype}: pad them to one shape, or send each with send()")
            like = (own.shape, own.dtype, _kind(values[ranks.index(src_rank)]))
        else:
            like = None
        # the receivers learn the shape through shared memory, then torch moves the data;
        # sig tells this from the shared-memory scatter, where a session picks per value
        like = self.local.broadcast(like, src, group, kind="scatter", sig=TORCH_SCATTER)
        import torch

        dist, pg, _ = self._enter(group, "scatter", [], root=src)
        out = torch.empty(like[0], dtype=like[1])
        sent = [_wire(v.contiguous()) for v in mine] if self.local.rank == src_rank else None
        dist.scatter(_wire(out), sent, src=src_rank, group=pg)  # (bytes: views of out)
        return _as(like[2], out)  # the source's kind

    def gather(self, x: Any, dst: int, group: bool) -> list[Any] | None:
        t = _tensor(x)
        dst_rank = member(self.local.scope(group)[1], dst, group, "dst")
        dist, pg, ranks = self._enter(group, "gather", [t], root=dst)
        w = _wire(t.contiguous(), gather=True)
        out = [w.new_empty(w.shape) for _ in ranks] if self.local.rank == dst_rank else None
        dist.gather(w, out, dst=dst_rank, group=pg)
        return None if out is None else [_like(x, _unwire(o, t)) for o in out]

    def begin(self, call_id: int, ranks: tuple[int, ...] | None) -> None:
        self.local.begin(call_id, ranks)

    def end(self, call_id: int) -> None:
        self.local.end(call_id)

    def barrier(self, group: bool) -> None:
        self.local.barrier(group)

    def send(self, x: Any, dst: int) -> None:
        self.local.send(x, dst)  # point to point on one host: the shared-memory mailbox

    def recv(self, src: int) -> Any:
        return self.local.recv(src)


def serve_store(host: str, port: int, world_size: int | None,
                sock: socket.socket | None = None, **options: Any) -> Any:
    """A torch TCPStore server listening on ``host`` alone (port 0: a free one), or on
    ``sock``, listening there already. Given a host, a TCPStore listens on every interface
    whatever it is; on a socket of ours (``master_listen_fd``, libuv's server) it listens
    where we bound, and owns the socket (it closes it as it ends)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    if sock is None:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, port), family=family, backlog=128)
    try:
        store = TCPStore(host, sock.getsockname()[1], world_size, True,
                         master_listen_fd=sock.fileno(), use_libuv=True, **options)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's now
    return store


class NotATensorError(TypeError, CollectiveError):
    """Input the torch backend takes no tensor from: a TypeError, as the shared-memory
    backend gives for it, and still the CollectiveError it was before (code that caught
    that goes on working)."""


_NOT_GLOO = ("torch.int16", "torch.uint16", "torch.uint32", "torch.uint64")
"""Dtypes gloo cannot reduce ("Invalid scalar type"), where numpy (and shm) can."""


def _wire(t: Any, gather: bool = False) -> Any:
    """What gloo moves for ``t``: ``t`` itself, or, for a dtype gloo moves none of
    (``_NOT_GLOO``; complex in a gather), its bytes (a view: ``t`` must be contiguous).
    Before, these collectives raised gloo's RuntimeError "Invalid scalar type", where the
    shared-memory backend moves them."""
    if t.is_cuda or not (str(t.dtype) in _NOT_GLOO or (gather and t.is_complex())):
        return t
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def _unwire(got: Any, like: Any) -> Any:
    """``got`` (what ``_wire`` of a tensor like ``like`` gave, received) as ``like``'s
    dtype and shape."""
    return got if got.dtype == like.dtype else got.view(like.dtype).reshape(like.shape)


def _reduce_gathered(dist: Any, pg: Any, n: int, t: Any, op: str) -> Any:
    """A reduction of a dtype gloo cannot reduce (``_NOT_GLOO``): every rank's bytes
    gathered as uint8, then numpy's ufunc in rank order, the shared-memory backend's result
    to the bit (gloo raised RuntimeError "Invalid scalar type"; int64 would not wrap as
    uint16 does, nor hold a uint64)."""
    import functools

    import numpy as np
    import torch

    mine = _wire(t)
    parts = [mine.new_empty(mine.shape) for _ in range(n)]
    dist.all_gather(parts, mine, group=pg)
    arrays = [_unwire(p, t).numpy() for p in parts]
    return torch.from_numpy(np.asarray(functools.reduce(op_ufunc(op), arrays),
                                       dtype=arrays[0].dtype))


def _extreme_gathered(dist: Any, pg: Any, n: int, t: Any, op: str) -> Any:
    """min or max of floats: every rank's tensor gathered, then torch's minimum or maximum
    in rank order, which keep a NaN as numpy's (and the shared-memory backend's) do. Gloo's
    compares and picks, so a NaN on any rank but the first was lost, and a max could come
    out below the largest value (an audit, issue 9, forty-ninth pass)."""
    import functools

    import torch

    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=pg)
    return functools.reduce(torch.minimum if op == "min" else torch.maximum, parts)


def _kind(x: Any) -> str:
    """"array" for a numpy array, "scalar" for a numpy scalar, "python" for a Python number,
    else "" (numpy is imported wherever one exists)."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.generic):  # (np.float64 is a float too)
        return "scalar"
    if isinstance(x, (int, float, complex)):  # bool and IntEnum too
        return "python"
    return "array" if np is not None and type(x) is np.ndarray else ""


def _as(kind: str, out: Any) -> Any:
    """A result tensor as ``kind`` (``_kind``) says, as the shared-memory backend gives it:
    numpy for numpy (the tensor's own memory: it is on the CPU, as torch.as_tensor made it),
    a Python number for one (a broadcast of 1.5 gave ``tensor(1.5, dtype=float64)``); else
    unchanged."""
    if kind == "array":
        return out.numpy()
    if kind == "scalar":
        return out.numpy()[()]
    if kind == "python" and isinstance(out, sys.modules["torch"].Tensor):
        return out.item()
    return out


def _like(x: Any, out: Any) -> Any:
    """A result tensor as the kind ``x`` was (``_as``)."""
    return _as(_kind(x), out)


def _tensor(x: Any) -> Any:
    """``x`` as a tensor of its own precision: a tensor, a plain numpy array or scalar, or a
    Python number. Anything else (a list, a tuple, a masked array) is refused with a
    TypeError, as the shared-memory backend's reductions refuse it: torch would pick a dtype
    for it (float32 for floats, int64 wrapping past 2**63, bool summing as a logical or), a
    wrong result with no error."""
    import torch

    if isinstance(x, torch.Tensor):  # its negative or conjugate bit applied: gloo reads
        return x.resolve_conj().resolve_neg()  # the memory (a scatter sent the values
        # unnegated, and one of z.conj() hung its receivers; an audit, issue 9, 49th pass)
    if type(x) is float or type(x) is complex:  # as double: torch's default is float32
        return torch.tensor(x, dtype=torch.float64 if type(x) is float else torch.complex128)
    np = sys.modules.get("numpy")
    if type(x) in (int, bool) or (np is not None and (type(x) is np.ndarray
                                                      or isinstance(x, np.generic))):
        try:
            return torch.as_tensor(x)
        except Exception as exc:  # (an object array, say: a TypeError, as shm gives)
            raise NotATensorError(f"the torch backend cannot take this {type(x).__name__}: "
                                  f"{exc}") from exc
    raise NotATensorError(
        f"the torch backend takes tensors, numpy arrays or numbers, not {type(x).__name__}: "
        "make a tensor of the dtype you mean (torch.tensor(x, dtype=torch.float64)), where "
        "torch would pick one (float32 for Python floats)")
