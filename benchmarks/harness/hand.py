"""Workers started by hand: ``unison worker --connect`` processes on this host, as srun or
ssh would start them, that join a session over loopback TCP (so the session has no pidfds
to watch, and its collectives with ``collectives="torch"`` go through gloo, as across
hosts)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import unison
from unison.launch import SECRET_VAR
from unison.launch.connect import ConnectLauncher


def hand_started(n: int) -> tuple[ConnectLauncher, list[subprocess.Popen[bytes]]]:
    """A launcher that starts ``n`` workers as the session listens, and the list of their
    processes, filled then: end them (``stop``) once the session is closed."""
    procs: list[subprocess.Popen[bytes]] = []

    def announce(address: str, secret: bytes) -> None:
        env = {**os.environ, SECRET_VAR: secret.hex()}
        procs.extend(subprocess.Popen([sys.executable, "-m", "unison", "worker", "--connect",
                                       address], env=env) for _ in range(n))

    return ConnectLauncher(announce=announce), procs


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill and reap what ``hand_started`` started (a closed session's workers have left)."""
    for p in procs:
        p.kill()
        p.wait()
    procs.clear()


@contextlib.contextmanager
def hand_session(n: int, **kw: Any) -> Iterator[unison.Session]:
    """``unison.Session(n, **kw)`` of ``n`` workers started by hand; they end with it."""
    launcher, procs = hand_started(n)
    try:
        with unison.Session(n, launcher=launcher, **{"start_timeout": 60, **kw}) as sess:
            yield sess
    finally:
        stop(procs)
