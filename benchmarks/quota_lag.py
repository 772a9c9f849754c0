"""When the kernel counts a CPU quota's stalls (issue 9, thirty-fourth pass).

    python benchmarks/quota_lag.py [--seconds 4]

pacing takes the stalls of a cgroup's quota off a look's time off the core, reading the
cgroup's cpu.stat (unison.cgroup.throttled). Root only, as quota.py: it makes a cgroup with a
quota of one CPU, and runs two processes spinning in it (itself and a hog), so that the quota
stalls both for about half of each 100 ms period. It reads its run delay
(pacing.run_delay) and cpu.stat in a loop; for each spell off the core over 10 ms it reads
cpu.stat until a stall is counted, and says how long that took: at once (the first read
after the spell), within one pacing.LOOK (the next look of a wait), two, or 300 ms.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.report import cpu_model, source_revision
from quota import NO_CGROUP, make_cgroup, remove_cgroup

LONG_SPELL_NS = 10_000_000
WAIT_S = 0.3


def inside(directory: str, seconds: float) -> int:
    from unison import cgroup, pacing

    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        lags: list[float | None] = []  # per long spell: s until cpu.stat counted a stall
        got, stat = pacing.run_delay(), cgroup.throttled(directory)
        if got is None or stat is None:
            print("this kernel keeps no run delay, or the cgroup no cpu.stat", file=sys.stderr)
            return NO_CGROUP
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            now, after = pacing.run_delay(), cgroup.throttled(directory)
            assert now is not None and after is not None
            if now[0] - got[0] > LONG_SPELL_NS:
                lag: float | None = 0.0
                start = time.perf_counter()
                while after[0] == stat[0]:  # spin (as the waits do) until it is counted
                    lag = time.perf_counter() - start
                    if lag > WAIT_S:
                        lag = None
                        break
                    after = cgroup.throttled(directory) or after
                lags.append(lag)
                now = pacing.run_delay() or now
            got, stat = now, after
    finally:
        hog.kill()
        hog.wait()
    look = pacing.LOOK
    bins = {"at once": sum(lag == 0.0 for lag in lags),
            f"within a look ({look * 1e3:.0f} ms)": sum(
                lag is not None and 0 < lag <= look for lag in lags),
            "within two looks": sum(lag is not None and look < lag <= 2 * look for lag in lags),
            f"within {WAIT_S * 1e3:.0f} ms": sum(
                lag is not None and 2 * look < lag for lag in lags),
            "not by then": sum(lag is None for lag in lags)}
    print(f"spells off the core over {LONG_SPELL_NS // 1_000_000} ms: {len(lags)}; cpu.stat "
          "counted a stall " + ", ".join(f"{k}: {v}" for k, v in bins.items()))
    late = sorted(lag for lag in lags if lag)
    if late:
        print("the late ones, ms: " + " ".join(f"{lag * 1e3:.0f}" for lag in late))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--inside", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.inside:
        return inside(args.inside, args.seconds)
    print(f"CPU: {cpu_model()}; {source_revision()}; command: python "
          f"benchmarks/quota_lag.py --seconds {args.seconds}")
    try:
        d = make_cgroup(1.0)
    except OSError as exc:
        print(f"cannot make a cgroup with a CPU quota here: {exc}", file=sys.stderr)
        return NO_CGROUP
    try:
        script = f"echo $$ > {d / 'cgroup.procs'} || exit {NO_CGROUP}; exec \"$0\" \"$@\""
        cmd = ["sh", "-c", script, sys.executable, __file__, "--inside", str(d),
               "--seconds", str(args.seconds)]
        return subprocess.run(cmd, check=False).returncode
    finally:
        remove_cgroup(d)


if __name__ == "__main__":
    raise SystemExit(main())
