"""Ref: a handle to the objects one call left on each of its workers."""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from unison import protocol
from unison.deadline import deadline as _deadline

if TYPE_CHECKING:
    from unison.session import Session


class Ref:
    """The result of a call (or put/scatter) on a set of workers, left where it was made.

    Nothing crosses the process boundary until ``get`` or ``gather`` asks for it. Dropping
    the last reference, or ``free()``, frees the workers' objects with the next message.
    Passed as an argument to a call of the same session, it becomes each worker's own object.
    """

    __slots__ = ("__weakref__", "_freed", "_id", "_session", "workers")

    def __init__(self, session: Session, ref_id: int, workers: tuple[int, ...]) -> None:
        self._session = session
        self._id = ref_id
        self._freed = False
        self.workers = workers
        """The global ranks that hold this Ref's objects, ascending."""

    def get(self, worker: int | None = None, *, timeout: float | None = None) -> Any:
        """One worker's value, copied to the controller. ``worker`` is a global rank and
        defaults to the first of this Ref's workers. ``timeout=0`` is not a poll: the value
        comes in a round trip to the worker, so it raises TimeoutError even for a finished
        call (``sess.sync(timeout=0)`` says whether the workers have done all sent)."""
        rank = self.workers[0] if worker is None else self._session._check_rank(worker, self)
        return self._session._fetch(self, (rank,), _deadline(timeout))[0]

    def gather(self, *, timeout: float | None = None) -> list[Any]:
        """Every worker's value, as a list in rank order (even for one worker)."""
        return self._session._fetch(self, self.workers, _deadline(timeout))

    async def get_async(self, worker: int | None = None, *,
                        timeout: float | None = None) -> Any:
        """``get`` for asyncio: the event loop goes on while the value comes."""
        rank = self.workers[0] if worker is None else self._session._check_rank(worker, self)
        return (await self._session._fetch_async(self, (rank,), timeout))[0]

    async def gather_async(self, *, timeout: float | None = None) -> list[Any]:
        """``gather`` for asyncio; ``await ref`` is the same. Cancelling the awaiting task
        (or ``timeout``) abandons only the wait: the Ref stays valid."""
        return await self._session._fetch_async(self, self.workers, timeout)

    def __await__(self) -> Generator[Any, None, list[Any]]:
        return self.gather_async().__await__()

    def cancel(self, timeout: float | None = 1.0) -> None:
        """Cancel the call behind this Ref on its workers: where it has not started it is
        skipped; where it runs, ``unison.Cancelled`` is raised in it at its next Python
        bytecode. Fetching the Ref then raises ``unison.CancelledError``; the session and
        every other object stay intact. Where the call had already finished, its result
        stays (as with ``concurrent.futures.Future.cancel``, work done is not undone), and
        fetching gives it. Waits up to ``timeout`` seconds (None or inf: while they live) for the
        call to leave every worker, then raises TimeoutError naming those stuck in C code or
        blocking its signal (under 0.1 s, too short for the signal to land: those not yet
        out), where the call goes on, to end cancelled when it returns.
        Raises RuntimeError, cancelling nothing, where a call 2**20 ids away, cancelled
        earlier, still waits on a worker (the two share a word of the cancellation board)."""
        self._session._cancel(self, timeout)

    def free(self) -> None:
        """Free the workers' objects now (with the next message). Idempotent."""
        # also __del__, in any thread: so no lock. The session's free list is a deque, whose
        # append is atomic; the next message to every worker carries it. The append comes
        # first: a Ctrl-C between the two steps then frees it twice (the workers ignore an
        # id they do not hold), never not at all
        if not self._freed:
            self._session._frees.append(self._id)
            self._freed = True

    __del__ = free

    def __reduce__(self) -> tuple[object, tuple[int]]:
        return protocol.ref_reduce(self)

    def __repr__(self) -> str:
        state = " freed" if self._freed else ""
        return f"<unison.Ref #{self._id} on workers {list(self.workers)}{state}>"
