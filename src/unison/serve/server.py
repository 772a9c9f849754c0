"""``unison serve``: flags, logging, and uvicorn run programmatically.

    unison serve [--host 127.0.0.1] [--port 8000] [--tp 2] [--dp 1] [--max-batch 64]
                 [--batch-window-ms 2] [--max-queue 1024] [--max-inputs 256]
                 [--backend unison | sentence-transformers]

SIGTERM (or Ctrl-C): uvicorn stops accepting; the batcher drains its queue for up to
--drain-seconds, answers what is left with 503 and closes the workers, while uvicorn waits a
little longer for the requests in flight; the process exits 0.
uvicorn re-raises the signal it caught once it is done (so that a default handler would end
the process by that signal): the handler installed here only asks uvicorn to stop, which makes
that re-raise harmless and the exit status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

__all__ = ["add_arguments", "main"]

EXIT_FAILED = 1
EXIT_USAGE = 2
_ANSWER_S = 2
"""Seconds past --drain-seconds that uvicorn waits: the batcher's 503s for what was left
are written in them."""


def _server_class() -> type[Any]:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, whose shutdown also starts ``drain``: --drain-seconds on, the
        batcher stops and answers what is left with its 503 (JSON, Retry-After), so uvicorn,
        whose grace is _ANSWER_S longer, finds every request answered. Before, at the end of
        uvicorn's grace, it cancelled the requests still in flight, and their clients got a
        bare "500 Internal Server Error". Requests in flight meanwhile (a body still coming,
        a long text being tokenized) are still taken in, as before."""

        drain: Callable[[], Awaitable[None]] | None = None

        async def shutdown(self, sockets: Any = None) -> None:
            draining = None if self.drain is None else asyncio.ensure_future(self.drain())
            try:
                await super().shutdown(sockets)
            finally:  # all answered first (or a second Ctrl-C): no stop to wait for
                if draining is not None:
                    draining.cancel()

    return Server


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's flags (cli.py's ``serve`` subcommand)."""
    from unison.serve.backends import BACKENDS
    from unison.serve.config import ServeConfig

    d = ServeConfig()
    parser.add_argument("--host", default=d.host,
                        help=f"address to bind (default {d.host}: this machine only)")
    parser.add_argument("--port", type=int, default=d.port, help=f"default {d.port}")
    parser.add_argument("--tp", type=int, default=d.tp,
                        help=f"tensor-parallel workers per replica (default {d.tp})")
    parser.add_argument("--dp", type=int, default=d.dp,
                        help=f"data-parallel replicas; each batch is split over them "
                             f"(default {d.dp})")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=d.device,
                        help="cuda: one worker per GPU")
    parser.add_argument("--backend", choices=BACKENDS, default=d.backend,
                        help="unison (the product) or sentence-transformers in this one "
                             "process (the benchmark's baseline; --tp/--dp unused)")
    parser.add_argument("--max-batch", type=int, default=d.max_batch,
                        help=f"most inputs per batch sent to the model (default {d.max_batch})")
    parser.add_argument("--batch-window-ms", type=float, default=d.batch_window_ms,
                        help="how long the first request of a batch waits for others "
                             f"(default {d.batch_window_ms:g})")
    parser.add_argument("--max-queue", type=int, default=d.max_queue,
                        help="most inputs waiting for a batch; beyond, 429 with Retry-After "
                             f"(default {d.max_queue})")
    parser.add_argument("--max-inputs", type=int, default=d.max_inputs,
                        help=f"most inputs in one request; beyond, 400 (default {d.max_inputs})")
    parser.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / 2**20,
                        help="largest request body; beyond, 413 (default "
                             f"{d.max_body_bytes / 2**20:g})")
    parser.add_argument("--max-bodies-mb", type=float, default=d.max_bodies_bytes / 2**20,
                        help="request bodies the server may hold while they arrive, all "
                             "requests together; beyond, 503 (default "
                             f"{d.max_bodies_bytes / 2**20:g})")
    parser.add_argument("--body-timeout", type=float, default=d.body_timeout,
                        help="seconds a request's body may take to arrive; beyond, 408 "
                             f"(default {d.body_timeout:g})")
    parser.add_argument("--drain-seconds", type=float, default=d.drain_seconds,
                        help="on SIGTERM, how long requests in flight may still take "
                             f"(default {d.drain_seconds:g})")
    parser.add_argument("--access-log", action="store_true", help="log every request")
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"))


def _body_bytes(mb: float, flag: str = "--max-body-mb") -> int:
    """A flag's MiB in bytes: ValueError naming the flag for NaN or inf (int() raised its
    own OverflowError, a traceback)."""
    if not math.isfinite(mb):
        raise ValueError(f"{flag} must be a finite number, got {mb}")
    return int(mb * 2**20)


def main(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or Ctrl-C; the exit status."""
    # The tokenizer's own thread pool buys nothing for a request's few texts, and would warn
    # at each fork (the workers' launch) once it has run.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from unison.demo.config import SetupError
    from unison.serve.config import ServeConfig

    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as exc:
        print(f"unison serve: {exc.name} is missing: pip install 'unison[serve]'",
              file=sys.stderr)
        return EXIT_FAILED
    import prometheus_client
    from tqdm import tqdm

    from unison.serve.app import create_app

    # the encoder's progress bar is off (progress=False), but tqdm starts its monitor thread
    # even for a disabled bar: no such thread in a server, waking every 10 s for nothing
    tqdm.monitor_interval = 0
    # a third fewer lines in each /metrics answer (metrics.py): this process is the server's
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

    level = getattr(logging, args.log_level.upper())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s unison.serve: %(message)s"))
    logger = logging.getLogger("unison.serve")
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    try:
        cfg = ServeConfig(
            host=args.host, port=args.port, backend=args.backend, tp=args.tp, dp=args.dp,
            device=args.device, max_batch=args.max_batch,
            batch_window_ms=args.batch_window_ms, max_queue=args.max_queue,
            max_inputs=args.max_inputs, max_body_bytes=_body_bytes(args.max_body_mb),
            max_bodies_bytes=_body_bytes(args.max_bodies_mb, "--max-bodies-mb"),
            body_timeout=args.body_timeout,
            drain_seconds=args.drain_seconds, access_log=args.access_log)
        cfg.check()  # before check_tp, whose words are the Python API's ("tp", not "--tp")
        if cfg.backend == "unison":
            from unison.demo.config import load_config, model_dir
            from unison.demo.plan import check_tp

            check_tp(cfg.tp, load_config(model_dir()))
        app = create_app(cfg)
    except (ValueError, SetupError) as exc:
        print(f"unison serve: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ValueError) else EXIT_FAILED

    # http "auto": httptools (the serve extra installs it; a C parser, a quarter less loop time
    # per request than h11, which uvicorn falls back to). loop "asyncio": the loop tested here
    # (unison's awaits watch their fds with add_reader).
    config = uvicorn.Config(
        app, host=cfg.host, port=cfg.port, loop="asyncio", http="auto", ws="none",
        lifespan="on", log_level=args.log_level, access_log=cfg.access_log,
        timeout_graceful_shutdown=max(1, math.ceil(cfg.drain_seconds)) + _ANSWER_S)
    server = _server_class()(config)

    async def drain() -> None:
        await asyncio.sleep(cfg.drain_seconds)
        await app.state.batcher.stop(timeout=0.0)

    server.drain = drain

    def stop(sig: int, frame: FrameType | None) -> None:
        server.should_exit = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    logger.info("serving %s on http://%s:%d (backend %s%s), model loading in the background",
                "all-MiniLM-L6-v2", cfg.host, cfg.port, cfg.backend,
                f", tp={cfg.tp} x dp={cfg.dp}" if cfg.backend == "unison" else "")
    server.run()
    return 0 if server.started else EXIT_FAILED
