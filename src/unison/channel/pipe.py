"""The pipe channel: one pipe pair per worker, portable and simple.

    controller                                    worker i
    cmd[i].send_bytes(msg)  ---- pipe ---->  reader thread -> queue -> recv()
    recv() <- wait(replies) <--- pipe -----  reply(data)

The worker drains its command pipe on a thread of its own, so the controller's writes never
block behind a long call, and the controller never has to read and write at once to avoid
a deadlock. It costs a thread hand-off per message; the shared-memory channel is the fast one.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from unison.channel import Channel, WorkerChannel

_MULTI = b"UB"  # a frame announcing N buffer frames after the message (pickles start b"\x80")


class PipeChannel(Channel):
    def __init__(self, num_workers: int) -> None:
        self._cmd: list[Connection] = []
        self._replies: list[Connection] = []
        self._child_fds: list[tuple[int, int]] = []
        for _ in range(num_workers):
            cmd_r, cmd_w = os.pipe()
            rep_r, rep_w = os.pipe()
            self._cmd.append(Connection(cmd_w, readable=False))
            self._replies.append(Connection(rep_r, writable=False))
            self._child_fds.append((cmd_r, rep_w))
        self._rank_of = {c.fileno(): i for i, c in enumerate(self._replies)}
        self._open = list(self._replies)

    def endpoint(self, rank: int) -> tuple[dict[str, Any], list[int]]:
        cmd_r, rep_w = self._child_fds[rank]
        return {"kind": "pipe", "cmd": cmd_r, "reply": rep_w}, [cmd_r, rep_w]

    def started(self, watch: Sequence[int] = ()) -> None:
        for pair in self._child_fds:
            for fd in pair:
                _close_fd(fd)
        self._child_fds = []

    def send(self, data: bytes, ranks: Sequence[int], buffers: Sequence[Any] = ()) -> None:
        for r in ranks:
            conn = self._cmd[r]
            if buffers:
                conn.send_bytes(_MULTI + len(buffers).to_bytes(4, "little"))
            conn.send_bytes(data)
            for pb in buffers:
                conn.send_bytes(pb.raw())

    def recv(
        self, timeout: float | None, watch: Sequence[int] = ()
    ) -> list[tuple[int, bytes | None]]:
        ready = wait([*self._open, *watch], timeout)
        out: list[tuple[int, bytes | None]] = []
        for conn in ready:
            if not isinstance(conn, Connection):
                continue
            rank = self._rank_of[conn.fileno()]
            try:
                out.append((rank, conn.recv_bytes()))
            except (EOFError, OSError):
                self._open.remove(conn)
                out.append((rank, None))
        return out

    def close(self) -> None:
        for conn in (*self._cmd, *self._replies):
            try:
                conn.close()
            except OSError:
                pass  # already closed by its own finalizer (garbage collection of a cycle)
        self._open = []
        self.started()


class PipeWorkerChannel(WorkerChannel):
    def __init__(self, spec: dict[str, Any]) -> None:
        self._cmd = Connection(spec["cmd"], writable=False)
        self._reply = Connection(spec["reply"], readable=False)
        self._inbox: queue.SimpleQueue[tuple[bytes, list[Any]] | None] = queue.SimpleQueue()
        threading.Thread(target=self._drain, name="unison-cmd-reader", daemon=True).start()

    def _drain(self) -> None:
        recv = self._cmd.recv_bytes
        try:
            while True:
                data = recv()
                if data[:2] == _MULTI:
                    count = int.from_bytes(data[2:], "little")
                    data = recv()
                    self._inbox.put((data, [recv() for _ in range(count)]))
                else:
                    self._inbox.put((data, []))
        except (EOFError, OSError):
            self._inbox.put(None)

    def recv(self) -> tuple[bytes, list[Any]] | None:
        return self._inbox.get()

    def reply(self, data: bytes) -> None:
        self._reply.send_bytes(data)

    def close(self) -> None:
        self._reply.close()


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
