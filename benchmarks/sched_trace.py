"""Where a session's processes ran, round by round: the kernel's sched_switch events (issue 9).

    python benchmarks/sched_trace.py [--workers 4] [--workload dispatch|gather_small]
                                     [--blocks 8] [--pause 0.3] [--hogs 0]
                                     [--cpu-affinity none|false|true]

One session, then blocks: a pause (the workers go to sleep, and the kernel places each anew
when it wakes), 2000 rounds to settle, 3000 timed ones (their median), then 500 traced with
tracefs's sched_switch event on. For each block it prints the median, the switches per
round, which CPU each process ran on, and a stretch of each CPU's sequence: C is the
controller, W<r> worker r, H<i> a hog, x anyone else; with --times, each switch's time
(µs, mod 100 ms). And each process's mean turn: from a switch into it to the next
switch on that CPU (turns under 100 µs; a lone spinner's whole block is one long turn).
The traced rounds are slower than the timed ones (the tracing costs).
Needs root (or a writable /sys/kernel/tracing); it turns the event off, empties the buffer
and puts tracing_on and the buffer's size back after, whatever happens.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import unison
from harness.measure import hogs
from harness.report import command_line, cpu_model, source_revision
from harness.tasks import noop, small_value

TRACE = Path("/sys/kernel/tracing")
_SWITCH = re.compile(r"\[(\d+)\].*?(\d+\.\d+): sched_switch: .*? next_pid=(\d+)")


@contextmanager
def switches() -> Iterator[Callable[[], str]]:
    """sched_switch recording, off until the callable's caller turns it on; the event off and
    the buffer emptied at the end."""
    def write(name: str, text: str) -> None:
        (TRACE / name).write_text(text)

    was = {name: (TRACE / name).read_text().split()[0] for name in ("tracing_on",
                                                                  "buffer_size_kb")}
    write("tracing_on", "0")
    write("buffer_size_kb", "8192")
    write("events/sched/sched_switch/enable", "1")
    try:
        yield lambda: (TRACE / "trace").read_text()
    finally:
        write("tracing_on", "0")
        write("events/sched/sched_switch/enable", "0")
        write("trace", "")
        for name, value in was.items():  # as we found them
            write(name, value)


def _traced(round_trip: Callable[[], object], rounds: int) -> str:
    (TRACE / "trace").write_text("")
    (TRACE / "tracing_on").write_text("1")
    try:
        for _ in range(rounds):
            round_trip()
    finally:
        (TRACE / "tracing_on").write_text("0")
    return (TRACE / "trace").read_text()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--workload", choices=["dispatch", "gather_small"], default="dispatch")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--pause", type=float, default=0.3, help="seconds idle before each block")
    p.add_argument("--hogs", type=int, default=0, help="CPU-bound processes beside it")
    p.add_argument("--cpu-affinity", choices=["none", "false", "true"], default="none")
    p.add_argument("--rounds", type=int, default=3000, help="timed rounds a block")
    p.add_argument("--times", action="store_true", help="each switch's time too")
    args = p.parse_args(argv)
    if not os.access(TRACE / "trace", os.W_OK):
        print(f"sched_trace: {TRACE} is not writable here (run as root)", file=sys.stderr)
        return 2
    affinity = {"none": None, "false": False, "true": True}[args.cpu_affinity]
    print(f"CPU: {cpu_model()}; {source_revision()}; command: "
          f"{command_line(sys.argv[1:] if argv is None else argv)}")
    with hogs(args.hogs) as hog_pids, \
            unison.Session(args.workers, cpu_affinity=affinity) as sess, switches():
        def round_trip() -> None:
            if args.workload == "dispatch":
                sess.call(noop)
                sess.sync()
            else:
                sess.run(small_value)

        pids = sess.run(os.getpid)
        names = {os.getpid(): "C", **{pid: f"W{r}" for r, pid in enumerate(pids)},
                 **{pid: f"H{i}" for i, pid in enumerate(hog_pids)}}
        print(f"{args.workload} N={args.workers} hogs={args.hogs} "
              f"cpu_affinity={affinity}: workers' CPUs at start "
              f"{sess.run(lambda: sorted(os.sched_getaffinity(0)))}")
        for block in range(args.blocks):
            time.sleep(args.pause)
            for _ in range(2000):
                round_trip()
            times = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                round_trip()
                times.append(time.perf_counter() - t0)
            traced = 500
            text = _traced(round_trip, traced)
            seq: dict[int, list[str]] = collections.defaultdict(list)
            where: dict[str, collections.Counter[int]] = collections.defaultdict(
                collections.Counter)
            turns: dict[str, list[float]] = collections.defaultdict(list)
            last: dict[int, tuple[str, float]] = {}  # cpu -> who came on, when
            count = 0
            for m in _SWITCH.finditer(text):
                cpu, stamp, pid = int(m.group(1)), float(m.group(2)), int(m.group(3))
                who = names.get(pid, "x")
                count += 1
                where[who][cpu] += 1
                if cpu in last:  # the one before held this CPU until now: its turn
                    turns[last[cpu][0]].append(stamp - last[cpu][1])
                last[cpu] = (who, stamp)
                seq[cpu].append(f"{who}@{stamp * 1e6 % 100_000:.0f}" if args.times else who)
            place = {who: dict(c) for who, c in sorted(where.items())}
            now = sess.run(lambda: sorted(os.sched_getaffinity(0)))
            print(f"block {block}: {statistics.median(times) * 1e6:.1f} µs, "
                  f"{count / traced:.1f} switches a round, switches into each by CPU "
                  f"{place}, workers' CPUs now {now}")
            # the trace stamps whole µs: a mean of many turns is finer than their median
            held = {who: round(statistics.fmean(short) * 1e6, 1)
                    for who, t in sorted(turns.items())
                    if len(short := [x for x in t if x < 100e-6]) >= 20}
            print(f"  mean turn on a CPU, µs (turns under 100 µs, 20 or more): {held}")
            for cpu, names_run in sorted(seq.items()):
                middle = names_run[len(names_run) // 2:][:30]
                print(f"  cpu{cpu}: " + (" " if args.times else "").join(middle))
    return 0


if __name__ == "__main__":
    sys.exit(main())
