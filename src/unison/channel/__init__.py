"""How bytes travel between the controller and its workers.

    controller                 channel                      worker i
    Session --send(msg, ranks)--> one message, read by -->  WorkerChannel.recv()
    Session <----recv()---------- replies, in order   <--  WorkerChannel.reply(data)

A channel moves opaque messages; it knows nothing of calls or Refs. The controller writes
each message once for any number of workers (a channel may fan it out or share it). Replies
from one worker arrive in the order it sent them. A channel never waits without also
watching the fds it was told to (the workers' pidfds), so a dead peer can never hang a wait.

A message may carry out-of-band buffers (pickle protocol 5): the channel moves them as it
sees fit, and the worker gets them back as memoryviews, in order, beside the payload.

Backends: ``shm`` (shared-memory rings and an arena for buffers, the fast one, Linux, up to
64 workers) and ``pipe`` (portable, one pipe pair per worker). ``auto`` picks shm where it
can. The worker process finds its end through ``connect(spec)`` with the spec the
controller's channel gave the launcher.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

__all__ = ["Channel", "WorkerChannel", "connect", "create"]


class Channel(ABC):
    """The controller's end. Used from several threads: send() and recv() are each called
    under the session's own lock for that direction."""

    @abstractmethod
    def endpoint(self, rank: int) -> tuple[dict[str, Any], list[int]]:
        """What worker ``rank`` needs to connect: a picklable spec and fds it must inherit."""

    @abstractmethod
    def started(self, watch: Sequence[int] = ()) -> None:
        """The workers are up: drop the controller's copies of their fds, and from now on
        treat a readable fd in ``watch`` (a worker's pidfd) as a death while waiting."""

    @abstractmethod
    def send(self, data: bytes, ranks: Sequence[int], buffers: Sequence[Any] = ()) -> None:
        """Deliver one message, with its out-of-band buffers (PickleBuffers), to each worker
        in ``ranks`` (ascending). Raises OSError if a worker is gone."""

    @abstractmethod
    def recv(
        self, timeout: float | None, watch: Sequence[int] = ()
    ) -> list[tuple[int, bytes | None]]:
        """Replies available now, waiting up to ``timeout`` for the first one.

        Returns ``(rank, data)`` pairs, with ``data=None`` once a worker's stream has ended.
        Returns early, possibly empty, when one of the ``watch`` fds becomes readable.
        """

    @abstractmethod
    def close(self) -> None:
        """Release every resource; idempotent."""


class WorkerChannel(ABC):
    """A worker's end: one reader of commands, one writer of replies."""

    @abstractmethod
    def recv(self) -> tuple[bytes | memoryview, list[Any]] | None:
        """The next message for this worker and its buffers, or None once the controller is
        gone."""

    @abstractmethod
    def reply(self, data: bytes) -> None:
        """Send one reply to the controller."""

    def ack(self) -> None:
        """Reply "done, nothing to report": the controller reads it as an empty reply."""
        self.reply(b"")

    @abstractmethod
    def close(self) -> None: ...


def create(kind: str, num_workers: int, session_name: str) -> Channel:
    if kind == "auto":
        kind = "shm" if _shm_ok(num_workers) else "pipe"
    if kind == "shm":
        from unison.channel.shm import ShmChannel

        return ShmChannel(num_workers, session_name)
    if kind == "pipe":
        from unison.channel.pipe import PipeChannel

        return PipeChannel(num_workers)
    raise ValueError(f"unknown channel {kind!r}: use 'auto', 'shm' or 'pipe'")


def _shm_ok(num_workers: int) -> bool:
    import os
    import platform

    return (num_workers <= 64 and hasattr(os, "memfd_create") and hasattr(os, "eventfd")
            and platform.machine() in ("x86_64", "AMD64", "i686", "i386"))


def connect(spec: dict[str, Any]) -> WorkerChannel:
    if spec["kind"] == "shm":
        from unison.channel.shm import ShmWorkerChannel

        return ShmWorkerChannel(spec)
    if spec["kind"] == "pipe":
        from unison.channel.pipe import PipeWorkerChannel

        return PipeWorkerChannel(spec)
    raise ValueError(f"unknown channel spec {spec['kind']!r}")
