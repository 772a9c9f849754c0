"""``pipe``: one ``multiprocessing.Pipe`` per worker. The controller pickles each command once
and writes the bytes to every worker's pipe; each worker runs it and writes its reply back
(pickled, protocol 5); the controller reads the N replies in rank order."""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Sequence
from multiprocessing.connection import Connection
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


def _worker(conn: Connection) -> None:
    worker_setup()
    try:
        while True:
            try:
                data = conn.recv_bytes()
            except EOFError:  # the controller is gone
                return
            op, obj, args = pickle.loads(data)
            del data
            if op == STOP:
                return
            reply = pickle.dumps(execute(op, obj, args), protocol=5)
            conn.send_bytes(reply)
            del reply
    finally:
        conn.close()


class PipeSystem(CommandSystem):
    name = "pipe"
    description = "one multiprocessing.Pipe per worker; each command pickled once"

    def __init__(self) -> None:
        self._procs: list[Any] = []
        self._conns: list[Connection] = []

    def start(self, n: int) -> None:
        ctx = spawn()
        for rank in range(n):
            mine, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_worker, args=(theirs,), daemon=True,
                               name=f"bench-pipe-{rank}")
            self._procs.append(proc)
            self._conns.append(mine)
            proc.start()
            theirs.close()

    def roundtrip(self, op: int, obj: Any = None, args: Sequence[Any] = ()) -> list[Any]:
        data = pickle.dumps((op, obj, args), protocol=5)
        for conn in self._conns:
            conn.send_bytes(data)
        del data
        out = []
        for conn in self._conns:
            try:
                out.append(pickle.loads(conn.recv_bytes()))
            except EOFError:
                raise died(self._procs) or RuntimeError("a worker closed its pipe") from None
        return out

    def close(self, graceful: bool = True) -> None:
        if graceful:
            stop = pickle.dumps((STOP, None, ()))
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(stop)
        stop_processes(self._procs, graceful)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
