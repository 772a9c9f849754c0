"""``Session(hang_timeout=...)``: a call that makes no progress for that long ends its wait
with HangError, saying where each worker it waits for is.

    a waiting thread (router / sync), each slice:  watchdog.poll(pending ranks, during)
      not due yet (every hang_timeout/4, at most 1 s apart) -> return at once
      due: for each pending rank, from /proc: its CPU time (the worker and what it started,
           each with its reaped children's) and state; no signal, so a worker waiting
           in C (sleep, poll) is never interrupted by being looked at
           progress = CPU time grew by >= 10% of the time between samples
           stopped (state T) = no progress, whatever the rest says
      no rank has progressed for hang_timeout -> their stacks, once (unison.debug.stacks),
                                                 and HangError(report)

No thread: the sampling is done by whoever waits, between the slices of its wait, so an idle
session (nobody waiting) costs nothing, and a session without hang_timeout never gets here.
A rank that waits in a collective for a busy peer does not progress itself, but its peer
does, and the call counts as progressing while any of its ranks does.
"""

from __future__ import annotations

import os
import threading
import time
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
    A low-CPU wait (sleep, I/O) longer than hang_timeout counts as a hang."""


class _Rank:
    __slots__ = ("cpu", "progress", "sampled", "wait")

    def __init__(self, wait: object, now: float, cpu: dict[tuple[int, int], float]) -> None:
        self.wait = wait
        self.sampled = now
        self.cpu = cpu
        """CPU seconds of the worker and each process below it, by (pid, start time)."""
        self.progress = now


class Watchdog:
    """The hang policy of one session (made only when hang_timeout is given)."""

    def __init__(self, hang_timeout: float, pids: Sequence[int]) -> None:
        self.hang_timeout = hang_timeout
        self.interval = min(max(hang_timeout / 4, 0.01), 1.0)
        """Seconds between samples; a wait's slice should not be longer."""
        self._pids = pids
        self._due = 0.0
        self._lock = threading.Lock()
        self._ranks: dict[int, _Rank] = {}

    def poll(self, wait: object, pending: Callable[[], Sequence[int]], during: str) -> None:
        """Called by a waiting thread between slices: sample if due; raise HangError when
        none of the ``pending()`` ranks has progressed for hang_timeout. ``wait`` says what
        is waited for (a request): a rank's progress is counted from its first sample in
        that wait, since a rank that finished an earlier request has progressed."""
        now = time.monotonic()
        if now < self._due or not self._lock.acquire(blocking=False):
            return  # not yet, or another waiting thread is sampling
        try:
            self._due = now + self.interval
            ranks = list(pending())
            if not ranks:
                return
            stuck = self._sample(wait, ranks, now)
            if stuck is not None:
                raise HangError(
                    f"{during}: no progress for {self.hang_timeout:g} s (hang_timeout) on "
                    f"worker(s) {ranks}: none of them used CPU.\n"
                    f"{stuck}\n"
                    "The call still runs: sess.stacks() shows every thread; close the session "
                    "to stop it.")
        finally:
            self._lock.release()

    def _sample(self, wait: object, ranks: list[int], now: float) -> str | None:
        """Update each rank's progress from /proc alone (no signal: a worker waiting in C
        between samples is never interrupted); the report if the call is hung, else None."""
        pids = self._pids
        for r in ranks:
            cpu, state = _cpu(pids[r])
            st = self._ranks.get(r)
            if st is None or st.wait != wait or now - st.sampled > 3 * self.interval + 1.0:
                # a new wait, or nobody waited on it lately: start afresh
                self._ranks[r] = _Rank(wait, now, cpu)
                continue
            if (not state.startswith(("T", "t"))
                    and _used(st.cpu, cpu) >= CPU_SHARE * (now - st.sampled)):
                st.progress = now
            st.sampled, st.cpu = now, cpu
        if all(now - self._ranks[r].progress >= self.hang_timeout for r in ranks):
            # the only signal the watchdog sends: one stack dump each, for the report
            got = _stacks.collect({r: pids[r] for r in ranks}, 1.0)
            return _stacks.report(got, ranks)
        return None


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
