"""The cost of waiting from asyncio (issue 11): ``await`` against the blocking form of the
same round trip, interleaved in blocks in one session so that the machine's noise hits both.

    python benchmarks/async_bench.py --workers 2 [--rounds 2000] [--channel pipe]

    fetch   ref = sess.call(small_value); ref.gather()   vs  await sess.call(small_value)
    run     sess.run(small_value)                         vs  await sess.run_async(small_value)
    sync    sess.call(noop); sess.sync()                  vs  (same call); await sess.sync_async()

Prints medians and p99 (µs) and the ratio of the medians (target: at most 1.5x).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import unison
from harness.measure import percentile
from harness.tasks import noop, small_value

BLOCK = 50


async def _measure(sess: unison.Session, rounds: int) -> dict[str, list[float]]:
    def fetch() -> None:
        sess.call(small_value).gather()

    async def fetch_async() -> None:
        await sess.call(small_value)

    def run() -> None:
        sess.run(small_value)

    async def run_async() -> None:
        await sess.run_async(small_value)

    def sync() -> None:
        sess.call(noop)
        sess.sync()

    async def sync_async() -> None:
        sess.call(noop)
        await sess.sync_async()

    pairs: list[tuple[str, Callable[[], None], Callable[[], Awaitable[None]]]] = [
        ("fetch", fetch, fetch_async), ("run", run, run_async), ("sync", sync, sync_async)]
    out: dict[str, list[float]] = {}
    clock = time.perf_counter
    for _ in range(200):  # warm up both paths
        for _, blocking, awaiting in pairs:
            blocking()
            await awaiting()
    for _ in range(rounds // BLOCK):
        for name, blocking, awaiting in pairs:
            samples = out.setdefault(f"{name} blocking", [])
            for _ in range(BLOCK):
                t = clock()
                blocking()
                samples.append((clock() - t) * 1e6)
            samples = out.setdefault(f"{name} await", [])
            for _ in range(BLOCK):
                t = clock()
                await awaiting()
                samples.append((clock() - t) * 1e6)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--channel", default="auto", help="the session's channel (auto, shm, pipe)")
    args = p.parse_args()
    with unison.Session(args.workers, channel=args.channel) as sess:
        out = asyncio.run(_measure(sess, args.rounds))
    print(f"N={args.workers}, channel {args.channel}, {args.rounds} rounds each, interleaved "
          f"in blocks of {BLOCK}")
    print("| round trip | blocking median / p99 (µs) | await median / p99 (µs) "
          "| await / blocking |")
    print("|---|--:|--:|--:|")
    for name in ("fetch", "run", "sync"):
        b, a = sorted(out[f"{name} blocking"]), sorted(out[f"{name} await"])
        mb, ma = statistics.median(b), statistics.median(a)
        label = {"fetch": "`ref.gather()` vs `await ref`",
                 "run": "`sess.run(f)` vs `await sess.run_async(f)`",
                 "sync": "`call; sess.sync()` vs `call; await sess.sync_async()`"}[name]
        print(f"| {label} | {mb:.1f} / {percentile(b, 99):.0f} | {ma:.1f} / "
              f"{percentile(a, 99):.0f} | {ma / mb:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
