"""CPU that each process of an idle session uses, and its busiest thread: the rule is at
most 0.1% of a core per worker, and nothing that spins while no call is pending.

    python benchmarks/idle_cpu.py [--seconds 10] [--modes local tcp tcp-torch serve]

Modes: ``local`` (Session(2), the default shm channel), ``local-torch`` (with
``collectives="torch"``), ``tcp`` (2 workers started by hand that join over TCP),
``tcp-torch`` (the same with ``collectives="torch"``: gloo, as across hosts) and ``serve``
(``unison serve --tp 2``, after /health says ok). Each session first runs 100 calls (and one
allreduce where it has torch), then rests 3 s (torch's start-up settles), then its
processes' CPU and wake-ups (``/proc/<pid>/task/*/schedstat``) are read over ``--seconds``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil

import unison
from harness.hand import hand_session
from harness.measure import schedstat_tasks
from harness.report import header

MODES = ("local", "local-torch", "tcp", "tcp-torch", "serve")


def _comm(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _tree(top: int) -> list[int]:
    """``top`` and every process under it."""
    root = psutil.Process(top)
    return [top, *(p.pid for p in root.children(recursive=True))]


def measure(mode: str, top: int, workers: set[int], seconds: float) -> None:
    """Print each process under ``top`` (itself included): its CPU and wake-ups over
    ``seconds``, and its busiest thread (by /proc's comm; Python names none)."""
    pids = _tree(top)
    names = {t.native_id: t.name for t in threading.enumerate()}
    before = {pid: schedstat_tasks(pid) for pid in pids}
    time.sleep(seconds)
    for pid in pids:
        after = schedstat_tasks(pid)
        use = {tid: (ns - before[pid].get(tid, (0, 0))[0], runs - before[pid].get(tid, (0, 0))[1])
               for tid, (ns, runs) in after.items()}
        ns = sum(u[0] for u in use.values())
        runs = sum(u[1] for u in use.values())
        busiest = max(use, key=lambda t: use[t][0])
        name = names.get(busiest) or _comm(pid, busiest)  # (ours by their Python names)
        role = "controller" if pid == top else "worker" if pid in workers else "other"
        print(f"{mode:11} {role:12} pid {pid}: {ns / 1e9 / seconds * 100:.3f}% of a core, "
              f"{runs / seconds:.1f} wake-ups/s; busiest thread {name!r} "
              f"{use[busiest][0] / 1e9 / seconds * 100:.3f}%")


def _one_allreduce() -> float:
    import torch

    return float(unison.allreduce(torch.ones(4))[0])


@contextlib.contextmanager
def _session(mode: str) -> Iterator[unison.Session]:
    collectives = "torch" if mode.endswith("torch") else "shm"
    if mode.startswith("local"):
        with unison.Session(2, collectives=collectives) as sess:
            yield sess
        return
    with hand_session(2, collectives=collectives) as sess:
        yield sess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    print(header(sys.argv[1:]))
    for mode in args.modes:
        if mode == "serve":
            from serve_bench import Server

            with tempfile.TemporaryDirectory() as logs:
                server = Server(["--tp", "2"], Path(logs))
                try:
                    server.wait_ok()
                    import httpx

                    pids = httpx.get(f"{server.url}/health", timeout=5).json()["workers"]
                    time.sleep(3)
                    measure(mode, server.proc.pid, set(pids), args.seconds)
                finally:
                    server.stop()
            continue
        with _session(mode) as sess:
            for _ in range(100):
                sess.run(int, 1)
            if mode.endswith("torch"):
                sess.run(_one_allreduce)
            workers = set(sess.run(os.getpid))
            time.sleep(3)
            measure(mode, os.getpid(), workers, args.seconds)


if __name__ == "__main__":
    main()
