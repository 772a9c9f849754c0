"""What a worker needs to know to start: made by the session, carried by a launcher, read by
the worker. One typed record on both sides, instead of a dict read by string keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["WorkerSpec"]


@dataclass(frozen=True)
class WorkerSpec:
    """One worker's start-up record (pickled to the worker by its launcher)."""

    rank: int
    world_size: int
    num_groups: int
    channel: dict[str, Any]
    """The channel's own spec for this worker (``channel.connect`` reads it)."""
    sys_path: list[str] = field(default_factory=list)
    """The controller's import path, so functions pickled by reference import here too."""
    cpus: list[int] | None = None
    """CPUs to pin the worker to, or None to leave its affinity alone."""
    collective: dict[str, Any] | None = None
    """The collectives' spec, or None where the session has none (no memfd)."""
    fds: tuple[int, ...] = ()
    """File descriptors the worker must inherit (the channel's and the collectives')."""
    cancel: int = -1
    """The cancellation board's memfd (unison.cancel), or -1 where there is none."""

    @property
    def group(self) -> int:
        return self.rank // self.group_size

    @property
    def group_rank(self) -> int:
        return self.rank % self.group_size

    @property
    def group_size(self) -> int:
        return self.world_size // self.num_groups
