"""How workers start, are watched and are stopped: the Launcher seam, and ``create``.

    session                                   a Launcher (``local``: processes on this host)
    create("local" | launcher) ------------>  the launcher to use
    start(specs, env) --------------------->  one worker per WorkerSpec, carried to it
    watch_fds()  <-------------------------   fds that turn readable when a worker ends;
                                              the channel's waits sleep on them
    ended()      <-------------------------   which worker has ended, if any (polled)
    death(rank, grace)  ------------------>   its DeathReport: exit status, stderr tail, why
    stop(grace)  -------------------------->  every worker gone, nothing left behind

The session knows only this interface; how a worker gets its spec, what keeps it from
outliving the controller and how its output reaches the user are each launcher's business.
``Session(launcher=...)`` takes a name or an instance, as httpx's ``Client(transport=...)``.
"""

from __future__ import annotations

import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from unison.spec import WorkerSpec

__all__ = ["DeathReport", "Launcher", "Network", "connect_command", "create"]

NAMES = ("local", "connect", "ray")
SECRET_VAR = "UNISON_SECRET"
"""The environment variable that carries a session's secret (hex) to ``unison worker``."""
"""The launchers ``create`` knows by name."""


@dataclass(frozen=True)
class DeathReport:
    """What a launcher knows about a worker that ended (the makings of a WorkerDied)."""

    rank: int
    exitcode: int | None
    """Its exit status, negative for a signal as in subprocess; None where it is unknown."""
    output: str
    """The tail of what it wrote to stderr, bounded by the launcher."""
    reason: str
    """Why it ended, where the launcher knows better than the exit status; else ""."""


@dataclass(frozen=True)
class Network:
    """Where a session's workers join over TCP (unison.channel.tcp): the controller listens
    on ``bind``:``port`` (0: a free port) and tells workers to connect to ``advertise``;
    both ends prove they hold ``secret`` before anything else crosses."""

    bind: str
    advertise: str
    secret: bytes = field(repr=False)  # (a repr goes into logs)
    port: int = 0


class Launcher(ABC):
    """Starts a session's workers, tells it when one ends, and stops them.

    The contract:

    * ``start`` is called once, with one WorkerSpec per rank (ranks 0..n-1, in order). Each
      worker must receive its spec and inherit the fds it names. If starting fails, whatever
      was started is stopped before the error is raised.
    * ``watch_fds`` are file descriptors that become readable once a worker has ended, so
      a waiting controller wakes at once. It may be empty: the session then polls ``ended``.
      They stay owned by the launcher and valid until ``stop``.
    * ``ended`` never blocks: the rank of a worker that has ended, or None.
    * ``death`` describes one worker for the user: it waits up to ``grace`` seconds for the
      worker's exit and kills it (with all it started) if it still runs.
    * ``stop`` waits up to ``grace`` seconds for every worker to exit, then kills what is
      left, its process trees included, and releases the launcher's resources. It is
      idempotent, and may be called after a failed ``start``.

    No method is on the hot path: the session calls them at start, on a death and at close.

    A launcher whose workers run elsewhere (another host, a Ray actor, a hand-started
    process) returns a ``Network`` from ``network()``: the session then uses the TCP channel,
    and each spec's channel names the address (``spec.channel["address"]``) and the secret
    (``spec.channel["secret"]``, hex) the worker needs: ``connect_command`` builds its
    command line. Such workers cannot be watched through pidfds: a death shows as their
    connection closing.
    """

    start_deadline: float | None = None
    """The session's start deadline (``time.monotonic()``; None: none), set before
    ``start``: a launcher that waits while it starts gives up then, with TimeoutError
    (``unison.errors.start_timed_out`` says it)."""

    children = False
    """Whether the workers are child processes on the controller's host, sharing its CPUs:
    ``cpu_affinity=None`` then spreads them over the CPUs where they outnumber them
    (unison.placement.spread_plan)."""

    def network(self) -> Network | None:
        """Where workers join over TCP, or None for workers that inherit the channel's fds
        (called once, before the channel is made; it may connect to a cluster)."""
        return None

    def local_ranks(self, num_workers: int, num_groups: int) -> frozenset[int]:
        """Of a TCP launcher's workers, the ranks that will run on the controller's host
        (called once, after ``network()``, before ``start``; it may place the workers to
        know). They use shared memory (channel.mixed); the others TCP. None by default."""
        return frozenset()

    def nodes(self, num_workers: int, num_groups: int) -> Mapping[int, str]:
        """Of a TCP launcher's workers, the host each will run on, as far as it knows (called
        once, before ``start``; it may place the workers to know): rank -> a label, equal
        for ranks on one host. Workers of one host share a collective segment, so a session
        whose groups each sit on one host runs its group collectives on shared memory
        (unison.collective.cluster). Ranks left out: unknown (the default: all)."""
        return {}

    def describe(self, rank: int) -> str:
        """Where worker ``rank`` runs, for error messages ("" where nothing is worth
        saying, as for a local process)."""
        return ""

    @abstractmethod
    def start(self, specs: Sequence[WorkerSpec], env: Mapping[int, Mapping[str, str]]) -> None:
        """Start one worker per spec; ``env[rank]`` adds to that worker's environment."""

    @abstractmethod
    def watch_fds(self) -> list[int]:
        """Fds that become readable when a worker ends (may be empty)."""

    @abstractmethod
    def ended(self) -> int | None:
        """The rank of a worker that has ended, if any (non-blocking)."""

    @abstractmethod
    def death(self, rank: int, grace: float) -> DeathReport:
        """Wait up to ``grace`` for worker ``rank`` to exit, kill it if it still runs, and
        describe it."""

    @abstractmethod
    def stop(self, grace: float) -> None:
        """Wait up to ``grace`` for every worker to exit, then kill what is left. Idempotent."""


def connect_command(spec: WorkerSpec) -> tuple[list[str], dict[str, str]]:
    """The command line and the environment additions that start worker ``spec.rank`` of a
    TCP session as a plain process: ``python -m unison worker --connect HOST:PORT --rank R``
    with the secret in UNISON_SECRET (never on the command line, where ``ps`` shows it)."""
    chan = spec.channel
    if chan.get("kind") != "tcp":
        raise ValueError("connect_command is for workers of a TCP session")
    argv = [sys.executable, "-m", "unison", "worker", "--connect", chan["address"],
            "--rank", str(spec.rank), "--die-with-parent"]
    if chan.get("unix"):  # on the controller's host: shared memory
        argv += ["--unix", chan["unix"]]
    env = {SECRET_VAR: chan["secret"], "PYTHONUNBUFFERED": "1"}
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (src, os.environ.get("PYTHONPATH", "")) if p)  # where unison imports from
    return argv, env


def create(launcher: str | Launcher) -> Launcher:
    """The launcher a session asked for: a name from NAMES (a new launcher each time), or a
    Launcher instance, used as it is."""
    if isinstance(launcher, Launcher):
        return launcher
    if isinstance(launcher, str):
        if launcher == "local":
            from unison.launch.local import LocalLauncher  # here: local.py imports this module

            return LocalLauncher()
        if launcher == "connect":
            from unison.launch.connect import ConnectLauncher

            return ConnectLauncher()
        if launcher == "ray":
            from unison.launch.ray import RayLauncher

            return RayLauncher()
        raise ValueError(
            f"unknown launcher {launcher!r}: use one of {', '.join(map(repr, NAMES))} "
            "or a unison.launch.Launcher instance"
        )
    raise TypeError(
        f"launcher must be a name ({', '.join(map(repr, NAMES))}) or a unison.launch.Launcher "
        f"instance, not {type(launcher).__name__}"
    )
