"""The interface every collectives backend implements: one worker's end of the collectives.

    worker loop (worker.serve)        ... user function ........................ end(call id)
        |                                   |
    unison.allreduce(x) ...  ------->  [begin(call id, ranks), at the call's first collective]
                                       Collectives.allreduce(x, op, group)   (collective/__init__)
                                            |
                   ShmCollectives (shm.py)  or  TorchCollectives (torch.py)

``end`` follows every call a worker runs, so a backend can tell a peer that left the call
from a slow one; ``begin`` comes with a call's first collective (most calls run none, and
a method call before each was 8% of the worker loop's instructions), or at the call's start
where the backend ``held`` something of an ended call. Arguments
reach a backend as the public functions take them (``src``/``dst`` are group-local with
``group=True``); the checks every backend shares live in collective/checks.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence, Sized
from typing import Any


class Collectives(ABC):
    """One worker's end of the worker-to-worker collectives, for the call it runs now.

    ``rank`` is the worker's global rank, ``n`` the world size, ``groups`` the number of
    groups and ``gsize`` the workers per group. Every collective returns new objects and
    leaves its input unchanged; one that cannot complete raises CollectiveError.
    """

    rank: int
    n: int
    groups: int
    gsize: int
    held: Sized
    """What the backend still holds for peers from calls that ended (the shared-memory
    backend's message spills): while it is not empty, the worker loop begins each call at
    its start, so that what peers took since is let go of at once."""
    give_up_at: float | None = None
    """Worker 0 inline in the controller: when (``time.monotonic``) its waits for peers give
    up, the deadline of the controller's call that runs it, which can wait no longer; None:
    as long as the peers live. A backend whose waits are not its own (torch's) leaves them
    to their own timeouts."""
    hang: Callable[[object, Sequence[int]], str | None] | None = None
    """Worker 0 inline, in a session with hang_timeout: given a wait's key and the peers it
    waits for, the report once none of them has progressed for hang_timeout, else None
    (unison.debug.hang's Watchdog.stuck). No controller wait samples the peers while the
    controller's thread waits in worker 0's collective, which would otherwise wait for ever."""

    @abstractmethod
    def begin(self, call_id: int, ranks: tuple[int, ...] | None) -> None:
        """The worker runs call ``call_id`` (run by ``ranks``, None: every worker), and
        this is its first collective."""

    @abstractmethod
    def end(self, call_id: int) -> None:
        """The worker finished call ``call_id``: peers still waiting for it give up."""

    @abstractmethod
    def barrier(self, group: bool) -> None:
        """Wait until every worker of the scope got here."""

    @abstractmethod
    def allreduce(self, x: Any, op: str, group: bool) -> Any:
        """x0 op x1 op ... over the scope, in rank order, on every worker."""

    @abstractmethod
    def reduce_scatter(self, x: Any, op: str, group: bool) -> Any:
        """Share r (split along axis 0) of the allreduce, on worker r of the scope."""

    @abstractmethod
    def allgather(self, x: Any, group: bool) -> list[Any]:
        """Every worker's x, in rank order, on every worker."""

    @abstractmethod
    def broadcast(self, x: Any, src: int, group: bool) -> Any:
        """Worker ``src``'s x on every worker."""

    @abstractmethod
    def scatter(self, xs: Sequence[Any] | None, src: int, group: bool) -> Any:
        """Element r of worker ``src``'s list, on worker r."""

    @abstractmethod
    def gather(self, x: Any, dst: int, group: bool) -> list[Any] | None:
        """Every worker's x, in rank order, on worker ``dst``; None on the others."""

    @abstractmethod
    def send(self, x: Any, dst: int) -> None:
        """Queue x for worker ``dst`` (global rank); returns once x is copied out."""

    @abstractmethod
    def recv(self, src: int) -> Any:
        """The next object worker ``src`` (global rank) sent to this worker in this call."""
