"""Round trips in a cgroup with a CPU quota, as a container's ``--cpus`` or a Kubernetes pod's
CPU limit makes (issue 9, twenty-seventh pass).

    python benchmarks/quota.py [--cpus 1] [--systems unison,floor,pipe] [--workers 1 2 4]
                               [--workload dispatch] [--hogs 0] [--blocks 6] [--seconds 1]

Root only: it makes a cgroup with a quota of ``--cpus`` CPUs per 100 ms period (cgroup v1's
cpu hierarchy, or v2 with the cpu controller), runs itself inside it, and removes it after.
There the systems take turns, in blocks of ``--seconds``; a block's figure is its wall time
over its rounds, because the quota's stalls fall between rounds: a round that spins is as
quick as ever, and the next one waits out the rest of the period, which no round's median
shows. ``--hogs`` CPU hogs run inside the cgroup as well, spending the quota. Unison's row
also gives the share of the quota its controller reckons its sessions spend (median over the
blocks; pacing.QUOTA_OURS or more: the stalls are our own spinning's) and how many blocks
had a crowded verdict (pacing.crowd; standard error says what gave each); the end, how many
periods the quota stalled the cgroup.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.measure import hogs
from harness.report import command_line, cpu_model, source_revision
from harness.systems import make_system

PERIOD_US = 100_000
NO_CGROUP = 3
"""The exit status where this machine gives no cgroup to make (not root, no cpu controller)."""


def make_cgroup(cpus: float) -> Path:
    """A fresh cgroup with a quota of ``cpus`` CPUs; raises where this machine has none to
    give (not root, no cpu controller)."""
    name = f"unison-quota-{uuid.uuid4().hex[:8]}"
    quota = int(cpus * PERIOD_US)
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists():
        d = v1 / name
        d.mkdir()
        (d / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (d / "cpu.cfs_quota_us").write_text(str(quota))
        return d
    v2 = Path("/sys/fs/cgroup")
    if "cpu" in (v2 / "cgroup.subtree_control").read_text().split():
        d = v2 / name
        d.mkdir()
        (d / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        return d
    raise OSError("no cgroup cpu controller to make a quota with (cgroup v1 cpu, or v2 with "
                  "cpu in /sys/fs/cgroup/cgroup.subtree_control)")


def remove_cgroup(d: Path) -> None:
    """Remove ``d`` once its last task has left (it may take a moment)."""
    for _ in range(100):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
    print(f"warning: could not remove {d}", file=sys.stderr)


def wall_block(op: Callable[[], object], seconds: float) -> float:
    """µs per round over ``seconds`` of wall time, stalls included."""
    rounds, start = 0, time.perf_counter()
    end = start + seconds
    while True:
        for _ in range(50):
            op()
        rounds += 50
        now = time.perf_counter()
        if now >= end:
            return (now - start) / rounds * 1e6


def ours_share() -> float:
    """pacing.crowd.quota_share(): at pacing.QUOTA_OURS or more, the quota's stalls count as
    our own spinning's; nan without a quota."""
    from unison import pacing

    share = pacing.crowd.quota_share()
    return float("nan") if share is None else share


def inside(args: argparse.Namespace) -> int:
    """In the cgroup: the systems in turns at each N."""
    from unison import pacing

    names = args.systems.split(",")
    print(f"inside: pacing.cores() = {pacing.cores()}, pacing.pool_cores() = "
          f"{pacing.pool_cores()}", file=sys.stderr, flush=True)
    with contextlib.ExitStack() as stack:
        if args.hogs:
            stack.enter_context(hogs(args.hogs))
        for n in args.workers:
            systems = {name: make_system(name) for name in names}
            blocks: dict[str, list[float]] = {name: [] for name in names}
            verdicts, shares, whys = 0, [], []
            try:
                for system in systems.values():
                    system.start(n)
                    system.dispatch()
                for i in range(args.blocks):
                    turn = list(systems.items())
                    for name, system in turn if i % 2 == 0 else reversed(turn):
                        before = pacing.crowd.until
                        blocks[name].append(
                            wall_block(getattr(system, args.workload), args.seconds))
                        if name == "unison":
                            if pacing.crowd.until != before:
                                verdicts += 1
                                whys.append(f"block {i}: {pacing.crowd.why}")
                            shares.append(ours_share())
            finally:
                for system in systems.values():
                    system.close()
            for name, got in blocks.items():
                print(f"{name} N={n}, each block: " + " ".join(f"{b:.1f}" for b in got),
                      file=sys.stderr, flush=True)
                extra = (f" | {statistics.median(shares):.2f} | {verdicts}" if name == "unison"
                         else " | - | -")
                print(f"| {args.workload} | {n} | {name} | {statistics.median(got):.1f} | "
                      f"{min(got):.1f}-{max(got):.1f}{extra} |", flush=True)
            for why in whys:
                print(f"unison N={n}, a crowded verdict in {why}", file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpus", type=float, default=1.0)
    p.add_argument("--systems", default="unison,floor,pipe")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--workload", default="dispatch", choices=["dispatch", "gather_small"])
    p.add_argument("--hogs", type=int, default=0)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inside:
        return inside(args)
    given = sys.argv[1:] if argv is None else argv
    print(f"CPU: {cpu_model()}, {len(os.sched_getaffinity(0))} CPUs seen; quota {args.cpus} "
          f"CPUs; hogs in the cgroup: {args.hogs}; {source_revision()}; command: "
          f"{command_line(given)}\n")
    try:
        d = make_cgroup(args.cpus)
    except OSError as exc:
        print(f"cannot make a cgroup with a CPU quota here: {exc}. Run it as root on Linux "
              "with the cgroup cpu controller (v1's cpu hierarchy, or v2 with cpu enabled in "
              "/sys/fs/cgroup/cgroup.subtree_control)", file=sys.stderr)
        return NO_CGROUP
    try:
        # joining it may still be refused (cgroup v2's rules): that is no cgroup to use either
        script = (f"echo $$ > {d / 'cgroup.procs'} || exit {NO_CGROUP}; "
                  f"exec \"$0\" \"$@\"")
        cmd = ["sh", "-c", script, sys.executable, __file__, "--inside", *given]
        print("| workload | N | system | wall µs a round, median of blocks | blocks' range | "
              "share of the quota unison reckons its own | unison's crowded verdicts |\n"
              "|---|--:|---|--:|--:|--:|--:|", flush=True)
        code = subprocess.run(cmd, check=False).returncode
        stat = (d / "cpu.stat").read_text().split("\n")
        print("\ncgroup: " + ", ".join(line for line in stat if line.startswith(
            ("nr_periods", "nr_throttled"))))
        return code
    finally:
        remove_cgroup(d)


if __name__ == "__main__":
    raise SystemExit(main())
