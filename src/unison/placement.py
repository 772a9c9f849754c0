"""Where a session's local workers run: one to a CPU while the machine is calm.

Where a session's processes outnumber the CPUs (N=4 on 2), Linux places a worker where it
wakes, and after a sleep it often stacks three or four of them on one CPU; each yield then
hands that CPU along the stack. Dispatch at N=4 on 2 CPUs took 9 µs a round with the
workers two and two, 12-17 with three or four on one CPU, and which one a session got
changed with each pause (sched_switch traces, docs/benchmarks.md "Issue 9, twenty-first
pass"). Pinned one to a CPU, round robin (``spread_plan``), it took 9-10 µs.

A pinned worker cannot leave a CPU where a stranger runs, though: beside two CPU hogs, N=8
pinned took 3.9 ms a round (a hog's whole time slice) in 4 of 10 blocks, against 0.1 ms
unpinned. So the pins hold only until the first verdict that the machine is crowded
(pacing.crowd), the worker's own or the controller's. From then on every thread of the
worker may use every CPU it could at start, for the rest of the session: the kernel's
placement again, which handles strangers.

A session of one local worker is the other way round: its round is a strict hand-over
between two processes, and beside two CPU hogs it ran at 10-12 µs (gather_small) where
the kernel had put the controller and the worker on one CPU (each hand-over a switch, the
hogs on the other CPU) and at 28-36 µs where it had put each beside a hog (each hand-over a
wake-up that preempts a hog, four switches a round, caches cold). Which one a session got
was the kernel's coin, kept for seconds; the pipe's is the same coin (17 µs / 26 µs). So
while the machine is crowded the controller holds its lone worker on the CPU its waiting
thread last ran on, following it at each look (pacing.crowd.on_look), and lets go once calm
(docs/benchmarks.md, "Issue 9, twenty-fourth pass").

This module is the whole policy of ``cpu_affinity=None``: ``spread_plan`` says which
workers start held where, ``keep`` registers what the controller does with the crowd's
verdicts, ``hold`` is a held worker's side.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from unison import _proctree
from unison.pacing import crowd


def spread_plan(n: int, *, children: bool, inline: bool = False) -> dict[int, list[int]]:
    """Rank -> the one CPU it is held on while calm (a rank left out: not held). Only local
    workers (``children``), only where the session's processes outnumber the CPUs (the
    controller is one unless it runs worker 0 ``inline``, and it is never held), round
    robin over the CPUs this process may use."""
    if not children or not hasattr(os, "sched_getaffinity"):
        return {}  # workers elsewhere (Ray, hand-started) are not ours to place
    first = 1 if inline else 0
    if n + 1 - first <= len(os.sched_getaffinity(0)):
        return {}  # a core each: the kernel keeps them apart
    return round_robin(range(first, n))


def round_robin(ranks: range) -> dict[int, list[int]]:
    """Rank -> one CPU, over the CPUs this process may use in turn (``cpu_affinity=True``
    too)."""
    usable = sorted(os.sched_getaffinity(0))
    return {r: [usable[r % len(usable)]] for r in ranks}


def keep(pids: Sequence[int], starts: Sequence[int | None], plan: Mapping[int, list[int]],
         *, children: bool, inline: bool = False) -> Callable[[], None] | None:
    """In the controller of a session with the default ``cpu_affinity``, once its workers
    (``pids`` by rank, started at ``starts``: _proctree.started) are up: the spread workers
    of ``plan`` are let go at the first crowded verdict; a lone local worker follows the
    controller while crowded. Returns what unregisters that at close (a closed session's
    pids may be another's by then), or None where there is nothing to keep. A worker that
    has ended is left alone: its pid may be another program's already."""
    if plan:
        let_go = let_go_when_crowded([(pids[r], starts[r], plan[r]) for r in plan])
        return lambda: crowd.off_crowd(let_go)
    if len(pids) == 1 and children and not inline:
        follow = together_when_crowded(pids[0], starts[0])
        if follow is not None:
            return lambda: crowd.off_look(follow)
    return None


def hold(cpus: Sequence[int]) -> None:
    """In a worker, at start: keep this process on ``cpus`` until the first crowded
    verdict."""
    allowed = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpus)
    crowd.on_crowd(lambda: _set(os.getpid(), None, allowed, expect=cpus))


def let_go_when_crowded(workers: Sequence[tuple[int, int | None, Sequence[int]]]
                        ) -> Callable[[], None]:
    """In the controller, once the ``workers`` (pid, start time, the CPUs it is held on)
    are up: at its first crowded verdict, let each of them use every CPU this process may
    use (each thread still on the CPUs it was held on: one the user moved stays). Returns
    the registration, for ``crowd.off_crowd`` at close (a closed session's pids may be
    another's by then)."""
    allowed = sorted(os.sched_getaffinity(0))

    def let_go() -> None:
        for pid, start, held in workers:
            _set(pid, start, allowed, expect=held)

    crowd.on_crowd(let_go)
    return let_go


def together_when_crowded(pid: int, start: int | None) -> Callable[[bool], None] | None:
    """In the controller of a session whose one worker is the local process ``pid``: while
    the machine is crowded, keep the worker on the CPU the controller's waiting thread last
    ran on (see the module's docstring); once calm, let it use every CPU this process may.
    Returns the registration, for ``crowd.off_look`` at close; None with a single CPU."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None
    owner = os.getpid()
    held: int | None = None  # the CPU the worker is held on, if it is
    mine = True  # False once the user set the worker's CPUs: then they are the user's

    def follow(crowded: bool) -> None:
        nonlocal held, mine
        if os.getpid() != owner or not mine:  # (a forked child's copy: not its worker)
            return
        cpu = last_cpu() if crowded else None
        if cpu != held:
            mine = _set(pid, start, allowed if cpu is None else [cpu],
                        expect=allowed if held is None else [held])
            held = cpu

    crowd.on_look(follow)
    return follow


def last_cpu(pid: int | None = None) -> int | None:
    """The CPU process ``pid`` (None: this thread) last ran on, from its /proc stat's 39th
    field; None where that cannot be read."""
    stat = "/proc/thread-self/stat" if pid is None else f"/proc/{pid}/stat"
    try:
        with open(stat, "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def _set(pid: int, start: int | None, cpus: Sequence[int], *, expect: Sequence[int]) -> bool:
    """Every thread of process ``pid`` (those there now) that is on ``expect`` (the CPUs
    placement put it on) to ``cpus``, if the process is still the one that started at
    ``start`` (None: ourselves); a thread elsewhere was moved by the user's code, whose
    choice stands (before, placement overwrote it). Whether the process's main thread was
    still placement's to move (a process that is gone, or not ours to change: False)."""
    if not _proctree.same(pid, start):
        return False
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    want = set(expect)
    main = False
    for tid in tids:
        try:
            if os.sched_getaffinity(tid) == want:
                os.sched_setaffinity(tid, cpus)
                main = main or tid == pid
        except OSError:
            pass
    return main
