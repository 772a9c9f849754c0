"""Everything a session holds outside Python, owned in one place: the channel, the collective
segment, the cancellation board and the launcher's workers. Made in order, released in
reverse, on every path:

    Resources(...)   channel -> collective segment -> board   (a failure releases what was made;
                     workers that join over TCP: the segment of the workers on this host,
                     if the session's collectives use one, and torch's rendezvous store)
    start(specs)     launcher starts the workers; the channel learns which fds mean a death
    on_death(rank)   peers in a collective give up; the dead worker is described, its tree killed
    close(grace)     workers stopped (after grace); then ``before_release`` (read what they
                     left); then channel and segment closed. Idempotent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import pickle
import secrets
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from unison import _native
from unison import channel as channels
from unison.cancel import Board
from unison.collective import shm as collective_shm
from unison.launch import DeathReport, Launcher, Network
from unison.spec import WorkerSpec

if TYPE_CHECKING:
    from unison.debug.hang import Watchdog

__all__ = ["Resources", "open_std_fds", "sys_path"]


class Resources:
    """The OS resources of one session."""

    def __init__(self, name: str, num_workers: int, num_groups: int, channel: str,
                 collectives: str, launcher: Launcher) -> None:
        self.launcher = launcher
        self._lock = threading.Lock()
        self._closed = False
        self.coll_fd = -1
        self.board: Board | None = None
        self._store: Any = None
        self._store_sock: socket.socket | None = None
        """A local torch session's rendezvous socket, bound and listening here and served by
        worker 0 (``store_fd``): a port found free and let go, then bound again by worker
        0, could be taken by another process in between."""
        network = launcher.network()
        self.coll_spec: dict[str, Any] | None = None
        self._coll_specs: list[dict[str, Any]] = []  # per rank, where the workers join over TCP
        if network is not None:  # workers elsewhere: TCP (and shared memory beside us)
            if channel not in ("auto", "tcp"):
                raise ValueError(
                    f"the {type(launcher).__name__}'s workers join over TCP: channel "
                    f"{channel!r} cannot reach them (leave channel='auto')")
            try:  # placing the workers may have taken cluster resources: give them back
                self.chan, local = _network_channel(
                    name, num_workers, num_groups, channel, launcher, network)
            except BaseException:
                launcher.stop(0)
                raise
            try:
                self._coll_specs = self._cluster_collectives(
                    name, num_workers, num_groups, collectives, launcher, network, local)
            except BaseException:
                if self.coll_fd >= 0:
                    os.close(self.coll_fd)
                    self.coll_fd = -1
                self.chan.close()
                launcher.stop(0)
                raise
            return
        if channel == "tcp":
            raise ValueError("channel='tcp' is for launchers whose workers join over TCP "
                             "(launcher='ray' or 'connect')")
        self.chan = channels.create(channel, num_workers, name)
        try:
            if hasattr(os, "memfd_create"):  # else no collectives: they say so when called
                self.coll_fd, _ = collective_shm.create(name, num_workers, num_groups)
                address = None
                if collectives == "torch":
                    self._store_sock = _loopback_listener()
                    address = f"127.0.0.1:{self._store_sock.getsockname()[1]}"
                self.coll_spec = {
                    "fd": self.coll_fd, "backend": collectives, "torch_address": address,
                }
                if _native.ordered_memory():  # else cancel says why (unordered_why)
                    self.board = Board(num_workers, name)
        except BaseException:
            if self.coll_fd >= 0:
                os.close(self.coll_fd)
            if self._store_sock is not None:
                self._store_sock.close()
            self.chan.close()
            raise

    def _cluster_collectives(self, name: str, n: int, groups: int, collectives: str,
                             launcher: Launcher, network: Network, local: frozenset[int]
                             ) -> list[dict[str, Any]]:
        """Each worker's collective spec where the workers join over TCP: shared memory for
        the scopes that sit on one host, torch.distributed (collectives="torch") for the
        rest (unison.collective.cluster). The workers on this host (``local``) get the
        session's segment with their channel's fds; those of another host, a name under
        which the host's first worker hands them its own (collective/rendezvous.py)."""
        nodes = launcher.nodes(n, groups)
        hosts = ["" if r in local else nodes.get(r) for r in range(n)]  # "": this host
        shared = _shared(hosts, n // groups) if hasattr(os, "memfd_create") else None
        store = None
        if collectives == "torch":  # the rendezvous lives here, where every worker can reach
            self._store = _torch_store(network.bind)
            store = f"{network.advertise}:{self._store.port}"
        base: dict[str, Any] = {"backend": "cluster", "store": store, "shared": shared,
                                "marks": secrets.token_hex(16)}  # (cluster.py: _MARK)
        if shared is None:
            return [base] * n
        token = secrets.token_hex(8)  # the rendezvous names: known only to the workers
        out = []
        for host in hosts:
            if host == "":
                if self.coll_fd < 0:
                    self.coll_fd, _ = collective_shm.create(name, n, groups)
                out.append({**base, "fd": self.coll_fd})
            else:
                first = hosts.index(host)
                out.append({**base, "host": {"name": f"{name}-{token}-{first}", "first": first,
                                             "peers": hosts.count(host) - 1}})
        return out

    def inline_worker0(self) -> Callable[[float | None], None]:
        """Worker 0 in this process from now on (unison.launch.inline); the function that
        runs its share of what was sent (after every send)."""
        from unison.channel.shm import ShmChannel
        from unison.launch.inline import InlineLauncher

        if not isinstance(self.chan, ShmChannel):
            raise ValueError("inline_worker0 needs the shared-memory channel")
        inline = InlineLauncher(self.launcher, self.chan)
        self.launcher = inline
        return inline.pump

    def watch_hangs(self, watchdog: Watchdog) -> None:
        """Worker 0 inline: its collectives watch the peers for hangs too."""
        from unison.launch.inline import InlineLauncher

        assert isinstance(self.launcher, InlineLauncher)
        self.launcher.watch_hangs(watchdog)

    def specs(self, num_workers: int, num_groups: int, cpus: Mapping[int, list[int]],
              spread: bool = False) -> list[WorkerSpec]:
        """What each worker needs to start (what its launcher gets); ``spread``: ``cpus``
        came from ``cpu_affinity=None`` (WorkerSpec.spread)."""
        out = []
        self._offers: list[WorkerSpec] = []
        launch_endpoint = getattr(self.chan, "launch_endpoint", None)
        for rank in range(num_workers):
            chan_spec, fds = self.chan.endpoint(rank)
            coll = self._coll_specs[rank] if self._coll_specs else self.coll_spec
            if launch_endpoint is not None:  # mixed: a local worker gets its fds on joining
                if coll is not None and coll.get("fd") is not None:
                    fds = [*fds, coll["fd"]]
                spec = WorkerSpec(
                    rank=rank, world_size=num_workers, num_groups=num_groups,
                    channel=chan_spec, sys_path=sys_path(), cpus=cpus.get(rank),
                    spread=spread, collective=coll, fds=tuple(fds))
                self._offers.append(spec)
                out.append(dataclasses.replace(spec, channel=launch_endpoint(rank), fds=()))
                continue
            if self.coll_fd >= 0:
                fds = [*fds, self.coll_fd]
            if rank == 0 and self._store_sock is not None:  # worker 0 serves the rendezvous
                assert coll is not None
                coll = {**coll, "store_fd": self._store_sock.fileno()}
                fds = [*fds, self._store_sock.fileno()]
            board = -1 if self.board is None else self.board.fd
            if board >= 0:
                fds = [*fds, board]
            out.append(WorkerSpec(
                rank=rank, world_size=num_workers, num_groups=num_groups, channel=chan_spec,
                sys_path=sys_path(), cpus=cpus.get(rank), spread=spread, collective=coll,
                fds=tuple(fds), cancel=board,
            ))
        return out

    def start(self, specs: list[WorkerSpec], env: Mapping[int, Mapping[str, str]],
              deadline: float | None = None) -> None:
        """Start the workers (``deadline``: the session's start deadline, for the launcher)."""
        offer = getattr(self.chan, "offer", None)
        if offer is not None:  # TCP: each worker gets its spec once it has proved itself,
            for spec in getattr(self, "_offers", None) or specs:  # without the secret: the
                # welcome crosses the network in clear (the launcher's copy keeps it, for
                # the worker's command: an audit, issue 9, forty-seventh pass, caught it on
                # the wire, and joined the session with it)
                sent = {k: v for k, v in spec.channel.items() if k != "secret"}
                offer(spec.rank, pickle.dumps(dataclasses.replace(spec, channel=sent),
                                              protocol=5), spec.fds)
        self.launcher.start_deadline = deadline
        self.launcher.start(specs, env)
        self.chan.started(self.launcher.watch_fds())

    @property
    def watched(self) -> bool:
        """Whether a death wakes a waiting recv at once (else waits poll every 50 ms): the
        launcher's pidfds, or the channel's own wake (Channel.wakes_at_deaths; a worker that
        dies before it joins is the launcher's to tell, at each half-second slice)."""
        return bool(self.launcher.watch_fds()) or self.chan.wakes_at_deaths

    def ended(self) -> int | None:
        """A worker that has ended, as its launcher or (TCP) its connection tells."""
        rank = self.launcher.ended()
        return self.chan.ended() if rank is None else rank

    def on_death(self, rank: int | None, grace: float = 1.0) -> DeathReport:
        """A worker ended (``rank``, or whichever did): stop peers waiting in a collective for
        it, and describe it."""
        if rank is None:
            rank = self.ended()
        if rank is None:
            rank = 0
        if self.coll_fd >= 0:
            collective_shm.abort(self.coll_fd, rank)
        report = self.launcher.death(rank, grace)
        parts = [self.launcher.describe(rank), self.chan.where(rank), report.reason]
        reason = "; ".join(p for p in parts if p)
        return DeathReport(report.rank, report.exitcode, report.output, reason)

    def close(self, grace: float, before_release: Callable[[], None] | None = None,
              guard: AbstractContextManager[Any] | None = None) -> None:
        """Stop the workers (waiting up to ``grace`` for them), then release everything.
        ``before_release`` runs once the workers are gone and the channel is still open;
        it and the channel's close run inside ``guard`` (the session's locks)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.launcher.stop(grace)
        finally:
            try:
                with guard or contextlib.nullcontext():
                    try:
                        if before_release is not None:
                            before_release()
                    finally:
                        self.chan.linger = min(grace, 2.0)  # TCP: let the workers hang up
                        self.chan.close()
            finally:  # whatever before_release raised: nothing may outlive the close
                if self.coll_fd >= 0:
                    os.close(self.coll_fd)
                    self.coll_fd = -1
                if self.board is not None:
                    self.board.close()
                self._store = None  # its server thread ends with the object
                if self._store_sock is not None:
                    self._store_sock.close()


def open_std_fds() -> None:
    """Open os.devnull onto whichever of fds 0, 1 and 2 is closed (a daemon's, cron's,
    ``prog <&-``), as daemons do: else the session's memfds and pipes take those numbers,
    and a worker's start, which sets its stdin, stdout and stderr there, overwrites them
    (its ring then failed to map, or the pipe channel waited for good)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError as exc:
            if exc.errno != errno.EBADF:
                continue
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd, unless a
            if null != fd:  # thread took it meanwhile
                os.dup2(null, fd)
                os.close(null)
            else:
                os.set_inheritable(fd, True)  # as a standard stream is


def sys_path() -> list[str]:
    """The controller's import path, for the workers (so functions pickled by reference and
    the classes of arguments import there too). ``""`` is the current folder, now."""
    if "" not in sys.path:
        return list(sys.path)
    try:
        here = os.getcwd()
    except FileNotFoundError:
        raise FileNotFoundError(
            "the current folder was removed, and sys.path holds '' (the current folder, as "
            "under python -c or a notebook), which the workers would import from: os.chdir "
            "to a folder that exists before starting a Session") from None
    return [here if p == "" else p for p in sys.path]


def _network_channel(name: str, num_workers: int, num_groups: int, channel: str,
                     launcher: Launcher, network: Network
                     ) -> tuple[channels.Channel, frozenset[int]]:
    """TCP for workers elsewhere; shared memory beside it for those on this host (where the
    launcher says which they are, and ``channel`` is not "tcp"). Also returns the ranks on
    shared memory, which receive their fds on joining."""
    local = launcher.local_ranks(num_workers, num_groups) if channel != "tcp" else frozenset()
    if local and channels.shm_ok(len(local)):
        from unison.channel.mixed import MixedChannel

        return MixedChannel(num_workers, name, sorted(local), network.bind, network.advertise,
                            network.secret, network.port), local
    from unison.channel.tcp import TcpChannel

    return TcpChannel(num_workers, network.bind, network.advertise, network.secret,
                      network.port), frozenset()


def _shared(hosts: list[str | None], size: int) -> str | None:
    """Which scopes sit on one host, given each rank's host (None: unknown): "world",
    "groups" (each group on one, ``size`` ranks each) or None."""
    def one(part: list[str | None]) -> bool:
        return part[0] is not None and len(set(part)) == 1

    if one(hosts):
        return "world"
    if all(one(hosts[g : g + size]) for g in range(0, len(hosts), size)):
        return "groups"
    return None


def _loopback_listener() -> socket.socket:
    """A socket listening on loopback at a free port: a local session's torch rendezvous,
    handed to worker 0 (``store_fd``)."""
    return socket.create_server(("127.0.0.1", 0), backlog=128)  # (not inheritable: the
    # launcher's pass_fds hands it to worker 0 alone)


def _torch_store(bind: str) -> Any:
    """torch.distributed's key-value store for the workers' rendezvous, served by the
    controller (the one host every worker of a TCP session reaches), listening where the
    session's channel listens (``serve_store``: before, on every interface, with the
    controller bound to loopback: an audit, issue 9, forty-seventh pass)."""
    try:
        import torch.distributed  # noqa: F401

        from unison.collective.torch import serve_store
    except ImportError as exc:
        raise ImportError("collectives='torch' needs torch on the controller too: "
                          "pip install 'unison[torch]'") from exc
    # "" binds every interface for a socket, but the store's own client cannot resolve it
    # and retried for torch's 300 s (past the session's start_timeout)
    return serve_store({"": "0.0.0.0"}.get(bind, bind), 0, None, wait_for_workers=False)
