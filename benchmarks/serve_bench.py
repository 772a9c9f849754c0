"""``unison serve`` under load, against the same app serving sentence-transformers in one
process (``--backend sentence-transformers``: same HTTP stack, same batcher, same flags).

    python benchmarks/serve_bench.py [--seconds 5] [--concurrency 1,8,32,128]
                                     [--systems unison-tp2,unison-dp2,sentence-transformers]
                                     [--json results.json]

For each system: start the server (a subprocess on 127.0.0.1, a free port), wait for /health
"ok", warm up for a second, then for each concurrency C run C closed-loop clients (asyncio, a
lean HTTP/1.1 client, one kept-alive connection each: ``_post`` says why not httpx) that POST
/v1/embeddings with one sentence each (the demo's 39 built-in sentences, in turn; base64
vectors, as the official openai client asks by default) for ``--seconds``, after a half-second
ramp that is not counted. Throughput is the requests (= sentences) answered per second in the
window; latency is per request, from send to the last byte, p50 and p99. Meanwhile a separate
process (so that the load generator's own event loop does not pollute it) asks GET /health
every 10 ms over its own connection: /health p50/p99 under that load. Every server is stopped
with SIGTERM and must exit 0.

Server flags, for every system: --max-batch 64 --batch-window-ms 2 --max-queue 4096 (so that
no request is refused at C=128). The load generator runs on the same machine and competes for
the same cores: it costs every system the same, and is part of what a reader would see.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from unison.demo.sentences import CORPUS, QUERIES
from unison.info import cpu_model

SYSTEMS: dict[str, list[str]] = {
    "unison-tp2": ["--backend", "unison", "--tp", "2", "--dp", "1"],
    "unison-dp2": ["--backend", "unison", "--tp", "1", "--dp", "2"],
    "sentence-transformers": ["--backend", "sentence-transformers"],
}
LABELS = {
    "unison-tp2": "unison serve, tp=2 x dp=1 (2 workers)",
    "unison-dp2": "unison serve, tp=1 x dp=2 (2 workers)",
    "sentence-transformers": "same app, sentence-transformers in 1 process",
}
COMMON = ["--max-batch", "64", "--batch-window-ms", "2", "--max-queue", "4096"]
RAMP = 0.5
TEXTS = [*CORPUS, *QUERIES]


def _pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered)) - 1))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One ``unison serve`` subprocess."""

    def __init__(self, flags: Sequence[str], log_dir: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"serve-{self.port}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "unison", "serve", "--port", str(self.port), *COMMON,
                 *flags], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.started = time.monotonic()

    def wait_ok(self, timeout: float = 120.0) -> float:
        """Seconds from the start until /health said ok."""
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.TransportError:
                pass
            if time.monotonic() - self.started > timeout:
                raise RuntimeError(f"not ok after {timeout} s:\n{self.log_path.read_text()}")
            time.sleep(0.05)

    def stop(self) -> tuple[int, float]:
        """SIGTERM; (exit status, seconds to exit)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        return code, time.monotonic() - t0


async def _post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                body: bytes) -> tuple[int, bytes]:
    """One POST /v1/embeddings on a kept-alive connection: (status, body). A lean HTTP/1.1
    client (the server always answers with Content-Length): httpx's AsyncClient spent more
    than the server on each request here and collapsed past a few dozen connections (a /health
    load: 300 requests/s at 8 connections, 104 at 32, where this client does 1700)."""
    writer.write(b"POST /v1/embeddings HTTP/1.1\r\nHost: bench\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, await reader.readexactly(length)


async def _load(url: str, concurrency: int, seconds: float) -> dict[str, Any]:
    """``concurrency`` closed-loop clients, one connection each, for RAMP + ``seconds``; the
    window's figures."""
    host, port = url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    start = loop.time()
    begin, end = start + RAMP, start + RAMP + seconds
    latencies: list[float] = []
    done = 0
    errors: dict[int, int] = {}

    async def user(k: int) -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection(host, int(port))
        i = k
        try:
            while loop.time() < end:
                body = json.dumps({"model": "all-MiniLM-L6-v2", "input": TEXTS[i % len(TEXTS)],
                                   "encoding_format": "base64"}).encode()
                i += concurrency
                t0 = loop.time()
                status, reply = await _post(reader, writer, body)
                t1 = loop.time()
                if status != 200 or b'"embedding"' not in reply:
                    errors[status] = errors.get(status, 0) + 1
                    continue
                if t0 >= begin and t1 <= end:
                    latencies.append(t1 - t0)
                if begin <= t1 <= end:
                    done += 1
        finally:
            writer.close()

    await asyncio.gather(*(user(k) for k in range(concurrency)))
    return {
        "concurrency": concurrency,
        "requests_per_s": done / seconds,
        "p50_ms": _pct(latencies, 50) * 1e3,
        "p99_ms": _pct(latencies, 99) * 1e3,
        "measured": len(latencies),
        "errors": errors,
    }


def probe_health(url: str, seconds: float) -> list[float]:
    """GET /health every 10 ms for ``seconds`` over one connection: each latency in s."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        conn.request("GET", "/health")
        conn.getresponse().read()
        out.append(time.perf_counter() - t0)
        time.sleep(0.01)
    conn.close()
    return out


def _stage(url: str, concurrency: int, seconds: float) -> dict[str, Any]:
    prober = subprocess.Popen(
        [sys.executable, __file__, "--probe", url, str(RAMP + seconds)],
        stdout=subprocess.PIPE, text=True)
    try:
        result = asyncio.run(_load(url, concurrency, seconds))
    finally:
        out, _ = prober.communicate(timeout=30)
    health = json.loads(out)
    result["health_p50_ms"] = _pct(health, 50) * 1e3
    result["health_p99_ms"] = _pct(health, 99) * 1e3
    result["health_max_ms"] = max(health) * 1e3
    return result


def run_system(name: str, levels: Sequence[int], seconds: float, log_dir: Path) -> dict[str, Any]:
    server = Server(SYSTEMS[name], log_dir)
    try:
        ready = server.wait_ok()
        print(f"{LABELS[name]}: ok after {ready:.1f} s", file=sys.stderr, flush=True)
        asyncio.run(_load(server.url, 8, 1.0))  # warm-up: first batches, connections
        stages = []
        for c in levels:
            stages.append(_stage(server.url, c, seconds))
            s = stages[-1]
            print(f"  C={c:<4} {s['requests_per_s']:7.1f} req/s  p50 {s['p50_ms']:7.1f} ms  "
                  f"p99 {s['p99_ms']:7.1f} ms  /health p99 {s['health_p99_ms']:.1f} ms",
                  file=sys.stderr, flush=True)
    finally:
        code, took = server.stop()
    return {"system": name, "label": LABELS[name], "ready_s": ready, "stages": stages,
            "sigterm_exit": code, "sigterm_s": took}


def report(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"`{meta['command']}` ({meta['seconds_total']:.0f} s), on `{meta['cpu']}` "
        f"({meta['cores']} cores), Python {meta['python']}; 1-minute load average "
        f"{meta['loadavg_1min'][0]} before, {meta['loadavg_1min'][1]} after.",
        "",
        "| system | C | requests/s | p50 ms | p99 ms | /health p50 ms | /health p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for s in r["stages"]:
            err = f" ({s['errors']} errors)" if s["errors"] else ""
            lines.append(f"| {r['label']} | {s['concurrency']} | {s['requests_per_s']:.1f}{err} "
                         f"| {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {s['health_p50_ms']:.2f} "
                         f"| {s['health_p99_ms']:.2f} |")
    lines.append("")
    for r in results:
        lines.append(f"- {r['label']}: /health ok {r['ready_s']:.1f} s after the start; "
                     f"SIGTERM: exit {r['sigterm_exit']} after {r['sigterm_s']:.2f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per level")
    parser.add_argument("--concurrency", default="1,8,32,128")
    parser.add_argument("--systems", default="unison-tp2,unison-dp2,sentence-transformers")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--probe", nargs=2, metavar=("URL", "SECONDS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe_health(args.probe[0], float(args.probe[1]))))
        return 0
    levels = [int(c) for c in args.concurrency.split(",")]
    names = args.systems.split(",")
    for n in names:
        if n not in SYSTEMS:
            parser.error(f"unknown system {n!r}: use {', '.join(SYSTEMS)}")
    t0 = time.monotonic()
    load_before = os.getloadavg()[0]
    results = []
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        for n in names:
            results.append(run_system(n, levels, args.seconds, Path(tmp)))
    meta = {
        "command": "python benchmarks/serve_bench.py " + " ".join(argv or sys.argv[1:]),
        "seconds_total": time.monotonic() - t0, "cpu": cpu_model(), "cores": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    print(report(results, meta))
    if args.json is not None:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0 if all(r["sigterm_exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
