"""Collectives of a session whose workers join over TCP (unison.channel.tcp), on hosts that
may differ: shared memory inside a host, torch.distributed (gloo on CPU, NCCL on GPUs)
across hosts.

    the controller decides, for the whole session (spec "shared"):
      "world"   every worker on one host        -> every collective on shared memory
      "groups"  every group on one host         -> group collectives on shared memory,
                                                   the rest on torch.distributed
      None      some group spans hosts, or its  -> every collective on torch.distributed
                hosts are unknown
    a CUDA tensor always goes through torch.distributed; torch.distributed needs
    Session(collectives="torch"), and without it such a collective raises CollectiveError

    each worker's segment (when a scope of it shares memory):
      on the controller's host    the session's, received with the channel's fds ("fd")
      on another host             made by the host's first worker and handed to the others
                                  (collective/rendezvous.py, "host")

    first torch collective, on every worker:  init_process_group(store=TCPStore(the
                                              controller's))
    each torch collective:  the checked arrival first (shared memory's barrier where the
                            scope shares a segment, else an all_gather of what each rank
                            calls, on what shape, in which call), so that a rank calling
                            another collective or another shape raises CollectiveError on
                            every rank instead of reaching gloo, which would abort the
                            process, and a rank still in a call its peer left raises instead
                            of adding the peer's next call's values; then the torch op
    the all_gather is waited for in slices of 0.1 s; between them, the peers' marks in the
    store (the call each ended last, and how many arrivals it had posted) show a peer that
    left the call without posting this one, and the waiter raises CollectiveError; a rank
    marks at the end of a call in which it raised or posted an arrival, else once it has
    waited a while for its next command (channel.IDLE_S: see ClusterCollectives.mark for
    what a mark costs)

The decision is the session's, not each group's, because torch.distributed starts on every
worker at once: were one group on shared memory and another on torch, the second would wait
in init_process_group for ranks that never come. Point to point follows the world's rule
(its pairs would otherwise split the same way). The rendezvous store is served by the
controller, the one host every worker reaches.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
from collections.abc import Sized
from typing import Any

from unison.collective import rendezvous
from unison.collective.checks import CallScope, check_peer, describe, descriptor
from unison.collective.shm import LEFT_WHY, Layout, ShmCollectives
from unison.collective.shm import create as create_segment
from unison.collective.torch import TorchCollectives
from unison.errors import CollectiveError

_MARK = "unison/{token}/ended/{rank}"
"""The store key where a rank says which call it ended last. The token is the session's,
drawn by the controller and sent only over the authenticated channel: the store takes
anyone's writes (torch's TCPStore has no secret), and a forged mark made a rank raise while
its peers went on into gloo (an audit, issue 9, forty-seventh pass)."""
_SLICE = datetime.timedelta(seconds=0.1)
"""How long an arrival waits in gloo between looks at the peers' marks."""


class DistLocal(CallScope):
    """What TorchCollectives asks of its ``local`` backend: the call context and scopes
    (CallScope), the checked arrival, object broadcast and point to point. In a scope that
    runs on shared memory (``on_shm``: world, group) these go through ``shm``, so that a rank
    taking torch there (for a CUDA tensor) meets its peers at the barrier they meet at;
    elsewhere through torch.distributed."""

    def __init__(self, rank: int, n: int, groups: int, shm: ShmCollectives | None = None,
                 on_shm: tuple[bool, bool] = (False, False)) -> None:
        super().__init__(rank, n, groups)
        self.shm = shm
        self.held: Sized = () if shm is None else shm.held
        self.on_shm = on_shm
        self.owner: ClusterCollectives | None = None
        self._early: dict[int, tuple[int, Any]] = {}
        """Per source, a message of a later call that a recv of an earlier one took."""
        self._posted = [0, 0]
        """Per scope (world, group), how many arrivals (all_gathers) this rank has posted:
        the n-th of every rank's pair up in gloo, whichever call each was posted in."""
        self._marked = [0, 0]
        """``_posted`` as the store last heard it (``end``): a call that ran no arrival and
        returned writes no mark at its end, for what a mark costs (``mark``), but once the
        worker waits for its next command (``idle``): a peer can wait only for a rank that
        posted fewer arrivals than it, and such a rank goes on to wait."""
        self._unmarked = 0
        """A call that ended with no mark (it ran no arrival, and returned): marked at the
        worker's next wait (``idle``)."""
        self._pending: dict[bool, tuple[Any, list[Any], int]] = {}
        """Per scope, an arrival this rank posted and left unfinished (a peer had left the
        call): (gloo's work, its outputs, its number), finished first at the next arrival,
        where it pairs with the peers' next."""

    def begin(self, call_id: int, ranks: tuple[int, ...] | None) -> None:
        super().begin(call_id, ranks)
        if self.shm is not None:
            self.shm.begin(call_id, ranks)

    def end(self, call_id: int) -> None:
        if self.shm is not None:
            self.shm.end(call_id)
        owner = self.owner
        if owner is not None and owner._ready and not all(self.on_shm):
            if self._posted != self._marked or sys.exc_info()[0] is not None:
                self._mark(call_id)  # it ran an arrival, or raised (the worker loop ends a
            else:  # failed call inside its except); else once the worker waits (idle)
                self._unmarked = call_id
        self._call, self._call_ranks = 0, None

    def idle(self) -> None:
        """The worker has waited a while for its next command (its channel runs this every
        channel.IDLE_S of a wait, at most: at the controller's heartbeats over TCP): mark
        the call this rank ended last, where it ran no arrival and returned. Its peers may
        wait in that call's collective for it; before, they waited for its next call with a
        collective, or the call's timeout. At most one mark a wait's slice, not one at every
        call's end (its cost: ``ClusterCollectives.mark``)."""
        if self._unmarked:
            self._mark(self._unmarked)

    def _mark(self, call_id: int) -> None:
        assert self.owner is not None
        self.owner.mark(call_id, self._posted)
        self._marked = self._posted.copy()
        self._unmarked = 0

    def _shared(self, group: bool) -> ShmCollectives | None:
        """The shared-memory backend, where this scope runs on it."""
        return self.shm if self.on_shm[1 if group else 0] else None

    def _group(self, group: bool) -> tuple[Any, Any]:
        assert self.owner is not None
        return self.owner._group(group, False)

    def arrive(self, group: bool, kind: str, op: str | None = None, root: int | None = None,
               sig: int = 0) -> tuple[int, ...]:
        """Every participant says what it calls, and in which call; all agree, or all raise
        CollectiveError. A rank still in an earlier call than a peer's (the peer left that
        call without joining this collective) raises, as the shared-memory backend does; the
        peer in the later call discards what it met and waits for the others to reach it,
        so neither pairs a collective with one of another call."""
        shm = self._shared(group)
        if shm is not None:
            return shm.arrive(group, kind, op, root, sig)
        import torch

        _, ranks = self.scope(group)
        dist, pg = self._group(group)
        desc = descriptor(kind, op, root)
        mine = torch.tensor([desc, sig, self._call], dtype=torch.int64)
        while True:
            seen = self._round(dist, pg, group, mine, ranks, desc)
            at = {r: int(t[2]) for r, t in zip(ranks, seen)}
            latest = max(at.values())
            if latest == self._call and min(at.values()) == latest:
                break
            if latest > self._call:
                j = next(r for r, c in at.items() if c == latest)
                raise CollectiveError(
                    f"{describe(desc)} on worker {self.rank} gave up: worker {j} left the "
                    f"call without joining it ({LEFT_WHY})", peer=j)
        calls = {r: (int(t[0]), int(t[1])) for r, t in zip(ranks, seen)}
        if len(set(calls.values())) > 1:
            text = ", ".join(f"worker {r}: {describe(d)} on {s:#x}" for r, (d, s) in
                             calls.items())
            raise CollectiveError(f"the workers called different collectives, or on data of "
                                  f"different shapes or types: {text}")
        return ranks

    def _round(self, dist: Any, pg: Any, group: bool, mine: Any, ranks: tuple[int, ...],
               desc: int) -> list[Any]:
        """One all_gather of what each rank calls, waited for while watching that no peer
        left the call without posting it: the one this rank left unfinished in an earlier
        call if any (it pairs with the peers' next), else a new one."""
        pending = self._pending.get(group)
        if pending is None:
            seen = [mine.new_empty(mine.shape) for _ in ranks]
            work = dist.all_gather(seen, mine, group=pg, async_op=True)
            self._posted[group] += 1
            pending = self._pending[group] = (work, seen, self._posted[group])
        assert self.owner is not None
        self.owner.await_round(pending[0], ranks, group, pending[2], desc)
        del self._pending[group]
        return pending[1]

    def barrier(self, group: bool = False) -> None:
        self.arrive(group, "barrier")

    def broadcast(self, x: Any, src: int, group: bool, *, kind: str = "broadcast",
                  sig: int = 0) -> Any:
        shm = self._shared(group)
        if shm is not None:
            return shm.broadcast(x, src, group, kind=kind, sig=sig)
        ranks = self.arrive(group, kind, root=src, sig=sig)
        dist, pg = self._group(group)
        box = [x]
        dist.broadcast_object_list(box, src=ranks[src] if group else src, group=pg)
        return box[0]

    def send(self, x: Any, dst: int) -> None:
        shm = self._shared(False)
        if shm is not None:
            return shm.send(x, dst)
        dst = check_peer(dst, self.rank, self.n, "send")
        dist, _ = self._group(False)
        dist.send_object_list([(self._call, x)], dst=dst)  # its call: see recv

    def recv(self, src: int) -> Any:
        shm = self._shared(False)
        if shm is not None:
            return shm.recv(src)
        src = check_peer(src, self.rank, self.n, "recv")
        dist, _ = self._group(False)
        got = self._early.pop(src, None)
        while True:
            if got is None:
                box: list[Any] = [None]
                dist.recv_object_list(box, src=src)
                got = box[0]
            call, x = got
            if call == self._call:
                return x
            if call > self._call:  # the sender went on to a later call: kept for it
                self._early[src] = got
                raise CollectiveError(
                    f"recv from worker {src} on worker {self.rank} gave up: worker {src} left "
                    f"the call without sending ({LEFT_WHY})", peer=src)
            got = None  # an earlier call's, whose receiver left it (gloo holds a send
            # until a recv takes it): taken for this call, it would be a stale value


class ClusterCollectives(TorchCollectives):
    """The torch backend over a rendezvous store instead of a shared segment."""

    def __init__(self, local: DistLocal, store: str, timeout_s: float, marks: str = "") -> None:
        super().__init__(local, store, timeout_s)  # type: ignore[arg-type]
        local.owner = self
        self.dist_local = local
        self._store: Any = None
        self._marks = marks

    def mark(self, call_id: int, posted: list[int]) -> None:
        """Tell the peers, through the store, that this rank ended a call, and how many
        arrivals of each scope it had posted then. The client waits for no answer, but the
        store's thread in the controller wakes for each set: 22-73 us a call on 2 cores
        (benchmarks/tcp_collectives.py), so only where a peer may wait
        (``DistLocal._marked``). Best effort: a store that is
        gone means the controller is."""
        if self._store is None:  # torch.distributed was started by the user's code
            return
        with contextlib.suppress(RuntimeError):
            self._store.set(_MARK.format(token=self._marks, rank=self.rank),
                            f"{call_id} {posted[0]} {posted[1]}")

    def await_round(self, work: Any, ranks: tuple[int, ...], group: bool, number: int,
                    desc: int) -> None:
        """Wait for arrival ``number`` of a scope, in slices: between them, read the peers'
        marks, and raise where one ended this call before it posted that arrival (it never
        will in this call, so nobody's can finish). Before, the peers waited in gloo's C
        call until the next call's collective or gloo's timeout (300 s)."""
        call = self.dist_local._call
        while True:
            try:
                work.wait(_SLICE)
                return
            except RuntimeError:
                if work.is_completed():  # gloo's own failure (a peer died, its timeout)
                    work.wait()
                    return
            if self._store is None:
                continue
            for j in ranks:
                key = _MARK.format(token=self._marks, rank=j)
                if j == self.rank or not self._store.check([key]):
                    continue
                ended, *posted = (int(v) for v in self._store.get(key).split())
                if ended >= call and posted[group] < number:
                    raise CollectiveError(
                        f"{describe(desc)} on worker {self.rank} gave up: worker {j} left the "
                        f"call without joining it ({LEFT_WHY})", peer=j)

    def _dist(self) -> Any:
        import torch.distributed as dist

        if not self._ready:
            if not dist.is_initialized():
                host, _, port = self.address.rpartition(":")
                store = self._store = dist.TCPStore(  # type: ignore[attr-defined]
                    host, int(port), self.n, False, timeout=datetime.timedelta(seconds=60))
                dist.init_process_group("gloo", store=store, rank=self.rank,
                                        world_size=self.n, timeout=self.timeout)
            self._ready = True
        return dist


def setup(spec: dict[str, Any], rank: int, n: int, groups: int
          ) -> tuple[ShmCollectives | None, ClusterCollectives | None, tuple[bool, bool]]:
    """One worker's backends: shared memory where a scope of it shares a host, torch where
    the session set it up (a store), and which scopes (world, group) run on shared memory."""
    shared = spec.get("shared")
    on_shm = (shared == "world", shared in ("world", "groups"))
    shm = _segment(spec, rank, n, groups) if on_shm[1] else None
    store = spec.get("store")
    if store is None:
        return shm, None, on_shm
    local = DistLocal(rank, n, groups, shm, on_shm)
    return shm, ClusterCollectives(local, store, spec.get("timeout", 300.0),
                                   spec.get("marks", "")), on_shm


def _segment(spec: dict[str, Any], rank: int, n: int, groups: int) -> ShmCollectives:
    """This worker's end of its host's segment: the session's (on the controller's host), or
    the one its host's first worker makes and hands over."""
    if spec.get("fd") is not None:
        return ShmCollectives(spec["fd"], rank, n, groups)
    host = spec["host"]
    if rank == host["first"]:
        fd, _ = create_segment(host["name"], n, groups)
        rendezvous.offer(fd, host["name"], host["peers"])
    else:
        fd = rendezvous.take(host["name"], Layout(n, groups).size)
    return ShmCollectives(fd, rank, n, groups, watch_peers=True)


def missing(shared: str | None) -> tuple[str, str]:
    """Why a collective of the world, or of a group, has no backend in a session without
    torch.distributed ("" where shared memory serves it)."""
    ask = "open it with Session(..., collectives='torch') for collectives across hosts"
    world = "" if shared == "world" else (
        "the workers of this session are not all on one host (or their launcher does not "
        "say where they run), so collectives of the whole session and send/recv cannot use "
        f"shared memory: {ask}")
    group = "" if shared in ("world", "groups") else (
        "some group of this session is not on one host (or the launcher does not say where "
        f"its workers run), so group collectives cannot use shared memory in any group: {ask}")
    return world, group


__all__ = ["ClusterCollectives", "DistLocal", "missing", "setup"]
