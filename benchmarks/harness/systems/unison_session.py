"""``unison``, ``unison-inline``, ``unison-pipe`` and ``unison-tcp``: a ``unison.Session``
behind the benchmark's interface."""

from __future__ import annotations

import inspect
import os
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

from harness.systems.base import System
from harness.tasks import make_block, small_value, touch


def default_channel() -> str:
    """The channel ``unison.Session(N)`` uses when none is named."""
    import unison

    return str(inspect.signature(unison.Session).parameters["channel"].default)


class UnisonSystem(System):
    """``Session(N)``, or ``Session(N, channel=...)`` when ``channel`` is given, or
    ``Session(N, inline_worker0=True)`` with ``inline``. ``channel="tcp"``: workers as
    plain processes on this host (``unison worker --connect``, as srun or ssh would start
    them) that join over loopback TCP."""

    def __init__(self, name: str, channel: str | None, inline: bool = False) -> None:
        self.name = name
        self.channel = channel
        self.inline = inline
        from unison.channel import shm

        ring = "C" if shm.NATIVE else "pure Python"
        self.description = (
            "Session(N, launcher=ConnectLauncher(...)): workers started as `unison worker "
            "--connect`, joined over loopback TCP" if channel == "tcp"
            else f'Session(N, channel="{channel}")' if channel
            else "Session(N, inline_worker0=True): worker 0's share run by the controller"
            if inline
            else f"Session(N), default channel ({default_channel()}), command ring in {ring}"
        )
        self._sess: Any = None
        self._block: Any = None
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self, n: int) -> None:
        import unison

        if self.channel == "tcp":
            from harness.hand import hand_started

            launcher, self._procs = hand_started(n)
            self._sess = unison.Session(n, launcher=launcher)
        elif self.inline:
            self._sess = unison.Session(n, inline_worker0=True)
        elif self.channel is None:
            self._sess = unison.Session(n)
        else:
            self._sess = unison.Session(n, channel=self.channel)

    @property
    def session(self) -> Any:
        """The open ``unison.Session`` (between ``start`` and ``close``)."""
        return self._sess

    def call(self, fn: Callable[..., object], args: Sequence[Any]) -> None:
        self._sess.call(fn, *args)
        self._sess.sync()

    def gather_small(self) -> list[int]:
        return list(self._sess.run(small_value))

    def put(self, value: Any) -> None:
        ref = self._sess.put(value)
        self._sess.call(touch, ref)  # the workers' mappings fault in here, not after
        self._sess.sync()
        ref.free()

    def hold(self, nbytes: int) -> None:
        if self._block is not None:
            self._block.free()
        self._block = self._sess.call(make_block, nbytes)
        self._sess.sync()

    def fetch(self) -> list[Any]:
        return list(self._block.gather())

    def worker_pids(self) -> list[int]:
        return list(self._sess.run(os.getpid))

    def close(self, graceful: bool = True) -> None:
        self._block = None
        if self._sess is not None:
            self._sess.close(timeout=3.0 if graceful else 0)
            self._sess = None
        for proc in self._procs:
            proc.wait(10)
        self._procs = []
