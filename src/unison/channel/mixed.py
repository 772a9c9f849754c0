"""One session, two channels: shared memory for the workers on the controller's host, TCP for
the others (a Ray cluster, where some actors land beside the driver).

    controller                                        worker
    send(msg, ranks) --+-- local ranks  --> ShmChannel (one ring for the k local workers)
                       +-- other ranks  --> TcpChannel
    recv() <-- both: sleeps on shared memory's eventfd, the local workers' pidfds, and the
               TCP connections' epoll fd; a local worker's pidfd turning readable is its death

Every worker first proves it holds the session's secret; a local one does so over the
session's Unix socket, which hands it the fds of its shared memory (SCM_RIGHTS) and stays
open as its keeper's lifeline. Its pidfd (from the kernel's credentials of that socket) is
then watched as a child's is.

What a mixed session gives up: ``sess.empty`` (its arrays would reach the TCP workers as
copies, so their writes would be lost: refused rather than wrong). Its sync sends nothing
where both halves say all is done: the local workers' done positions in shared memory,
the others' progress reports on their connections (``settled``). Its collectives run on
shared memory where their workers share a host (the local workers get the session's
collective segment with their other fds, through ``offer``), on torch.distributed
elsewhere (unison.collective.cluster).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from unison._fdwait import readable
from unison.channel import (
    Channel,
    PartialSendError,
    Reply,
    SendTimeout,
    half_sent,
    own_error,
)
from unison.channel.shm import ShmChannel
from unison.channel.tcp import TcpChannel, check_frame

__all__ = ["MixedChannel"]


class MixedChannel(Channel):
    """Shared memory for ``local`` ranks, TCP for the rest."""

    wakes_at_deaths = True  # (Channel.wakes_at_deaths)

    arena = None  # sess.empty is refused: TCP workers would get copies (see the docstring)

    def __init__(self, num_workers: int, name: str, local: Sequence[int], bind: str,
                 advertise: str, secret: bytes, port: int = 0) -> None:
        self.local = sorted(local)
        self._index = {g: i for i, g in enumerate(self.local)}
        self.remote = [r for r in range(num_workers) if r not in self._index]
        self._pidfds: dict[int, int] = {}  # local global rank -> its pidfd, once joined
        self._dead: set[int] = set()
        self._lock = threading.Lock()
        self.shm = ShmChannel(len(self.local), name)
        try:
            self.tcp = TcpChannel(num_workers, bind, advertise, secret, port,
                                  local=frozenset(self.local), on_local=self._joined)
        except BaseException:
            self.shm.close()
            raise
        self.shm.also_wake([self.tcp.wait_fd()])
        self.address = self.tcp.address

    # -- set-up --------------------------------------------------------------------------------

    def endpoint(self, rank: int) -> tuple[dict[str, Any], list[int]]:
        """A local rank's shared-memory spec and fds (what it gets once it joined)."""
        if rank in self._index:
            return self.shm.endpoint(self._index[rank])
        return self.tcp.endpoint(rank)

    def launch_endpoint(self, rank: int) -> dict[str, Any]:
        """What a launcher needs to start worker ``rank``: where to join (and for a local
        one, the Unix socket's name)."""
        return self.tcp.endpoint(rank)[0]

    def offer(self, rank: int, init: bytes, fds: Sequence[int] = ()) -> None:
        self.tcp.offer(rank, init, fds)

    def _joined(self, rank: int, pid: int) -> None:
        """A local worker is in: watch its pidfd (its end is its death)."""
        fd = os.pidfd_open(pid)
        with self._lock:
            self._pidfds[rank] = fd
        self.shm.watch_more(fd)

    def started(self, watch: Sequence[int] = ()) -> None:
        self.shm.started(watch)
        self.tcp.started(watch)

    def ended(self) -> int | None:
        """A worker that has ended: a local one's pidfd, or a TCP one's connection."""
        with self._lock:
            fds = {fd: r for r, fd in self._pidfds.items()}
        if fds:
            for fd in readable(list(fds)):
                return fds[fd]
        broken = self.shm.ended()  # a local worker whose reply ring broke the format
        if broken is not None:
            return self.local[broken]
        return self.tcp.ended()

    def death_fds(self) -> list[int]:
        with self._lock:
            return list(self._pidfds.values())

    def where(self, rank: int) -> str:
        if rank not in self._index:
            return self.tcp.where(rank)
        why = self.shm.where(self._index[rank])
        return f"on the controller's host; {why}" if why else "on the controller's host"

    def was_idle(self, rank: int) -> bool:
        return rank in self._index and self.shm.was_idle(self._index[rank])

    # -- traffic -------------------------------------------------------------------------------

    settles = True

    def settled(self, ranks: Sequence[int], timeout: float) -> bool:
        """Channel.settled: the local workers' done positions, then the others' reports,
        within ``timeout`` in all."""
        index = self._index
        near = [index[r] for r in ranks if r in index]
        far = [r for r in ranks if r not in index]
        end = time.monotonic() + timeout
        if near and not self.shm.settled(near, timeout):
            return False
        return not far or self.tcp.settled(far, max(0.0, end - time.monotonic()))

    def holding(self, ranks: Sequence[int]) -> list[int]:
        index = self._index
        near = [index[r] for r in ranks if r in index]
        far = [r for r in ranks if r not in index]
        local = self.local
        return sorted([local[i] for i in self.shm.holding(near)] + self.tcp.holding(far))

    def send(self, data: bytes, ranks: Sequence[int], buffers: Sequence[Any] = (), *,
             deadline: float | None = None) -> None:
        index = self._index
        near = [index[r] for r in ranks if r in index]
        far = [r for r in ranks if r not in index]
        if far and near:  # refused before the local half goes: nothing sent, not half
            check_frame(data, [pb.raw() for pb in buffers])
        if near:
            before = self.shm.published()
            try:
                self.shm.send(data, near, buffers, deadline=deadline)
            except BaseException as exc:  # a handler's, once the entry was published (as the
                if far and not own_error(exc) and self.shm.published() != before:  # C call
                    raise half_sent(exc, "the local workers only") from exc  # returned)
                raise
        if far:
            try:
                self.tcp.send(data, far, buffers, deadline=deadline)
            except SendTimeout as exc:
                if not near:
                    raise
                raise PartialSendError(f"the deadline passed with the message sent to the "
                                       f"local workers only: {exc}") from exc
            except BaseException as exc:
                if not near or own_error(exc):
                    raise
                raise half_sent(exc, "the local workers only") from exc  # (a handler's)

    def recv(
        self, timeout: float | None, watch: Sequence[int] | None = None
    ) -> list[tuple[int, bytes | Reply | None]]:
        out = self._gather(0.0)
        if out or timeout == 0:
            return out
        return self._gather(timeout)

    def _gather(self, timeout: float | None) -> list[tuple[int, bytes | Reply | None]]:
        """Shared memory's replies (waiting up to ``timeout``; TCP data wakes it too), then
        TCP's and the deaths of local workers."""
        local = self.local
        out = [(local[i], data) for i, data in self.shm.recv(timeout)]
        out += self.tcp.recv(0.0)
        with self._lock:
            fds = {fd: r for r, fd in self._pidfds.items() if r not in self._dead}
        if fds and timeout != 0:
            for fd in readable(list(fds)):
                self._dead.add(fds[fd])
                out.append((fds[fd], None))
        return out

    def wake_fds(self) -> list[int]:
        return [*self.shm.wake_fds(), self.tcp.wait_fd()]

    def pending(self) -> bool:
        return self.shm.pending() or self.tcp.pending()

    def async_waiting(self, on: bool) -> None:
        self.shm.async_waiting(on)

    def clear_wake(self) -> None:
        self.shm.clear_wake()
        self.tcp.clear_wake()

    def rearm_wake(self) -> None:
        self.shm.rearm_wake()

    def close(self) -> None:
        self.tcp.linger = self.linger
        self.tcp.close()
        self.shm.close()
        with self._lock:
            for fd in self._pidfds.values():
                os.close(fd)
            self._pidfds = {}
