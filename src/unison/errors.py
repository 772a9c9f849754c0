"""The errors a unison user can see, and how a worker's failure is described.

    Exception
     └── UnisonError
          ├── WorkerError       a worker's function raised; the session stays usable
          ├── RemoteError       stands in (as WorkerError's cause) for a worker's exception
          │                     that could not be rebuilt on the controller
          ├── WorkerDied        a worker process died; the session is closed
          ├── SessionClosed     the session was closed (by close(), or by a death)
          ├── CancelledError    fetching a Ref whose call was cancelled (ref.cancel());
          │                     also a concurrent.futures.CancelledError
          └── CollectiveError   raised inside a worker: a collective could not complete
                                (a peer left, died, or called something else)

TimeoutError (the builtin) comes from any wait given ``timeout=``; ValueError and
TypeError from bad arguments, always saying what to do instead.
"""

from __future__ import annotations

import concurrent.futures
import signal
import sys

__all__ = [
    "CancelledError", "CollectiveError", "RemoteError", "SessionClosed", "UnisonError",
    "WorkerDied", "WorkerError",
]

EXIT_CONTROLLER_GONE = 75
"""The exit code of a worker that stopped itself because its controller went away (its
lifeline closed): it says so, rather than passing for a crash or the OOM killer."""

MESSAGE_LINES = 20
"""How many of a dead worker's last stderr lines WorkerDied's message shows ..."""
MESSAGE_LINE_CHARS = 1000
"""... each cut at this many characters (``.output`` keeps the launcher's whole tail)."""


class UnisonError(Exception):
    """Base class of every error unison raises on its own account."""


class WorkerError(UnisonError):
    """A worker's function raised.

    ``.worker`` is the lowest failed rank and ``__cause__`` its original exception, rebuilt on
    the controller; the message carries that worker's remote traceback. ``.errors`` maps every
    rank on which the same call failed to its exception. Nothing else is lost: the session and
    every worker's other objects stay usable.
    """

    def __init__(self, message: str, worker: int, errors: dict[int, BaseException]):
        super().__init__(message)
        self.worker = worker
        self.errors = errors

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0], self.worker, self.errors))


class RemoteError(UnisonError):
    """A worker's exception that could not be rebuilt on the controller (its class does not
    import here, or it will not pickle even by value). It is the ``__cause__`` of the
    WorkerError, in place of the original.

    ``.type_name`` is the original class's qualified name, ``.message`` its ``str()``,
    ``.traceback`` the remote traceback as text and ``.attributes`` maps each of the
    exception's attributes to its ``repr()``.
    """

    def __init__(self, type_name: str, message: str, traceback: str = "",
                 attributes: dict[str, str] | None = None) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message
        self.traceback = traceback
        self.attributes = dict(attributes or {})

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.type_name, self.message, self.traceback, self.attributes))


class WorkerDied(UnisonError):
    """A worker process died or vanished, so the lockstep is broken and the session is closed.

    ``.worker`` is its rank and ``.exitcode`` its exit status, negative for a signal as in
    ``subprocess`` (-9: SIGKILL, often the OOM killer; -11: SIGSEGV, a crash in native code).
    ``.output`` holds the tail of what it wrote to stderr (bounded by the launcher); the
    message shows only its last 20 lines, each cut at 1,000 characters, so that it stays
    readable however much the worker wrote. ``.reason``, when unison knows why the worker
    ended (e.g. it was stopped by unison itself), replaces the guess from the exit code.
    ``.idle`` is True where the channel saw that the worker had run everything it had taken
    (shared memory can tell): it died between calls, not in one, and ``.during`` then says
    only what the controller was doing when it saw the death.
    Every later use of the session raises SessionClosed with this error as its ``__cause__``.
    """

    def __init__(self, worker: int, exitcode: int | None, output: str = "", during: str = "",
                 reason: str = "", idle: bool = False):
        self.worker = worker
        self.exitcode = exitcode
        self.output = output
        self.during = during
        self.reason = reason
        self.idle = idle
        super().__init__(self._describe())

    def _describe(self) -> str:
        what = f"worker {self.worker} died"
        if self.idle:  # "while running a call" would blame the call the controller sent
            what += " between calls, having run everything it had taken"
            if self.during:
                what += f" (seen while {self.during})"
        elif self.during:
            what += f" while {self.during}"
        cause = describe_exitcode(self.exitcode, known=bool(self.reason))
        if self.reason:
            cause += f": {self.reason}"
        msg = f"{what}: {cause}. The session is closed."
        lines = self.output.rstrip("\n").splitlines()[-MESSAGE_LINES:]
        if lines:
            tail = "\n".join("    " + _cut(line) for line in lines)
            msg += f"\nLast lines worker {self.worker} wrote to stderr:\n{tail}"
        return msg

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.worker, self.exitcode, self.output, self.during, self.reason,
                             self.idle))


MESSAGE_CHARS = 100_000
"""WorkerError's message, at most: its tail (``.errors`` and ``__cause__`` keep it all)."""


def shortened(text: str) -> str:
    """``text`` with each line cut at MESSAGE_LINE_CHARS and, past MESSAGE_CHARS in all, its
    tail alone: a worker's error of a 10 MB message made a WorkerError of 20 MB (its
    message, then its traceback's last line; an audit, issue 9, forty-ninth pass)."""
    if len(text) <= MESSAGE_LINE_CHARS:
        return text
    text = "\n".join(_cut(line) for line in text.split("\n"))
    if len(text) > MESSAGE_CHARS:
        text = f"... ({len(text) - MESSAGE_CHARS} characters cut)\n{text[-MESSAGE_CHARS:]}"
    return text


def _cut(line: str) -> str:
    if len(line) <= MESSAGE_LINE_CHARS:
        return line
    return f"{line[:MESSAGE_LINE_CHARS]}... ({len(line) - MESSAGE_LINE_CHARS} more characters)"


class SessionClosed(UnisonError):
    """The session was closed, by ``close()`` or because a worker died (then ``__cause__`` is
    the WorkerDied). Open a new Session to go on."""


class CancelledError(UnisonError, concurrent.futures.CancelledError):
    """The call behind this Ref was cancelled (``ref.cancel()``): skipped where it had not
    started, interrupted (``unison.Cancelled`` raised inside it) where it ran. ``.workers``
    are the ranks where it was cancelled; the session and every other object stay intact."""

    def __init__(self, message: str, workers: list[int]):
        super().__init__(message)
        self.workers = workers

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0], self.workers))


class CollectiveError(UnisonError):
    """A collective could not complete: a peer left the call without joining it (it raised,
    returned early, or called a different collective), a peer died, the workers called
    different collectives, or they passed arrays that do not match. The message names the
    peer and what to fix. It is raised inside the worker's function, so the controller sees
    it as a WorkerError whose ``.errors`` hold it for each rank that gave up.

    ``.peer`` is the rank whose leaving (or death) this error reports, else None: where that
    peer failed in the same call, the WorkerError also shows the peer's own error, which is
    where the failure began."""

    peer: int | None = None  # (a subclass that is also a TypeError runs TypeError's init)

    def __init__(self, message: str, *, peer: int | None = None):
        super().__init__(message)
        self.peer = peer


def start_timed_out(ranks: list[int]) -> str:
    """The TimeoutError's message of a start past ``start_timeout`` (the session's wait for
    the workers, or a launcher's while it starts them): there is no Ref, and the session
    is closed."""
    return (f"starting timed out: {len(ranks)} worker(s) {ranks} had not started by the "
            "deadline (start_timeout). The session is closed and what had started is "
            "stopped: where the start is slow (a slow disk, heavy imports, a crowded "
            "machine), give Session a larger start_timeout.")


def describe_exitcode(code: int | None, known: bool = False) -> str:
    """Turn an exit status into the likely cause, the way a user would want to read it.
    With ``known`` (the caller knows the cause), the status is told without guessing."""
    if code is None:
        return "it stopped answering (exit status unknown)"
    if code == EXIT_CONTROLLER_GONE and not known:
        return (f"exited with code {code}: it stopped itself because its lifeline to the "
                "controller closed (the controller went away, or closed the worker's stdin)")
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = {
            "SIGKILL": " (kill -9, or the kernel's OOM killer when memory ran out)",
            "SIGSEGV": " (a crash in native code)",
            "SIGABRT": " (an abort in native code)",
            "SIGBUS": " (a bad memory access, e.g. to a truncated mapping)",
            "SIGTERM": " (terminated from outside)",
        }.get(name, "")
        if known:
            hint = ""
        return f"killed by {name} (exit code {code}){hint}"
    return f"exited with code {code}"


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``: the traceback shows it (Python 3.11+); before 3.11, which has
    no notes, the note is written to stderr instead, so it is not lost."""
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    else:
        print(f"unison: {note}", file=sys.stderr)


def note_warning(exc: BaseException, warning: BaseException) -> None:
    """A ``warning`` raised (warnings as errors: python -W error) while ``exc`` was on its
    way: its text, and its own notes, become notes on ``exc``, which goes on."""
    for note in [f"{type(warning).__name__}: {warning}", *getattr(warning, "__notes__", ())]:
        add_note(exc, note)
