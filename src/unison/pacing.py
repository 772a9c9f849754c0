"""How unison's waits pass time: yield the core for a short budget, then sleep.

    wait starts --> spin(ready, budget, busy): check, check, ...  --> ready: go on at once
                       | (busy: only where every process has a core)
                       v
                    sched_yield, check, ...                       --> ready: go on at once
                       | budget spent
                       v
                    event waits (channel recv): sleep on a kernel object (eventfd + pidfds)
                    polling waits (Pacer.pause): sleep naps of 20 us, 40 us, ... up to a cap

Every loop that waits for another process to move (a reply, room in a ring, a peer in a
collective) uses these two pieces, each with its own budget and cap, so that a quick answer
is caught without a kernel wake-up and an idle wait costs (almost) no CPU. Yielding rather
than pure spinning keeps a machine with more workers than cores usable.

Crowded machines. A yield hands the core to another runnable process. When that process is a
peer of ours (3 processes on 2 cores), it does its few microseconds of work and yields back:
yielding is the fast hand-over. When it is a CPU-bound stranger, it keeps the core for its
whole time slice (milliseconds), so every yield costs a slice and a spinning wait collapses
(issue 9 measured 4-8 ms per round trip beside two CPU hogs). A sleeper woken by an eventfd
preempts such a stranger at once, but each wake-up costs tens of microseconds. So each wait
times its yields, and the process keeps a running rate of waits that met a yield longer
than LONG_YIELD (fading with time as well: RATE_HALF_LIFE). One such wait gives up its spin
and sleeps; once the rate passes CROWDED_RATE, every wait for the next CROWDED seconds skips
the spin and sleeps at once, as a pipe would. Then waits probe with a spin again; clean ones
bring the rate down.

A spin can miss the crowd. On Linux's EEVDF scheduler a yield hands the core over only to a
task that is owed CPU, so a spinner's yields may all come back at once while a stranger holds
the other core; and the CPU a spinner burns leaves it owing time, so the stranger then
preempts it, or its wake-up waits out the stranger's slice, where no yield is timed (issue 9:
dispatch beside two hogs took 4 ms a round for a second at a time, at N=1 and N=8, against
30-300 us while waits slept at once). So every LOOK seconds a wait also reads the thread's
scheduler statistics (/proc/thread-self/schedstat): if, since the last look, it spent over
CROWD_SHARE of the time runnable but off the core, in spells averaging over STRANGER_SPELL,
the machine is crowded now. Peers hand the core back within tens of microseconds, or at
worst within the scheduler's slice, so they do not count; nor does the peers' own start,
which each side forgets (``crowd.forget``) once the first command is in. Strangers may also
take the core in short spells (Linux 6.18 beside two hogs: 17-77 µs), which the spells'
length cannot tell from peers'; so where the time off the core is over CROWD_SHARE, a look
also counts the machine's runnable tasks (/proc/loadavg): more than the CPUs and than the
processes of our sessions (``crowd.expect``), at STRANGER_LOOKS looks in a row, is a crowd.

Run's wait for replies starts by handing the core over once (``hand_over``) where the
session has more processes than cores.

A cgroup's CPU quota (a container's ``--cpus``, a pod's CPU limit: unison.cgroup) is no set
of cores: the kernel still spreads our processes over every CPU they may use, so ``cores``
does not count it (``pool_cores``, the thread pools' share, does). Where our processes spin
on more CPUs than the quota pays for, it runs out and the cgroup stalls them for the rest of
each period, which a look would take for a stranger's spell off the core, and a wait for a
long yield. So where our own sessions spend the quota (their processes, each using what this
thread did of late, use QUOTA_OURS of it or more), a long yield after such a stall does not
count, and a look takes the stalls off its time off the core. Where others in the cgroup
spend it (CPU hogs in the same container), the stalls stay a stranger's time. On 2 CPUs with
a quota of one, dispatch then took 4.3-5.2 / 13.2 / 18.9 µs a round in wall time at N = 1 /
2 / 4 (the floor's 4.1-5.1 / 11.0 / 18.8), against 8.8 / 21.8 / 27.1 before
(docs/benchmarks.md, "Issue 9", twenty-seventh and twenty-eighth passes).

The waits and their parameters:

    channel.shm   controller recv, worker recv   check 20 us without yielding (where every
                                                 process has a core: BUSY), spin 200 us,
                                                 then sleep on an eventfd
    channel.tcp   controller recv, worker recv   spin 200 us, then sleep in poll / the read
                                                 (a worker on a crowded controller host: sleep)
    channel.pipe  controller recv, worker recv   as the shm channel's, sleeping in poll / the
                                                 read
    channel.shm   command ring full (controller) Pacer(cap=5 ms), bounded by the deadline
    channel.shm   reply ring full (worker)       Pacer(cap=5 ms)
    channel.pipe  command pipe full (deadline)   Pacer(cap=5 ms), bounded by the deadline
    collective    peers, p2p queues              Pacer(spin=1 ms, cap=2 ms)
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from unison import cgroup

__all__ = [
    "BUSY", "CROWDED", "CROWD_SHARE", "FIRST_NAP", "LONG_YIELD", "QUOTA_ALPHA", "QUOTA_LAG",
    "QUOTA_OURS", "RATE_HALF_LIFE", "SPIN", "STRANGER_LOOKS", "STRANGER_SPELL", "Pacer",
    "busy_budget", "cores", "crowd", "hand_over", "on_cpu", "pool_cores", "run_delay",
    "runnable", "spin",
]

_T = TypeVar("_T")

BUSY = 20e-6
"""How long a wait first checks without yielding, where every process of the session has a
core of its own (``busy_budget``): there a yield leaves the core to nobody, and each one is
a syscall whose return delays the check that sees the other side's word (issue 9: at N=1 on
2 CPUs, dispatch 0.80x and gather_small 0.70x of the yield-only waits, by ``python
benchmarks/compare_revs.py --base f6ad359 --workers 1,2``). Never with more processes than
cores: a check that keeps the core there keeps it from the peer it waits for."""

SPIN = 200e-6
"""How long a wait for another process yields the core, looking, before it sleeps on a kernel
object (every channel's recv, a worker's wait for its next command, an await's first look):
a reply or a command is often a few µs away, and a sleep's wake-up costs tens of µs."""

FIRST_NAP = 20e-6
"""The first nap of a Pacer once its spin budget is spent (s); each next nap doubles."""

LONG_YIELD = 500e-6
"""A yield that kept us off the core longer than this (s) went to a stranger's time slice,
not to a peer's quick hand-over: the machine is crowded."""
CROWDED = 0.5
"""How long (s) waits sleep at once once the machine is crowded, before spins probe again.
Each probe under a lasting crowd costs a time slice; probing every 50 ms instead of 0.5 s
made dispatch beside two hogs 2-3x slower (and slower than a pipe)."""
CROWDED_RATE = 0.075
"""The share of recent waits meeting a long yield above which the machine counts as crowded:
about three of them close together. Small on purpose: such a wait costs a time slice (~4 ms),
a sleep's wake-up some 50 us, so spinning stops paying once more than a few percent of waits
meet a stranger's slice. Not two: a kernel thread that now and then runs for a few
milliseconds (this host's kdamond, 4 ms turns) gives one long yield, or two, to every
process, and each verdict then cost half a second of sleeping rounds (issue 9, ninth pass);
lasting strangers give many, and the looks (LOOK) see them besides."""
RATE_HALF_LIFE = 0.02
"""Between long yields the rate also halves every this many seconds: a worker whose next
command is mostly there when it comes back waits rarely, and two long yields a tenth of a
second apart are not frequent, however few waits lie between them."""
_ALPHA = 1 / 32  # weight of the latest wait in the running rate
CALM = 1 - _ALPHA
"""A wait that spun without meeting a long yield multiplies the rate by this (in place, in
each wait: a method call was a frame on every round)."""
LOOK = 0.05
"""How often (s, while waiting) a wait reads the thread's scheduler statistics (about 10 us
a look). Every 10 ms raised dispatch's p99 at N=2 by 13-40% (a look delays the round it
falls in); a look that finds strangers makes the machine crowded at once, so 50 ms still
ends a slow spell within a tenth of a second."""
CROWD_SHARE = 0.25
"""The share of the time since the last look spent runnable but off the core, above which
long spells off it mean a stranger. Beside two CPU hogs a spinner spent 90% there. Without
it, two spells of 0.5 ms in 50 ms (2%: a scheduler's slices between peers) made the
machine crowded, and dispatch then slept on every round for half a second (issue 9, ninth
pass). The peers' own start can fill more (65% at N=8): ``forget`` drops it."""
STRANGER_SPELL = 2e-3
"""The mean spell off the core (s) since the last look above which (with CROWD_SHARE) a
stranger holds it: a CPU-bound process keeps the core until the scheduler's tick ends its
slice (4 ms here: 3.5-3.9 ms off the core a round beside two hogs). Peers are shorter, but
not always under LONG_YIELD: four workers and the controller on two cores averaged
1.1-1.25 ms (the scheduler's own slices), and at 0.5 ms that made the machine crowded for
half a second at a time (issue 9, ninth pass). Where the tick is faster (HZ=1000), a hog's
slices are shorter and fall to the long yields instead."""
STRANGER_LOOKS = 2
"""Looks in a row that must find strangers runnable (``runnable``) while this thread spent
over CROWD_SHARE of the time off the core, in spells of any length, before the machine
counts as crowded. Beside two CPU hogs at N=1 on 2 CPUs, Linux 6.18 kept the waits off the
core 30-56% of the time in spells of only 17-77 µs: no spell reached STRANGER_SPELL and no
yield LONG_YIELD, and yield-spinning rounds took 55-63 µs where sleeping at once took 22-33
(and the pipe 33-44: ``python benchmarks/hogs_timeline.py --workers 1``). A look found
strangers runnable at 100% of the looks beside the hogs, and at 0-3% without them (N = 1, 2,
4, 8; scratch scripts, docs/benchmarks.md "Issue 9, thirteenth pass"), hence two in a row."""
QUOTA_LAG = 3 * LOOK
"""How long (s) a look's time off the core may wait for the quota's stalls to be counted:
Linux 6.18 counts a stall in cpu.stat only after the stalled tasks run again, at the next
period (`python benchmarks/quota_lag.py`: 40-60% of the stalls 48-53 or 100 ms late, none
later, with the default period of 100 ms). Under a quota our own sessions spend, a look that
finds time off the core and no stall counted leaves its span to the next look, up to this
long (else such stalls made one crowded verdict in about ten sessions of benchmarks/quota.py:
issue 9, thirty-fourth pass); a stranger's time off the core is then found this much later."""

STALE_LOOK = 4 * LOOK
"""A look further than this (s) from the last one judges nothing, and only starts afresh:
the time between holds our sleeps, which dilute the share off the core, and the streak of
looks that found strangers carries over it (they rarely leave while we sleep; beside two
hogs, each return from a pause of half a second otherwise spun some 100 ms at 55-63 µs a
round before two looks in a row found the crowd again)."""
QUOTA_OURS = 0.6
"""Under a cgroup's CPU quota, the share of it that our own sessions must be spending for
its stalls to count as ours, not a stranger's (``_Crowd._quota_is_ours``). With a quota of
one CPU on two, sessions alone spent 0.84-1.0 of it at N = 1, 2, 4, and 0.1-0.6 beside two
CPU hogs in the cgroup; at 0.75, N=2 alone fell under it now and then."""
QUOTA_ALPHA = 0.25
"""Under a cgroup's CPU quota, the weight of the latest look in a thread's running share of
a CPU (looks are LOOK apart: about four of them, two of the quota's usual 100 ms periods)."""
_SCHEDSTAT = "/proc/thread-self/schedstat"  # ns on the CPU, ns runnable but off it, spells
_LOADAVG = "/proc/loadavg"  # its 4th field: runnable tasks / all tasks, machine-wide
_CPUS = os.cpu_count() or 1  # the machine's, not cores(): /proc/loadavg counts machine-wide

_yield = os.sched_yield
_clock = time.perf_counter


def run_delay() -> tuple[int, int] | None:
    """This thread's time runnable but off the core (ns) and its spells on it; None where
    the kernel does not keep them."""
    got = _schedstat()
    return None if got is None else (got[1], got[2])


def on_cpu() -> int | None:
    """This thread's time on the CPU (ns); None where the kernel does not keep it."""
    got = _schedstat()
    return None if got is None else got[0]


def _schedstat() -> tuple[int, int, int] | None:
    """/proc/thread-self/schedstat: ns on the CPU, ns runnable but off it, spells on it. An
    open, a read and a close, so no descriptor outlives the call."""
    try:
        on, off, spells = _read(_SCHEDSTAT).split()[:3]
        return int(on), int(off), int(spells)
    except (OSError, ValueError):
        return None


def _read(path: str) -> bytes:
    """The first line or so of a /proc file: an open, a read and a close. Through a file
    object, not a bare fd: an exception a signal raises as the open returns (Ctrl-C) drops
    the object, which closes its fd; a bare fd was lost (a few µs more, once per look)."""
    with open(path, "rb", buffering=0) as f:
        return f.read(128)


def runnable() -> int | None:
    """How many tasks (threads) are runnable on the whole machine now, this one included,
    from /proc/loadavg; None where it cannot be read."""
    try:
        return int(_read(_LOADAVG).split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None


class _Crowd:
    """This process's view of the machine: ``until`` is the time (perf_counter) before which
    waits skip the spin. One per process: every wait of ours meets the same strangers."""

    __slots__ = ("_last_long", "_late", "_look_stalls", "_on_crowd", "_on_look", "_seen",
                 "_started", "_stranger_looks", "_use", "_used", "_yield_stalls", "next_look",
                 "ours", "rate", "until", "why")

    def __init__(self) -> None:
        self.until = 0.0
        self.why = ""
        """What gave the last crowded verdict, in words (benchmarks report it)."""
        self.rate = 0.0
        self._last_long = 0.0  # when a wait last met a long yield (perf_counter)
        self.next_look = 0.0
        """When (perf_counter) a wait should ``look`` next."""
        self._seen: tuple[int, float, int, int] | None = None  # thread, when, delay, spells
        self.ours = 0
        """The processes of our sessions on this host (``expect``): more runnable tasks than
        these and the CPUs mean strangers. 0: unknown, and looks do not count tasks."""
        self._stranger_looks = 0  # looks in a row that found strangers (STRANGER_LOOKS)
        self._on_crowd: list[Callable[[], object]] = []
        self._on_look: tuple[Callable[[bool], object], ...] = ()  # a tuple: swapped whole
        self._started = False  # a session's start is over here (``forget``)
        # the quota's stalls (_throttles) when a look, and a long yield, last asked
        self._look_stalls: tuple[int, int] | None = None
        self._yield_stalls: tuple[int, int] | None = None
        self._late: tuple[int, float, int] | None = None  # a span left to the next look
        self._used: int | None = None  # this thread's ns on the CPU at the last look
        self._use = 1.0  # its recent share of a CPU (_track_use): ours, until seen otherwise

    def on_crowd(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once, at the first verdict that the machine is crowded once a
        session's start is over (from the thread that waits then): unison.placement lets
        go of the CPUs it held."""
        self._on_crowd.append(fn)

    def off_crowd(self, fn: Callable[[], object]) -> None:
        """``fn`` is no longer to be called (its session closed)."""
        try:
            self._on_crowd.remove(fn)
        except ValueError:  # called already (or by a verdict now), or never registered
            pass

    def on_look(self, fn: Callable[[bool], object]) -> None:
        """Call ``fn(crowded)`` after every look (from the thread that looks, every LOOK
        while it waits), with whether the machine is crowded then: unison.placement keeps
        a lone worker beside the controller while it is."""
        self._on_look = (*self._on_look, fn)

    def off_look(self, fn: Callable[[bool], object]) -> None:
        """``fn`` is no longer to be called (its session closed)."""
        self._on_look = tuple(f for f in self._on_look if f is not fn)

    def _crowded(self, now: float, why: str) -> None:
        """The machine is crowded (``why``): waits sleep at once until CROWDED from now."""
        self.until = now + CROWDED
        self.why = why
        while self._started and self._on_crowd:
            try:
                fn = self._on_crowd.pop()
            except IndexError:  # another thread's verdict took it
                break
            fn()

    def expect(self, processes: int) -> None:
        """A session of ``processes`` on this host (controller and local workers) waits here:
        that many runnable tasks are peers, not strangers (the largest session counts)."""
        self.ours = max(self.ours, processes)

    def look(self, now: float) -> None:
        """Judge the machine (``_judge``), then tell those who asked (``on_look``)."""
        self._judge(now)
        for fn in self._on_look:
            fn(now < self.until)

    def _judge(self, now: float) -> None:
        """Read this thread's run delay; a stranger held the core if, since the last look,
        the thread spent over CROWD_SHARE of the time off the core, in spells averaging over
        STRANGER_SPELL, or in any spells while strangers were runnable at STRANGER_LOOKS
        looks in a row."""
        self.next_look = now + LOOK
        got = run_delay()
        if got is None:  # not kept by this kernel: never again
            self.next_look = float("inf")
            return
        delay, spells = got
        seen, thread = self._seen, threading.get_ident()
        self._seen = (thread, now, delay, spells)
        stalls, self._look_stalls = self._look_stalls, _throttles()
        if self._look_stalls is not None:  # under a CPU quota; not while crowded, when waits
            # sleep and use little: the share our spinning takes is what it is judged by
            self._track_use(now - seen[1] if seen is not None and seen[0] == thread
                            and now >= self.until else 0.0)
        late, self._late = self._late, None
        if seen is None or seen[0] != thread or spells <= seen[3]:
            return
        if now - seen[1] > STALE_LOOK:  # we slept, or did not wait: judge from the next look
            return
        off, span, gaps = delay - seen[2], now - seen[1], spells - seen[3]
        if late is not None:  # the last look's span, left to this one (below)
            off, span, gaps = off + late[0], span + late[1], gaps + late[2]
        ours = 0 if stalls is None else self._our_stalls(stalls)
        if off - ours <= span * 1e9 * CROWD_SHARE:
            self._stranger_looks = 0
            return
        if (stalls is not None and self._look_stalls is not None and span < QUOTA_LAG
                and self._look_stalls[0] == stalls[0] and self._quota_is_ours()):
            self._late = (off, span, gaps)  # judged with the next look's, stalls and all
            return
        off -= ours
        if off / gaps > STRANGER_SPELL * 1e9:
            self._count_long(now)  # an average over many spells: no need for a second
            self._crowded(now, f"off the core {off / 1e3:.0f} us of {span * 1e6:.0f} in "
                               f"{gaps} spells"
                               + ("" if stalls is None else self._stall_words(stalls, ours)))
            return
        tasks = runnable() if self.ours else None
        if tasks is None or tasks <= max(self.ours, _CPUS):
            self._stranger_looks = 0
            return
        self._stranger_looks += 1
        if self._stranger_looks >= STRANGER_LOOKS:
            self._count_long(now)
            self._crowded(now, f"{tasks} runnable tasks at {STRANGER_LOOKS} looks in a row "
                               f"(ours {self.ours})")

    def _track_use(self, span: float) -> None:
        """Keep ``_use``: this thread's recent share of a CPU, a running mean over looks
        (each ``span`` seconds after the last; 0: the last was another thread's, or the
        machine counts as crowded, so only start afresh), weighted QUOTA_ALPHA to the
        latest."""
        used, self._used = self._used, on_cpu()
        if used is not None and self._used is not None and span > 0:
            share = (self._used - used) / (span * 1e9)
            self._use += QUOTA_ALPHA * (share - self._use)

    def _our_stalls(self, stalls: tuple[int, int]) -> int:
        """The ns the cgroup's quota stalled its tasks since the last look (``stalls``
        then), where that was for our own sessions' use of it (``_quota_is_ours``): that
        time is no stranger's (summed over the CPUs it stalled, it may be more than ours).
        Where other tasks of the cgroup spend the quota (CPU hogs inside a container), 0:
        the stalls are theirs, and count as theirs."""
        now = self._look_stalls
        if now is None or now[0] == stalls[0] or not self._quota_is_ours():
            return 0
        return now[1] - stalls[1]

    def _stall_words(self, stalls: tuple[int, int], ours: int) -> str:
        """The quota's side of a verdict, in words (``crowd.why``)."""
        now = self._look_stalls or stalls
        share = self.quota_share()
        return (f"; the quota stalled {now[0] - stalls[0]} times, {(now[1] - stalls[1]) / 1e3:.0f}"
                f" us, {ours / 1e3:.0f} of it taken as ours (our share of the quota "
                f"{share if share is None else round(share, 2)})")

    def _quota_is_ours(self) -> bool:
        """Whether our own sessions spend the cgroup's quota: QUOTA_OURS of it or more."""
        share = self.quota_share()
        return share is not None and share >= QUOTA_OURS

    def quota_share(self) -> float | None:
        """The share of the cgroup's CPU quota our own sessions spend, as reckoned: their
        processes (``ours``), each using about this thread's recent share of a CPU; None
        without a quota. (benchmarks/quota.py prints it.)"""
        limit = _quota()
        return None if limit is None else self._use * max(1, self.ours) / limit.cpus

    def forget(self) -> None:
        """Start afresh: the peers' start is over. While workers start, each spends seconds
        importing beside the others, which looks like strangers (N=8: 65% of the time off
        the core in spells of 10 ms); judged so, the session's first half second of calls
        slept on every round."""
        self.until = self.rate = 0.0
        self._seen = self._late = None
        self._stranger_looks = 0
        self._started = True

    def met_long_yield(self, now: float) -> None:
        """A wait met a stranger's time slice: unless the cgroup's CPU quota stalled us
        since the last long yield, for our own sessions' use of it (then the quota held us
        off the core, and spinning on is what pays: issue 9, twenty-seventh pass)."""
        before, self._yield_stalls = self._yield_stalls, _throttles()
        after = self._yield_stalls
        stalled = after is not None and (before is None or before[0] != after[0])
        if stalled and self._quota_is_ours():
            return
        self._count_long(now)

    def _count_long(self, now: float) -> None:
        """Count a long yield in the running rate; past CROWDED_RATE, a crowd."""
        rate = self.rate * 0.5 ** (max(0.0, now - self._last_long) / RATE_HALF_LIFE)
        self._last_long = now
        self.rate = rate = rate + _ALPHA * (1.0 - rate)
        if rate > CROWDED_RATE:
            self._crowded(now, f"long yields at a rate of {rate:.2f}")


crowd = _Crowd()


def cores() -> int:
    """The CPUs this process may run on (where the platform says), else all of them, and at
    least one: where the session's processes are no more than these, each spins on a core of
    its own. A cgroup's CPU quota does not lower it: the kernel still spreads the processes
    over these CPUs, where a yield hands the core to nobody and only adds a system call to
    each check (with a quota of one CPU on two, N=1's round took 4.3-5.2 µs of wall time
    checking busily, 6.0-6.1 yielding: docs/benchmarks.md, issue 9, twenty-eighth pass).
    Thread pools count ``pool_cores``."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, n or 1)


def pool_cores() -> int:
    """The cores a process's thread pools (BLAS, OpenMP) should share out: ``cores()``, no
    more than the cgroup's CPU quota rounded up (unison.cgroup), as loky and the JVM count
    it: threads past the quota only spend it sooner."""
    n = cores()
    limit = _quota()
    return n if limit is None else max(1, min(n, math.ceil(limit.cpus)))


@functools.cache
def _quota() -> cgroup.Quota | None:
    """The cgroup's CPU limit, read once a process: it is set when a container starts."""
    return cgroup.quota()


def _throttles() -> tuple[int, int] | None:
    """How often, and how long (ns over all its CPUs), the quota's cgroup has stalled its
    tasks so far; None without a quota."""
    limit = _quota()
    return None if limit is None else cgroup.throttled(limit.directory)


def busy_budget(processes: int) -> float:
    """BUSY where each of the session's ``processes`` on this host (this one included) can
    hold a core of its own, else 0."""
    return BUSY if processes <= cores() else 0.0


def spin(ready: Callable[..., _T], budget: float, busy: float = 0.0, *args: Any) -> _T | bool:
    """Check ``ready(*args)``, first without leaving the core for ``busy`` seconds (see
    BUSY), then yielding it between checks, until it is true or ``budget`` seconds passed.

    Returns ``ready``'s first true value, else False: then the caller sleeps on a kernel
    object (and must check again after announcing that it sleeps). On a crowded machine (see
    the module's docstring) it returns False at once, or after the first long yield. A C
    ``ready`` with its ``args`` (not a lambda around it) adds no Python frame per check."""
    now = _clock()
    if now >= crowd.next_look:
        crowd.look(now)
    if now < crowd.until:
        return False
    end = now + budget
    if busy:
        until = now + min(busy, budget)
        while now < until:
            got = ready(*args)
            if got:
                crowd.rate *= CALM  # a calm wait
                return got
            now = _clock()
    while now < end:
        _yield()
        got = ready(*args)
        if got:
            crowd.rate *= CALM  # a calm wait
            return got
        then, now = now, _clock()
        if now - then > LONG_YIELD:
            crowd.met_long_yield(now)
            return False
    crowd.rate *= CALM  # a calm wait
    return False


def hand_over() -> None:
    """Yield the core once, at the start of run's wait for replies (the shm channel's
    plain_values), where the session has more processes than cores (``busy_budget`` 0):
    the command was just sent, so no reply is in yet, and a worker waiting for a core to
    read it takes ours now rather than after the wait's set-up and first look. At N=2 on 2
    CPUs, run took 0.88-0.97x the time it took without (docs/benchmarks.md, "Issue 9,
    seventeenth pass"); call and sync gained nothing from a yield right after the send.
    Not on a crowded machine. Not timed: the worker that takes the core may run its call
    for long (a first call, say, that imports its module), and a few such yields would
    make a crowd of our own workers; the spin that follows judges its own yields. But it
    looks (``crowd.look``, every LOOK) as a spin would: where the replies are in once the
    core comes back, no spin follows, and beside two CPU hogs the yield went to a hog for
    its whole slice, run after run, 3.8 ms a round with nothing timed or looked at
    (sched_switch traces, docs/benchmarks.md "Issue 9, twenty-first pass")."""
    now = _clock()
    if now >= crowd.next_look:
        crowd.look(now)
    if now >= crowd.until:
        _yield()


class Pacer:
    """One polling wait: each ``pause()`` yields the core while within ``spin`` seconds of
    the Pacer's creation, and past that sleeps, first ``nap`` seconds, doubling each time up
    to ``cap``. Make a new Pacer for each wait: the schedule starts at its creation."""

    __slots__ = ("_cap", "_nap", "_spin_end")

    def __init__(self, spin: float = 0.0, nap: float = FIRST_NAP, cap: float = 5e-3) -> None:
        self._spin_end = _clock() + spin if spin > 0 else 0.0
        self._nap = nap
        self._cap = cap

    def pause(self, deadline: float | None = None) -> None:
        """Let time pass once. ``deadline`` (time.monotonic()): never sleep past it; the
        caller checks the deadline itself."""
        if self._spin_end:
            now = _clock()
            if now >= crowd.next_look:
                crowd.look(now)
            if now < self._spin_end and now >= crowd.until:
                _yield()
                then = _clock()
                if then - now > LONG_YIELD:
                    crowd.met_long_yield(then)
                return
        nap = self._nap
        self._nap = min(nap * 2, self._cap)
        if deadline is not None:
            nap = max(0.0, min(nap, deadline - time.monotonic()))
        time.sleep(nap)
