"""``manager``: a mailbox in a ``multiprocessing.Manager`` server, in the style of
optimum-tpu's root/agent mailbox. The command lives in a ``manager.list``; each worker has a
"bell" and a "ready" ``manager.Event``; replies go into a shared ``manager.list`` (one slot
per worker). Every access is a round trip to the manager process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from harness.systems.base import (
    CALL,
    FETCH,
    RUN,
    STOP,
    CommandSystem,
    died,
    execute,
    spawn,
    stop_processes,
    worker_setup,
)

_REPLIES = frozenset({RUN, FETCH})
"""Commands whose reply goes through the shared list (the rest are acks)."""


def _worker(rank: int, bell: Any, ready: Any, command: Any, outputs: Any) -> None:
    worker_setup()
    try:
        while True:
            bell.wait()
            bell.clear()
            op, obj, args = command[:]  # one round trip: a copy of the whole command
            if op == STOP:
                return
            reply = execute(op, obj, args)
            del obj
            if op in _REPLIES:
                outputs[rank] = reply
            del reply
            ready.set()
    except (EOFError, ConnectionError):  # the manager (and so the controller) is gone
        return


class ManagerSystem(CommandSystem):
    name = "manager"
    description = "a Manager mailbox (manager.Event bells + manager.list), like optimum-tpu's"

    def __init__(self) -> None:
        self._manager: Any = None
        self._procs: list[Any] = []
        self._bells: list[Any] = []
        self._ready: list[Any] = []
        self._command: Any = None
        self._outputs: Any = None

    def start(self, n: int) -> None:
        ctx = spawn()
        self._manager = ctx.Manager()
        self._command = self._manager.list([CALL, None, ()])
        self._outputs = self._manager.list([None] * n)
        for rank in range(n):
            bell, ready = self._manager.Event(), self._manager.Event()
            proc = ctx.Process(
                target=_worker, args=(rank, bell, ready, self._command, self._outputs),
                daemon=True, name=f"bench-manager-{rank}",
            )
            self._bells.append(bell)
            self._ready.append(ready)
            self._procs.append(proc)
            proc.start()

    def roundtrip(self, op: int, obj: Any = None, args: Sequence[Any] = ()) -> list[Any]:
        self._command[:] = [op, obj, args]
        for bell in self._bells:
            bell.set()
        for ready in self._ready:
            while not ready.wait(5.0):
                dead = died(self._procs)
                if dead is not None:
                    raise dead
            ready.clear()
        return list(self._outputs[:]) if op in _REPLIES else [None] * len(self._procs)

    def close(self, graceful: bool = True) -> None:
        if graceful and self._manager is not None:
            try:
                self._command[:] = [STOP, None, ()]
                for bell in self._bells:
                    bell.set()
            except (OSError, EOFError):
                pass
        stop_processes(self._procs, graceful)
        self._bells, self._ready, self._command, self._outputs = [], [], None, None
        if self._manager is not None:
            self._manager.shutdown()
            self._manager = None
        self._procs = []
