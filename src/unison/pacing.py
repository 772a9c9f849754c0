"""How unison's waits pass time: yield the core for a short budget, then sleep.

    wait starts --> spin(ready, budget): sched_yield, check, ... --> ready: go on at once
                       | budget spent
                       v
                    event waits (channel recv): sleep on a kernel object (eventfd + pidfds)
                    polling waits (Pacer.pause): sleep naps of 20 us, 40 us, ... up to a cap

Every loop that waits for another process to move (a reply, room in a ring, a peer in a
collective) uses these two pieces, each with its own budget and cap, so that a quick answer
is caught without a kernel wake-up and an idle wait costs (almost) no CPU. Yielding rather
than pure spinning keeps a machine with more workers than cores usable.

The waits and their parameters:

    channel.shm   controller recv, worker recv   spin 200 us, then sleep on an eventfd
    channel.shm   command ring full (controller) Pacer(cap=5 ms), bounded by the deadline
    channel.shm   reply ring full (worker)       Pacer(cap=5 ms)
    channel.pipe  command pipe full (deadline)   Pacer(cap=5 ms), bounded by the deadline
    collective    peers, p2p queues              Pacer(spin=1 ms, cap=2 ms)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

__all__ = ["FIRST_NAP", "Pacer", "spin"]

FIRST_NAP = 20e-6
"""The first nap of a Pacer once its spin budget is spent (s); each next nap doubles."""

_yield = os.sched_yield
_clock = time.perf_counter


def spin(ready: Callable[[], bool], budget: float) -> bool:
    """Yield the core and check ``ready()`` until it is true or ``budget`` seconds passed.

    Returns whether ``ready()`` became true: when not, the caller sleeps on a kernel object
    (and must check again after announcing that it sleeps)."""
    end = _clock() + budget
    while _clock() < end:
        _yield()
        if ready():
            return True
    return False


class Pacer:
    """One polling wait: each ``pause()`` yields the core while within ``spin`` seconds of
    the Pacer's creation, and past that sleeps, first ``nap`` seconds, doubling each time up
    to ``cap``. Make a new Pacer for each wait: the schedule starts at its creation."""

    __slots__ = ("_cap", "_nap", "_spin_end")

    def __init__(self, spin: float = 0.0, nap: float = FIRST_NAP, cap: float = 5e-3) -> None:
        self._spin_end = _clock() + spin if spin > 0 else 0.0
        self._nap = nap
        self._cap = cap

    def pause(self, deadline: float | None = None) -> None:
        """Let time pass once. ``deadline`` (time.monotonic()): never sleep past it; the
        caller checks the deadline itself."""
        if self._spin_end and _clock() < self._spin_end:
            _yield()
            return
        nap = self._nap
        self._nap = min(nap * 2, self._cap)
        if deadline is not None:
            nap = max(0.0, min(nap, deadline - time.monotonic()))
        time.sleep(nap)
