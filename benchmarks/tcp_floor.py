"""The floor under unison's TCP channel on this machine: the same round trip over raw
Python sockets on loopback, nothing else (issue 12).

    python benchmarks/tcp_floor.py --workers 1 2 4 [--rounds 5000]

N forked peers each echo a 40-byte message back over its own TCP connection (TCP_NODELAY,
blocking reads); the controller sends to all, then waits for every echo. Median and p99 in
µs. unison's TCP dispatch (benchmarks/cluster_bench.py) is read against this in the same
minutes: the machine's wake-up latency, not unison, sets most of it.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.measure import percentile
from harness.report import cpu_model

MESSAGE = b"x" * 40


def _echo(port: int) -> None:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        data = conn.recv(100)
        if not data:
            os._exit(0)
        conn.sendall(data)


def measure(n: int, rounds: int) -> list[float]:
    server = socket.create_server(("127.0.0.1", 0))
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            _echo(server.getsockname()[1])
        pids.append(pid)
    peers = []
    for _ in range(n):
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peers.append(conn)
    server.close()
    clock = time.perf_counter
    times = []
    try:
        for _ in range(rounds):
            start = clock()
            for conn in peers:
                conn.sendall(MESSAGE)
            waiting = set(peers)
            while waiting:
                for conn in select.select(list(waiting), [], [])[0]:
                    conn.recv(100)
                    waiting.discard(conn)
            times.append(clock() - start)
    finally:
        for conn in peers:
            conn.close()
        for pid in pids:
            os.waitpid(pid, 0)
    return sorted(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=5000)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}; command: python benchmarks/tcp_floor.py --workers "
          f"{' '.join(map(str, args.workers))} --rounds {args.rounds}\n")
    print("| N | median µs | p99 µs |")
    print("|---|---|---|")
    for n in args.workers:
        times = measure(n, args.rounds)
        print(f"| {n} | {statistics.median(times) * 1e6:.1f} | "
              f"{percentile(times, 99) * 1e6:.1f} |")


if __name__ == "__main__":
    main()
