"""Workers that join by hand: ``unison worker --connect HOST:PORT``, started with srun, ssh, a
container scheduler or a shell.

    controller: Session(n, launcher=ConnectLauncher(bind=..., port=..., secret=...))
                listens, prints how to join, waits up to start_timeout for n workers
    each host:  UNISON_SECRET=<hex> unison worker --connect HOST:PORT [--rank R]

The launcher starts nothing, so it can neither watch nor kill: a worker's death shows as its
connection closing (unison.channel.tcp), and a worker ends when its controller closes the
session or goes away (its keeper sees the connection hang up). Ray is not needed.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
from collections.abc import Callable, Mapping, Sequence

from unison.launch import SECRET_VAR, DeathReport, Launcher, Network
from unison.spec import WorkerSpec

__all__ = ["ConnectLauncher"]


def _env_secret() -> bytes:
    """UNISON_SECRET as bytes (hex, at least 16 bytes), else a fresh random secret."""
    text = os.environ.get(SECRET_VAR, "")
    if not text:
        return secrets.token_bytes(32)
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise ValueError(f"{SECRET_VAR} must hold the session's secret in hex, at least 16 "
                         "bytes (32 hex digits, e.g. secrets.token_hex(32)), and its value does "
                         "not: fix it, or unset it for a fresh random secret")
    return secret


class ConnectLauncher(Launcher):
    """Waits for hand-started workers to connect.

    ``bind`` is the interface to listen on (default: loopback, for workers on this host;
    a cluster's private interface for others, never all of them unless asked with
    "0.0.0.0"); ``advertise`` the host name workers are told (default: ``bind``, or this
    host's name when binding to all); ``port`` 0 picks a free one; ``secret`` (bytes, at
    least 16) defaults to UNISON_SECRET from the environment, else a fresh random one.
    ``announce``: True prints the command that starts a worker once the session listens
    (with the secret where it was drawn here; yours is never printed); a callable is called
    then with the address (HOST:PORT) and the secret, to start the workers itself (through
    ssh, say); False does nothing."""

    def __init__(self, bind: str = "127.0.0.1", port: int = 0, secret: bytes | None = None,
                 advertise: str | None = None,
                 announce: bool | Callable[[str, bytes], None] = True) -> None:
        self._drawn = secret is None and not os.environ.get(SECRET_VAR)
        """Whether the secret is a fresh random one (announce prints it: nobody else knows
        it), not the user's (never printed: a log would keep it)."""
        if secret is None:
            secret = _env_secret()
        if not isinstance(secret, (bytes, bytearray)):
            raise TypeError(f"the secret must be bytes, not {type(secret).__name__} (from hex: "
                            "bytes.fromhex(text))")
        secret = bytes(secret)
        if len(secret) < 16:
            raise ValueError("the secret must be at least 16 bytes")
        if not isinstance(bind, str):  # (else a bare TypeError, or OverflowError for a
            raise TypeError(f"bind must be a host or address as a str, not {bind!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(  # port, at the session's start, not here)
                f"port must be an int from 0 (any free port) to 65535, not {port!r}")
        if advertise is None:
            advertise = socket.gethostname() if bind in ("0.0.0.0", "::", "") else bind
        self._network = Network(bind=bind, advertise=advertise, secret=secret, port=port)
        self._announce = announce
        self.address = ""
        """HOST:PORT, once the session listens (at start)."""

    def network(self) -> Network:
        return self._network

    def start(self, specs: Sequence[WorkerSpec], env: Mapping[int, Mapping[str, str]]) -> None:
        if env:
            raise ValueError("a ConnectLauncher starts no process, so it cannot set a "
                             "worker's environment: set it where you start the workers")
        self.address = specs[0].channel["address"] if specs else ""
        if callable(self._announce):
            self._announce(self.address, self._network.secret)
        elif self._announce:
            given = (f"with {SECRET_VAR} holding your secret in hex (not printed: a log would "
                     "keep it), start each with\n  ")
            drawn = f"start each with\n  {SECRET_VAR}={self._network.secret.hex()} "
            print(f"unison: waiting for {len(specs)} workers; "
                  f"{drawn if self._drawn else given}unison worker --connect {self.address}",
                  file=sys.stderr, flush=True)

    def watch_fds(self) -> list[int]:
        return []

    def ended(self) -> int | None:
        return None  # only the connection can tell

    def death(self, rank: int, grace: float) -> DeathReport:
        return DeathReport(rank, None, "", "a worker started by hand: its exit status and "
                           "output are where it was started")

    def stop(self, grace: float) -> None:
        return None  # the workers end when their connections close
