"""``Session(hang_timeout=...)``: a call that makes no progress for that long ends its wait
with HangError, saying where each worker it waits for is.

    a waiting thread (router / sync), each slice:  watchdog.poll(pending ranks, during)
      not due yet (each thread on its own clock: every hang_timeout/4, at most 1 s
                   apart) -> return at once
      due: for each pending rank, from /proc: its CPU time (the worker and what it started,
           each with its reaped children's) and state; no signal, so a worker waiting
           in C (sleep, poll) is never interrupted by being looked at
           progress = CPU time grew by >= 10% of the time between samples
           stopped (state T) = no progress, whatever the rest says
      no rank has progressed for hang_timeout -> their stacks, once (unison.debug.stacks),
                                                 and HangError(report)

Only a worker whose pid is proven to be it on this host is judged (its stack memfd among
the pid's fds, and the start time the session read): a worker that joined from another host
or pid namespace reports a pid that here means nothing, or another process. Such a rank
counts as progressing (a wait it owes a reply ends only by its timeout; a RuntimeWarning at
the start names it), and a session with no worker here refuses hang_timeout.

No thread: the sampling is done by whoever waits, between the slices of its wait, so an idle
session (nobody waiting) costs nothing, and a session without hang_timeout never gets here.
A rank that waits in a collective for a busy peer does not progress itself, but its peer
does, and the call counts as progressing while any of its ranks does.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence

from unison import _proctree
from unison.debug import stacks as _stacks

__all__ = ["HangError", "Watchdog"]

CPU_SHARE = 0.10
"""CPU time (of one core) that counts as progress, as a share of the time between samples."""
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class HangError(TimeoutError):
    """A call made no progress for ``Session(hang_timeout=...)`` seconds: none of the
    workers it waits for (nor what they started) used CPU. A TimeoutError: like a timeout,
    it abandons only the wait (the call still runs); the message says where each worker is.
    A low-CPU wait (sleep, I/O) longer than hang_timeout counts as a hang. Only workers on
    this host are watched: one that joined from another host or pid namespace counts as
    progressing, since what it does cannot be seen from here."""


class _Rank:
    __slots__ = ("cpu", "progress", "sampled")

    def __init__(self, now: float, cpu: dict[tuple[int, int], float]) -> None:
        self.sampled = now
        self.cpu = cpu
        """CPU seconds of the worker and each process below it, by (pid, start time)."""
        self.progress = now


class Watchdog:
    """The hang policy of one session (made only when hang_timeout is given)."""

    def __init__(self, hang_timeout: float, pids: Sequence[int],
                 starts: Sequence[int | None]) -> None:
        """``pids`` as the workers reported them, ``starts`` their start times where the
        session read them at its start (its launcher's children). ValueError where no
        worker is a process on this host; a RuntimeWarning names those that are not."""
        self.hang_timeout = hang_timeout
        self.interval = min(max(hang_timeout / 4, 0.01), 1.0)
        """Seconds between samples; a wait's slice should not be longer."""
        self._unwatched = max(2 * self.interval, hang_timeout / 2)
        """A gap between two samples past this was not watched: a sample merely late (a
        loaded machine) still counts in full."""
        self._pids = pids
        self._local: dict[int, int] = {}
        """The ranks whose pid is proven to be that worker on this host: their start time."""
        unseen: dict[int, str] = {}
        for r, (pid, start) in enumerate(zip(pids, starts)):
            why = _not_local(r, pid, start)
            if why:
                unseen[r] = why
            else:
                self._local[r] = _stat(pid)[2]
        if unseen:
            _refuse_or_warn(unseen, len(pids))
        self._due = threading.local()
        """When (``.at``) each waiting thread samples next: its own ranks, on its own
        clock. One clock for all let the threads that came first take every sample, each
        of its own ranks: a hung worker that one thread waited for, beside others that
        waited for busy ones, was never looked at."""
        self._lock = threading.Lock()
        self._ranks: dict[tuple[int, object], _Rank] = {}
        """By (rank, wait): two threads that wait for one worker each count its progress
        from their own wait's first sample."""

    def poll(self, wait: object, pending: Callable[[], Sequence[int]], during: str) -> None:
        """Called by a waiting thread between slices: sample if due; raise HangError when
        none of the ``pending()`` ranks has progressed for hang_timeout. ``wait`` says what
        is waited for (a request): a rank's progress is counted from its first sample in
        that wait, since a rank that finished an earlier request has progressed."""
        stuck = self.stuck(wait, pending)
        if stuck is not None:
            ranks, report = stuck
            raise HangError(
                f"{during}: no progress for {self.hang_timeout:g} s (hang_timeout) on "
                f"worker(s) {ranks}: none of them used CPU.\n"
                f"{report}\n"
                "The call still runs: sess.stacks() shows every thread; close the session "
                "to stop it.")

    def stuck(self, wait: object, pending: Callable[[], Sequence[int]]
              ) -> tuple[list[int], str] | None:
        """``poll``'s look: the ranks and the report where none of ``pending()`` has
        progressed for hang_timeout, else None (also when not due, or while another
        thread samples)."""
        now = time.monotonic()
        due = self._due
        if now < getattr(due, "at", 0.0) or not self._lock.acquire(blocking=False):
            return None  # not yet, or another waiting thread is sampling (next slice, then)
        try:
            due.at = now + self.interval
            ranks = list(pending())
            if not ranks:
                return None
            report = self._sample(wait, ranks, now)
            return None if report is None else (ranks, report)
        finally:
            self._lock.release()

    def _sample(self, wait: object, ranks: list[int], now: float) -> str | None:
        """Update each rank's progress from /proc alone (no signal: a worker waiting in C
        between samples is never interrupted); the report if the call is hung, else None.
        Time between two samples past ``_unwatched`` counts toward no hang: a pause of
        the whole session (SIGSTOP of its group, a suspended machine) of about hang_timeout
        read as workers that used no CPU, where a longer one started afresh (an audit of
        pauses, issue 9, forty-ninth pass: a HangError for workers busy all along)."""
        pids, local, stale = self._pids, self._local, 3 * self.interval + 1.0
        if len(self._ranks) > 4 * len(pids) + 16:  # forget the waits nobody samples now
            for key in [k for k, st in self._ranks.items() if now - st.sampled > stale]:
                del self._ranks[key]
        for r in ranks:
            if r not in local:
                continue  # not on this host: what it does cannot be seen, so it may progress
            cpu, state = _cpu(pids[r])
            st = self._ranks.get((r, wait))
            if st is None or now - st.sampled > stale:
                # a new wait, or nobody waited on it lately: start afresh
                self._ranks[r, wait] = _Rank(now, cpu)
                continue
            gap = now - st.sampled
            if gap > self._unwatched:  # (this process stopped or starved): that time
                st.progress += gap - self.interval  # counts for nothing
            gone = (pids[r], local[r]) not in cpu  # (its death is for the wait to report)
            if gone or (not state.startswith(("T", "t"))
                        and _used(st.cpu, cpu) >= CPU_SHARE * (now - st.sampled)):
                st.progress = now
            st.sampled, st.cpu = now, cpu
        if all(r in local and now - self._ranks[r, wait].progress >= self.hang_timeout
               for r in ranks):
            # the only signal the watchdog sends: one stack dump each, for the report
            got = _stacks.collect({r: pids[r] for r in ranks}, 1.0)
            return _stacks.report(got, ranks)
        return None


def _not_local(rank: int, pid: int, start: int | None) -> str:
    """Why ``pid`` is not proven to be worker ``rank`` on this host ("" where it is): its
    stack memfd among the pid's fds (as unison.debug.stacks proves it before a signal), and
    the start time the session read, where it read one. A worker that joined from another
    host or pid namespace reports a pid that here means nothing, or another process."""
    if pid == os.getpid():
        return ""  # worker 0, inline in the controller
    name, why = _stacks.find(rank, pid)
    if not name:
        return why.removeprefix("not available: ")
    if not _proctree.same(pid, start):
        return "its pid is another process now"
    return ""


def _refuse_or_warn(unseen: dict[int, str], workers: int) -> None:
    """Progress is read from /proc on this host: refuse hang_timeout where no worker is
    here, and name those that are not."""
    why = "; ".join(f"worker {r}: {text}" for r, text in unseen.items())
    if len(unseen) == workers:
        raise ValueError(
            "hang_timeout judges progress by the workers' CPU time as /proc shows it on this "
            "host, and no worker of this session is a process here whose pid names it "
            f"({why}): no hang could be seen. Leave hang_timeout out and bound the waits "
            "with timeout=... instead.")
    warnings.warn(
        f"hang_timeout cannot watch worker(s) {sorted(unseen)}: they are not processes on "
        f"this host whose pid names them ({why}). They count as progressing, so a wait that "
        "any of them owes a reply never ends in HangError: bound it with timeout=...",
        RuntimeWarning, stacklevel=4)


def _cpu(pid: int) -> tuple[dict[tuple[int, int], float], str]:
    """The CPU seconds of a worker and of each process below it now, by (pid, start time),
    each with its reaped children's (so a child's time is still counted once its parent
    reaped it); and the worker's state letter ("" once gone)."""
    total, state, start = _stat(pid)
    tree = {(pid, start): total}
    if state and not state.startswith(("T", "t")) and _has_children(pid):
        for child in _proctree.descendants(pid):
            cpu, child_state, child_start = _stat(child)
            if child_state:
                tree[(child, child_start)] = cpu
    return tree, state


def _used(before: dict[tuple[int, int], float], now: dict[tuple[int, int], float]) -> float:
    """CPU seconds the processes of ``now`` used since ``before``: a process's time never
    goes down, and one that ended takes none away (its time went to its reaper's children's
    share, or out of sight), so a tree whose processes come and go reads as the work it
    does."""
    return sum(max(0.0, cpu - before.get(key, 0.0)) for key, cpu in now.items())


def _has_children(pid: int) -> bool:
    """Whether the process has a child (True where /proc cannot say)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
        for tid in tids:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                if f.read().strip():
                    return True
    except OSError:
        return True
    return False


def _stat(pid: int) -> tuple[float, str, int]:
    """A process's CPU seconds (its own and its reaped children's), its state letter and
    its start time (clock ticks since boot); ``(0.0, "", 0)`` where it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0.0, "", 0
    fields = stat[stat.rfind(b")") + 2:].split()
    # after "pid (comm)": state ppid pgrp session tty tpgid flags minflt cminflt majflt
    # cmajflt utime stime cutime cstime priority nice num_threads itrealvalue starttime
    ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    return ticks / _TICK, fields[0].decode(), int(fields[19])
