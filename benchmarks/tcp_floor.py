"""The floor under unison's TCP channel on this machine: the same round trip over raw
Python sockets on loopback, nothing else (issue 12).

    python benchmarks/tcp_floor.py --workers 1 2 4 [--rounds 5000] [--spin]

N forked peers each echo a 40-byte message back over its own TCP connection (TCP_NODELAY,
blocking reads); the controller sends to all, then waits for every echo. Median and p99 in
µs. With ``--spin`` both ends wait as unison's TCP channel does: a peer yields and polls
until its socket is readable, the controller yields and looks with ``epoll_wait(0)``, and
every read is a ``recv_into`` a 1 MiB buffer: the syscalls a unison call makes, without
the runtime's Python around them. unison's TCP dispatch (benchmarks/cluster_bench.py) is read
against both in the same minutes: on a 2-vCPU VM the blocking echo is slower than unison (each
read waits for a wake-up), the spinning one 2.4-3x faster (docs/cluster.md, "Speed").
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


def _echo(port: int, spin: bool) -> None:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(1 << 20)
    look = select.poll()
    look.register(conn, select.POLLIN)
    while True:
        if spin:
            while not look.poll(0):
                os.sched_yield()
        k = conn.recv_into(buf)
        if not k:
            os._exit(0)
        conn.sendall(buf[:k])


def _wait_spinning(peers: list[socket.socket], look: select.epoll, buf: bytearray) -> None:
    by_fd = {conn.fileno(): conn for conn in peers}
    left = len(peers)
    while left:
        events = look.poll(0)
        if not events:
            os.sched_yield()
        for fd, _ in events:
            by_fd[fd].recv_into(buf)
            left -= 1


def measure(n: int, rounds: int, spin: bool = False) -> list[float]:
    server = socket.create_server(("127.0.0.1", 0))
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            _echo(server.getsockname()[1], spin)
        pids.append(pid)
    peers = []
    for _ in range(n):
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peers.append(conn)
    server.close()
    clock = time.perf_counter
    times = []
    look = select.epoll()
    for conn in peers:
        look.register(conn, select.EPOLLIN)
    buf = bytearray(1 << 20)
    try:
        for _ in range(rounds):
            start = clock()
            for conn in peers:
                conn.sendall(MESSAGE)
            if spin:
                _wait_spinning(peers, look, buf)
            else:
                waiting = set(peers)
                while waiting:
                    for conn in select.select(list(waiting), [], [])[0]:
                        conn.recv(100)
                        waiting.discard(conn)
            times.append(clock() - start)
    finally:
        look.close()
        for conn in peers:
            conn.close()
        for pid in pids:
            os.waitpid(pid, 0)
    return sorted(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=5000)
    parser.add_argument("--spin", action="store_true",
                        help="both ends spin (yield and poll) as unison's TCP channel does")
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}; command: python benchmarks/tcp_floor.py --workers "
          f"{' '.join(map(str, args.workers))} --rounds {args.rounds}"
          f"{' --spin' if args.spin else ''}\n")
    print("| N | median µs | p99 µs |")
    print("|---|---|---|")
    for n in args.workers:
        times = measure(n, args.rounds, args.spin)
        print(f"| {n} | {statistics.median(times) * 1e6:.1f} | "
              f"{percentile(times, 99) * 1e6:.1f} |")


if __name__ == "__main__":
    main()
