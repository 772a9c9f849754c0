"""The errors a unison user can see, and how a worker's failure is described.

    Exception
     └── UnisonError
          ├── WorkerError     a worker's function raised; the session stays usable
          ├── WorkerDied      a worker process died; the session is closed
          └── SessionClosed   the session was closed (by close(), or by a death)

TimeoutError (the builtin) comes from any wait given ``timeout=``; ValueError and
TypeError from bad arguments, always saying what to do instead.
"""

from __future__ import annotations

import signal

__all__ = ["SessionClosed", "UnisonError", "WorkerDied", "WorkerError"]


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


class WorkerDied(UnisonError):
    """A worker process died or vanished, so the lockstep is broken and the session is closed.

    ``.worker`` is its rank and ``.exitcode`` its exit status, negative for a signal as in
    ``subprocess`` (-9: SIGKILL, often the OOM killer; -11: SIGSEGV, a crash in native code).
    ``.output`` holds the last lines it wrote to stderr, also shown in the message. Every later
    use of the session raises SessionClosed with this error as its ``__cause__``.
    """

    def __init__(self, worker: int, exitcode: int | None, output: str = "", during: str = ""):
        self.worker = worker
        self.exitcode = exitcode
        self.output = output
        super().__init__(self._describe(during))

    def _describe(self, during: str) -> str:
        what = f"worker {self.worker} died"
        if during:
            what += f" while {during}"
        msg = f"{what}: {describe_exitcode(self.exitcode)}. The session is closed."
        if self.output:
            tail = "\n".join("    " + line for line in self.output.rstrip("\n").splitlines())
            msg += f"\nLast lines worker {self.worker} wrote to stderr:\n{tail}"
        return msg

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.worker, self.exitcode, self.output))


class SessionClosed(UnisonError):
    """The session was closed, by ``close()`` or because a worker died (then ``__cause__`` is
    the WorkerDied). Open a new Session to go on."""


def describe_exitcode(code: int | None) -> str:
    """Turn an exit status into the likely cause, the way a user would want to read it."""
    if code is None:
        return "it stopped answering (exit status unknown)"
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
        return f"killed by {name} (exit code {code}){hint}"
    return f"exited with code {code}"
