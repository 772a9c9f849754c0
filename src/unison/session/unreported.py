"""Errors the workers reported that nobody has fetched yet: kept until a get, gather or sync
raises them, or until close() says them out loud. Each error is reported exactly once.

    worker: failed call -> its register holds Failed, and it lists the error as unreported
    GET of that Ref      -> the error comes back (and the worker strikes it)  -> raised there
    SYNC                 -> the worker's list comes back, then it forgets it  -> add_all()
    abandoned wait       -> the errors its late replies carry                 -> add()/add_all()
    sync() raises the earliest call's error; close() warns about what is left (warn_each).
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Any

from unison.errors import note_warning, shortened

__all__ = ["UnreportedErrors", "warn_each"]

Error = tuple[Any, ...]  # protocol.pack_error's (pickle, type name, message, traceback, where)


class UnreportedErrors:
    """ref id -> {rank: error}, safe to use from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: dict[int, dict[int, Error]] = {}

    def add(self, ref_id: int, rank: int, error: Error) -> None:
        with self._lock:
            self._errors.setdefault(ref_id, {})[rank] = error

    def add_all(self, rank: int, errors: list[tuple[int, Error]]) -> None:
        """A worker's list of unreported errors, as a SYNC (or SHUTDOWN) reply carries it."""
        self.add_answers({rank: errors})

    def add_answers(self, answers: dict[int, list[tuple[int, Error]]]) -> None:
        """``add_all`` for several workers' answers to one SYNC, under one hold of the lock:
        a sync between two of them would raise half of a call's errors, then the rest."""
        with self._lock:
            for rank, errors in answers.items():
                for ref_id, error in errors:
                    self._errors.setdefault(ref_id, {})[rank] = error

    def forget(self, ref_id: int, ranks: tuple[int, ...]) -> None:
        """That call's errors on ``ranks`` were just raised to the user (a get of one
        worker leaves the others' for a sync: a late error of a timed-out get among them)."""
        with self._lock:
            errors = self._errors.get(ref_id)
            if errors is not None:
                for r in ranks:
                    errors.pop(r, None)
                if not errors:
                    del self._errors[ref_id]

    def pop_earliest(self, ranks: tuple[int, ...], below: int) -> dict[int, Error] | None:
        """The errors on ``ranks`` of the earliest call below id ``below`` that has any
        there, by rank, or None. A view's sync takes only its workers' errors, and a sync
        only those of calls sent before it began: others stay for a sync that covers them
        (a thread's sync raised another thread's later call's error, whose own sync then
        returned quietly)."""
        if not self._errors:  # one read, no lock: an error added meanwhile is the next one's
            return None
        with self._lock:
            for ref_id in sorted(self._errors):
                if ref_id >= below:
                    return None
                errors = self._errors[ref_id]
                mine = {r: errors.pop(r) for r in ranks if r in errors}
                if mine:
                    if not errors:
                        del self._errors[ref_id]
                    return mine
            return None

    def take_warnings(self, session: str) -> list[str]:
        """What to say of every error left (as asyncio does for a task's exception nobody
        retrieved): one warning's text per call, for ``warn_each``. They are forgotten."""
        with self._lock:
            lost, self._errors = self._errors, {}
        said = []
        for ref_id in sorted(lost):
            errors = lost[ref_id]
            ranks = sorted(errors)
            err = errors[ranks[0]]
            where = f" of {err[4]}" if len(err) > 4 and err[4] else ""
            said.append(
                f"call #{ref_id}{where} raised {err[1]}: {shortened(err[2])} on worker(s) "
                f"{ranks}, and "
                f"nobody fetched that error before {session} closed: get/gather its Ref "
                "or call sess.sync() to see errors as they happen")
        return said


def warn_each(messages: list[str], stacklevel: int, raised: Exception | None = None) -> None:
    """Issue each of ``messages`` as a RuntimeWarning. Where warnings are errors (python -W
    error, pytest's filterwarnings = error) every one is still issued, then the first one
    raised (or ``raised``, a warning an earlier step of the close raised) is raised, the
    others' texts as its notes: none cuts the rest short or is lost. Only at interpreter
    shutdown, where warnings cannot be issued any more, are they dropped."""
    first = raised
    for message in messages:
        try:
            warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
        except Exception as exc:
            if not isinstance(exc, Warning) and sys.is_finalizing():
                return  # the modules are torn down: nowhere left to say it
            if first is None:
                first = exc
            else:
                note_warning(first, exc)
    if first is not None:
        raise first

