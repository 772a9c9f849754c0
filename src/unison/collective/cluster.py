"""Collectives across hosts: torch.distributed (gloo on CPU, NCCL on GPUs) with nothing shared.

    first collective, on every worker:  init_process_group(store=TCPStore(the controller's))
    each collective:  an all_gather of (what I call, on what shape) first, so that a rank
                      calling another collective or another shape raises CollectiveError on
                      every rank instead of reaching gloo, which would abort the process;
                      then the torch op (TorchCollectives)

Workers of a TCP session (unison.channel.tcp) share no memory, so the shared-memory
barrier that the one-host torch backend puts before each op is a gloo all_gather here,
and point to point goes through torch's object send/recv. The rendezvous store is served by
the controller, the one host every worker reaches.
"""

from __future__ import annotations

import datetime
from typing import Any

from unison.collective.checks import CallScope, check_peer, describe, descriptor
from unison.collective.torch import TorchCollectives
from unison.errors import CollectiveError


class DistLocal(CallScope):
    """What TorchCollectives asks of its ``local`` backend, done through torch.distributed:
    the call context and scopes (CallScope), the checked arrival, object broadcast and
    point to point."""

    def __init__(self, rank: int, n: int, groups: int) -> None:
        super().__init__(rank, n, groups)
        self.owner: ClusterCollectives | None = None

    def end(self, call_id: int) -> None:
        self._call, self._call_ranks = 0, None

    def _group(self, group: bool) -> tuple[Any, Any]:
        assert self.owner is not None
        dist = self.owner._dist()
        return dist, self.owner._pg(dist, "gloo", group)

    def arrive(self, group: bool, kind: str, op: str | None = None, root: int | None = None,
               sig: int = 0) -> tuple[int, ...]:
        """Every participant says what it calls; all agree, or all raise CollectiveError."""
        import torch

        _, ranks = self.scope(group)
        dist, pg = self._group(group)
        mine = torch.tensor([descriptor(kind, op, root), sig], dtype=torch.int64)
        seen = [torch.empty_like(mine) for _ in ranks]
        dist.all_gather(seen, mine, group=pg)
        calls = {r: (int(t[0]), int(t[1])) for r, t in zip(ranks, seen)}
        if len(set(calls.values())) > 1:
            text = ", ".join(f"worker {r}: {describe(d)} on {s:#x}" for r, (d, s) in
                             calls.items())
            raise CollectiveError(f"the workers called different collectives, or on data of "
                                  f"different shapes or types: {text}")
        return ranks

    def barrier(self, group: bool = False) -> None:
        self.arrive(group, "barrier")

    def broadcast(self, x: Any, src: int, group: bool, *, kind: str = "broadcast") -> Any:
        ranks = self.arrive(group, kind, root=src)
        dist, pg = self._group(group)
        box = [x]
        dist.broadcast_object_list(box, src=ranks[src] if group else src, group=pg)
        return box[0]

    def send(self, x: Any, dst: int) -> None:
        check_peer(dst, self.rank, self.n, "send")
        dist, _ = self._group(False)
        dist.send_object_list([x], dst=dst)

    def recv(self, src: int) -> Any:
        check_peer(src, self.rank, self.n, "recv")
        dist, _ = self._group(False)
        box: list[Any] = [None]
        dist.recv_object_list(box, src=src)
        return box[0]


class ClusterCollectives(TorchCollectives):
    """The torch backend over a rendezvous store instead of a shared segment."""

    def __init__(self, local: DistLocal, store: str, timeout_s: float) -> None:
        super().__init__(local, store, timeout_s)  # type: ignore[arg-type]
        local.owner = self
        self.dist_local = local

    def _dist(self) -> Any:
        import torch.distributed as dist

        if not self._ready:
            if not dist.is_initialized():
                host, _, port = self.address.rpartition(":")
                store = dist.TCPStore(  # type: ignore[attr-defined]
                    host, int(port), self.n, False, timeout=datetime.timedelta(seconds=60))
                dist.init_process_group("gloo", store=store, rank=self.rank,
                                        world_size=self.n, timeout=self.timeout)
            self._ready = True
        return dist

    def reduce_scatter(self, x: Any, op: str, group: bool) -> Any:
        full = self.allreduce(x, op, group, kind="reduce_scatter")
        _, ranks = self.local.scope(group)
        k = ranks.index(self.local.rank)
        return full.tensor_split(len(ranks))[k].clone()


def setup(spec: dict[str, Any], rank: int, n: int, groups: int) -> tuple[DistLocal,
                                                                          ClusterCollectives]:
    local = DistLocal(rank, n, groups)
    return local, ClusterCollectives(local, spec["store"], spec.get("timeout", 300.0))


__all__ = ["ClusterCollectives", "DistLocal", "setup"]

