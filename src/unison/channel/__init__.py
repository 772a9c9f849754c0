"""How bytes travel between the controller and its workers.

    controller                 channel                      worker i
    Session --send(msg, ranks)--> one message, read by -->  WorkerChannel.recv()
    Session <----recv()---------- replies, in order   <--  WorkerChannel.reply(data)

A channel moves opaque messages; it knows nothing of calls or Refs. The controller writes
each message once for any number of workers (a channel may fan it out or share it). Replies
from one worker arrive in the order it sent them. A channel never waits without also
watching the fds it was told to (the workers' pidfds), so a dead peer can never hang a wait.

Backends: ``pipe`` (portable, one pipe pair per worker). The worker process finds its end
through ``connect(spec)`` with the spec the controller's channel gave the launcher.
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
    def started(self) -> None:
        """The workers have inherited their fds: drop the controller's copies of their ends."""

    @abstractmethod
    def send(self, data: bytes, ranks: Sequence[int]) -> None:
        """Deliver one message to each worker in ``ranks`` (in ascending order)."""

    @abstractmethod
    def recv(self, timeout: float | None, watch: Sequence[int] = ()) -> list[tuple[int, bytes | None]]:
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
    def recv(self) -> bytes | None:
        """The next message for this worker, or None once the controller is gone."""

    @abstractmethod
    def reply(self, data: bytes) -> None:
        """Send one reply to the controller."""

    @abstractmethod
    def close(self) -> None: ...


def create(kind: str, num_workers: int, session_name: str) -> Channel:
    if kind == "pipe":
        from unison.channel.pipe import PipeChannel

        return PipeChannel(num_workers)
    raise ValueError(f"unknown channel {kind!r}: use 'pipe'")


def connect(spec: dict[str, Any]) -> WorkerChannel:
    if spec["kind"] == "pipe":
        from unison.channel.pipe import PipeWorkerChannel

        return PipeWorkerChannel(spec)
    raise ValueError(f"unknown channel spec {spec['kind']!r}")
