"""What a worker needs to know to start: made by the session, carried by a launcher, read by
the worker. One typed record on both sides, instead of a dict read by string keys."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["WorkerSpec"]

_FD_KEYS = {"shm": ("ctl", "arena", "reply_arena", "efd", "ctl_efd", "done_efd"),
            "pipe": ("cmd", "reply", "arena")}
"""Which entries of each channel's spec are fds (the rest are plain numbers: rank, n)."""


@dataclass(frozen=True)
class WorkerSpec:
    """One worker's start-up record (pickled to the worker by its launcher)."""

    rank: int
    world_size: int
    num_groups: int
    channel: dict[str, Any] = field(repr=False)
    """The channel's own spec for this worker (``channel.connect`` reads it). Not in the
    repr: a TCP session's launcher copy holds the secret, and a repr goes into logs."""
    sys_path: list[str] = field(default_factory=list)
    """The controller's import path, so functions pickled by reference import here too."""
    cpus: list[int] | None = None
    """CPUs to pin the worker to, or None to leave its affinity alone."""
    spread: bool = False
    """``cpus`` came from ``cpu_affinity=None`` (unison.placement.spread_plan): held only
    while the machine is calm."""
    collective: dict[str, Any] | None = None
    """The collectives' spec, or None where the session has none (no memfd)."""
    fds: tuple[int, ...] = ()
    """File descriptors the worker must inherit (the channel's and the collectives')."""
    cancel: int = -1
    """The cancellation board's memfd (unison.cancel), or -1 where there is none."""

    def with_fds(self, fds: Sequence[int]) -> WorkerSpec:
        """This spec in a process that received its fds (in ``self.fds`` order, over a Unix
        socket) instead of inheriting them under the same numbers."""
        if len(fds) != len(self.fds):
            raise ValueError(f"worker {self.rank} expected {len(self.fds)} fds, got {len(fds)}")
        move = dict(zip(self.fds, fds))
        chan = dict(self.channel)
        for key in _FD_KEYS.get(chan.get("kind", ""), ()):
            if chan.get(key) is not None:
                chan[key] = move[chan[key]]
        coll = None if self.collective is None else dict(self.collective)
        for key in ("fd", "store_fd"):
            if coll is not None and coll.get(key) is not None:
                coll[key] = move[coll[key]]
        cancel = move[self.cancel] if self.cancel >= 0 else -1
        return dataclasses.replace(self, channel=chan, collective=coll, cancel=cancel,
                                   fds=tuple(fds))

    @property
    def group(self) -> int:
        return self.rank // self.group_size

    @property
    def group_rank(self) -> int:
        return self.rank % self.group_size

    @property
    def group_size(self) -> int:
        return self.world_size // self.num_groups
