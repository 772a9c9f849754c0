"""How the processes of a round trip leave the core, per round (issue 9, ninth pass).

    python benchmarks/switches.py --workers 2 8 [--seconds 1] [--systems unison,floor] [--pin]
                                  [--perf] [--syscalls]

For each system and N, dispatch rounds for ``seconds``, then per round, from
/proc/<pid>/status: the controller's and the workers' (their mean) voluntary context
switches, which are sleeps (a wait that gave up its spin, or skipped it on a machine it
took for crowded), and involuntary ones (a yield that handed the core over, or a
preemption). A spinning round trip sleeps in almost no round; one that sleeps in many pays
a kernel wake-up each time.

And the CPU time each spent per round (its threads' /proc/<pid>/task/*/schedstat): on a
core that a worker shares with the controller, the round is the two's CPU time, context
switches and the caches they refill included, which a side's Python alone
(benchmarks/python_cost.py) leaves out. ``--pin`` pins worker r to CPU r (mod the CPUs)
and the controller to the first, so that each system meets the same placement (Linux moves
unpinned processes around, and a round trip's time moves with it).

Also how many workers are in the controller's scheduler autogroup (/proc/<pid>/autogroup,
where the kernel keeps them): Linux makes one per session, and a yield hands the core over
only inside the yielder's group, so a worker in a session of its own (setsid) kept the core
from the controller in part of its turns.

``--perf`` (root, and perf with the sched tracepoints): ``perf record -a -e
sched:sched_switch -e syscalls:sys_enter_sched_yield`` during 0.3 s of the rounds, then the
share of the workers' turns on a core that ended at their first yield (the rest took 2 or
more yields to hand the core over, or none).

``--syscalls`` (root, and perf with the syscall tracepoints): ``perf stat`` counts, in the
kernel and without waking perf, every system call of the controller and the workers during
``seconds`` more of the rounds, and the sched_yields among them: per round, what each side
asks of the kernel beyond its Python (a sleep is a select and an eventfd read and write; a
wake-up an eventfd write). Tracepoints make each call slower, so the rounds' time there is
not the table's.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.measure import _schedstat_cpu
from harness.report import cpu_model, source_revision
from harness.systems import make_system

PERF_SECONDS = 0.3


def _switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of ``pid`` so far."""
    with open(f"/proc/{pid}/status") as f:
        status = f.read()
    voluntary = re.search(r"^voluntary_ctxt_switches:\s*(\d+)", status, re.M)
    involuntary = re.search(r"^nonvoluntary_ctxt_switches:\s*(\d+)", status, re.M)
    if voluntary is None or involuntary is None:
        raise RuntimeError(f"/proc/{pid}/status has no context switch counts")
    return int(voluntary.group(1)), int(involuntary.group(1))


def _autogroup(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            return f.read().split()[0]
    except (OSError, IndexError):
        return None


def _first_yield_share(data: str, workers: set[int]) -> float:
    """The share of the workers' turns on a core that ended right after their first yield."""
    out = subprocess.run(["perf", "script", "-i", data, "-F", "tid,cpu,event,trace"],
                         capture_output=True, text=True, check=True).stdout
    turns: collections.Counter[int] = collections.Counter()  # yields in the turn -> turns
    running: dict[str, list[int]] = {}  # cpu -> [tid on it, its yields this turn]
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        tid, cpu, event = int(fields[0]), fields[1], fields[2]
        now = running.get(cpu)
        if "sched_yield" in event:
            if now is not None and now[0] == tid:
                now[1] += 1
        elif "sched_switch" in event:
            prev = re.search(r"prev_pid=(\d+)", line)
            nxt = re.search(r"next_pid=(\d+)", line)
            if prev is None or nxt is None:
                continue
            left = int(prev.group(1))
            if now is not None and now[0] == left and left in workers:
                turns[min(now[1], 2)] += 1
            running[cpu] = [int(nxt.group(1)), 0]
    total = sum(turns.values())
    return turns[1] / total if total else float("nan")


def _syscalls(system: object, pids: list[int],
              seconds: float) -> tuple[dict[int, tuple[int, int]], int]:
    """{pid: (system calls, sched_yields)} of ``pids`` over ``seconds`` of dispatch rounds,
    from ``perf stat``, and how many rounds that was. perf attaches after its start, so the
    rounds are the loop's rate times ``seconds``."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stat.csv"), os.path.join(tmp, "stderr")
        cmd = ["perf", "stat", "-x", ",", "--per-thread", "-o", out, "-p",
               ",".join(map(str, pids)), "-e", "raw_syscalls:sys_enter", "-e",
               "syscalls:sys_enter_sched_yield", "--", "sleep", str(seconds)]
        with open(err, "wb") as stderr:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr)
        dispatch = system.dispatch  # type: ignore[attr-defined]
        rounds, start = 0, time.perf_counter()
        while proc.poll() is None:  # a wait4 every 256 rounds: under 0.004 a round
            for _ in range(256):
                dispatch()
            rounds += 256
        took = time.perf_counter() - start
        if proc.returncode != 0:
            with open(err, errors="replace") as f:
                raise RuntimeError(f"perf stat failed: {f.read()[-500:]}")
        counts = {pid: (0, 0) for pid in pids}
        with open(out) as f:
            for line in f:  # "<comm>-<tid>,<count>,<unit>,<event>,...": one per thread
                fields = line.split(",")
                tid = fields[0].rpartition("-")[2]
                if len(fields) < 4 or not fields[1].isdigit() or not tid.isdigit():
                    continue
                if int(tid) in counts:  # the main threads; the controller's idle others: not
                    calls, yields = counts[int(tid)]
                    if fields[3].endswith("sched_yield"):
                        yields += int(fields[1])
                    else:
                        calls += int(fields[1])
                    counts[int(tid)] = (calls, yields)
    return counts, round(rounds * seconds / took)


def measure(name: str, n: int, seconds: float, perf: bool, pin: bool,
            syscalls: bool = False) -> tuple[str, str | None]:
    """The table's row for ``name`` at ``n`` workers, and with ``syscalls`` the row of the
    system calls' table."""
    system = make_system(name)
    system.start(n)
    me = os.getpid()
    allowed = os.sched_getaffinity(0)
    try:
        workers = system.worker_pids()
        if pin:
            cpus = sorted(allowed)
            for rank, pid in enumerate(workers):
                os.sched_setaffinity(pid, {cpus[rank % len(cpus)]})
            os.sched_setaffinity(0, {cpus[0]})
        for _ in range(2000):
            system.dispatch()
        mine = _autogroup(me)
        shared = sum(_autogroup(pid) == mine for pid in workers) if mine else None
        before = {pid: _switches(pid) for pid in (me, *workers)}
        cpu_before = {pid: _schedstat_cpu(pid) for pid in (me, *workers)}
        rounds, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            system.dispatch()
            rounds += 1
        took = time.perf_counter() - start
        after = {pid: _switches(pid) for pid in (me, *workers)}
        cpu = {pid: (_schedstat_cpu(pid) - cpu_before[pid]) * 1e6 / rounds
               for pid in (me, *workers)}
        share = ""
        if perf:
            with tempfile.TemporaryDirectory() as tmp:
                data = os.path.join(tmp, "sched.data")
                rec = subprocess.Popen(
                    ["perf", "record", "-q", "-a", "-o", data, "-e", "sched:sched_switch",
                     "-e", "syscalls:sys_enter_sched_yield", "--", "sleep", str(PERF_SECONDS)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                while rec.poll() is None:
                    system.dispatch()
                if rec.returncode == 0:
                    share = f" | {_first_yield_share(data, set(workers)):.0%}"
                else:
                    share = " | (perf failed)"
        calls = _syscalls(system, [me, *workers], seconds) if syscalls else None
    finally:
        os.sched_setaffinity(0, allowed)
        system.close()

    def per_round(pids: list[int], which: int) -> float:
        return sum(after[p][which] - before[p][which] for p in pids) / len(pids) / rounds

    group = "-" if shared is None else f"{shared}/{n}"
    shown = " ".join(f"{cpu[pid]:.1f}" for pid in workers[:4]) + (" ..." if n > 4 else "")
    row = (f"| {name} | {n} | {took / rounds * 1e6:.1f} | {per_round([me], 0):.3f} | "
           f"{per_round(workers, 0):.3f} | {per_round([me], 1):.2f} | "
           f"{per_round(workers, 1):.2f} | {cpu[me]:.1f} | {shown} | {group}{share} |")
    if calls is None:
        return row, None
    counts, made = calls[0], max(calls[1], 1)
    worker_calls = sum(counts[p][0] for p in workers) / n / made
    worker_yields = sum(counts[p][1] for p in workers) / n / made
    return row, (f"| {name} | {n} | {counts[me][0] / made:.2f} | {counts[me][1] / made:.2f} | "
                 f"{worker_calls:.2f} | {worker_yields:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--systems", default="unison,floor")
    parser.add_argument("--pin", action="store_true",
                        help="worker r on CPU r (mod the CPUs), the controller on the first")
    parser.add_argument("--perf", action="store_true",
                        help="also the workers' turns that ended at their first yield")
    parser.add_argument("--syscalls", action="store_true",
                        help="also each side's system calls per round (perf stat)")
    args = parser.parse_args()
    if (args.perf or args.syscalls) and shutil.which("perf") is None:
        parser.error("--perf and --syscalls need the perf tool on PATH (and root for its "
                     "tracepoints): install it, or run without them")
    print(f"CPU: {cpu_model()}; unison {source_revision()}; "
          f"command: python {' '.join(sys.argv)}\n")
    head = ("| system | N | µs per round | controller sleeps per round | worker sleeps per "
            "round | controller switched out | worker switched out | controller's CPU µs "
            "per round | each worker's CPU µs per round | workers in the controller's "
            "autogroup")
    print(head + (" | workers' turns ended at the first yield |" if args.perf else " |"))
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|" + ("--:|" if args.perf else ""))
    calls = []
    for n in args.workers:
        for name in args.systems.split(","):
            row, call_row = measure(name, n, args.seconds, args.perf, args.pin, args.syscalls)
            print(row, flush=True)
            if call_row is not None:
                calls.append(call_row)
    if calls:
        print("\nSystem calls per round (perf stat; the yields are among them):\n\n"
              "| system | N | controller's | its sched_yields | each worker's | their "
              "sched_yields |\n|---|--:|--:|--:|--:|--:|")
        print("\n".join(calls))


if __name__ == "__main__":
    main()
