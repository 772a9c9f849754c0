"""``mpqueue``: one ``multiprocessing.Queue`` of commands per worker, one shared Queue of
``(rank, reply)`` results (``Queue.put`` pickles on its feeder thread, once per queue: that
is how the class works)."""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Sequence
from typing import Any

from harness.systems.base import (
    STOP,
    CommandSystem,
    died,
    execute,
    spawn,
    stop_processes,
    worker_setup,
)


def _worker(rank: int, commands: Any, results: Any) -> None:
    worker_setup()
    parent = multiprocessing.parent_process()
    while True:
        try:
            op, obj, args = commands.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return
            continue
        if op == STOP:
            return
        results.put((rank, execute(op, obj, args)))


class MpQueueSystem(CommandSystem):
    name = "mpqueue"
    description = "a multiprocessing.Queue of commands per worker, one shared Queue of results"

    def __init__(self) -> None:
        self._procs: list[Any] = []
        self._commands: list[Any] = []
        self._results: Any = None

    def start(self, n: int) -> None:
        ctx = spawn()
        self._results = ctx.Queue()
        for rank in range(n):
            commands = ctx.Queue()
            proc = ctx.Process(target=_worker, args=(rank, commands, self._results),
                               daemon=True, name=f"bench-mpqueue-{rank}")
            self._procs.append(proc)
            self._commands.append(commands)
            proc.start()

    def roundtrip(self, op: int, obj: Any = None, args: Sequence[Any] = ()) -> list[Any]:
        for commands in self._commands:
            commands.put((op, obj, args))
        out: list[Any] = [None] * len(self._procs)
        for _ in self._procs:
            while True:
                try:
                    rank, reply = self._results.get(timeout=5.0)
                    break
                except queue.Empty:
                    dead = died(self._procs)
                    if dead is not None:
                        raise dead from None
            out[rank] = reply
        return out

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for commands in self._commands:
                commands.put((STOP, None, ()))
        stop_processes(self._procs, graceful)
        # The workers are gone: whatever a feeder thread still holds is of no use.
        for q in [*self._commands, *([self._results] if self._results is not None else [])]:
            q.cancel_join_thread()
            q.close()
        self._procs, self._commands, self._results = [], [], None
