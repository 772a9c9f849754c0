"""The ``unison`` command: ``unison demo`` runs the main job (a real model split across
workers, unison/demo/); ``unison serve`` serves that model over HTTP (unison/serve/);
``unison info`` says what this install runs here (the C fast paths or pure Python); ``unison
bench`` runs the benchmark of a source checkout (``benchmarks/run.py``, which is not part of
the package)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def bench_script() -> Path | None:
    """The checkout's benchmarks/run.py next to this package's src/, if there is one: an
    installed wheel has none."""
    candidate = Path(__file__).resolve().parents[2] / "benchmarks" / "run.py"
    return candidate if candidate.is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unison", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="all-MiniLM-L6-v2 split across workers: semantic search, speed, parity",
        description="Embed sentences with all-MiniLM-L6-v2 split tensor-parallel across tp "
                    "workers (times dp replicas), search them, and compare speed and answers "
                    "with sentence-transformers in one process.")
    from unison.demo.app import add_arguments

    add_arguments(demo)
    serve = sub.add_parser(
        "serve", help="serve the model over HTTP: OpenAI-compatible /v1/embeddings",
        description="Serve all-MiniLM-L6-v2, split across unison workers, over HTTP "
                    "(Starlette on uvicorn; the 'serve' extra): POST /v1/embeddings as OpenAI's "
                    "API, GET /health, GET /metrics. Requests are batched dynamically.")
    from unison.serve.server import add_arguments as add_serve_arguments

    add_serve_arguments(serve)
    worker = sub.add_parser(
        "worker", help="join a session as one of its workers, over TCP",
        description="Join a unison session whose controller listens at HOST:PORT (a "
                    "Session with a TCP launcher: see docs/cluster.md). The session's secret "
                    "comes from the UNISON_SECRET environment variable, in hex. The worker "
                    "ends when the controller closes the session or goes away.")
    worker.add_argument("--connect", required=True, metavar="HOST:PORT",
                        help="the controller's address")
    worker.add_argument("--rank", type=int, default=-1,
                        help="the rank to take (default: the first free one)")
    worker.add_argument("--timeout", type=float, default=60.0,
                        help="seconds to keep trying to reach the controller (default 60; inf: "
                             "for ever)")
    worker.add_argument("--unix", default="", metavar="NAME",
                        help="the session's Unix socket, for a worker on the controller's "
                             "host (its launcher passes it): it then uses shared memory")
    worker.add_argument("--die-with-parent", action="store_true",
                        help="also stop when the process that started this one ends "
                             "(for launchers: a Ray actor, a job step)")
    worker.add_argument("--nice", type=int, default=None, metavar="N",
                        help="run at niceness N (default: as started); a launcher passes "
                             "its controller's, since Ray starts workers at 15")
    sub.add_parser("info", help="what this install runs here: the C fast paths or pure "
                                "Python, and why; the extras installed",
                   description="Print unison's version, the machine, whether the C fast paths "
                               "are in use (and why not), and the extras installed.")
    sub.add_parser("bench", add_help=False,
                   help="run benchmarks/run.py of a source checkout (its --help lists the flags)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from unison.demo.app import main as demo_main

        return demo_main(args)
    if args.command == "serve":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from unison.serve.server import main as serve_main

        return serve_main(args)
    if args.command == "worker":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from unison.worker import connect_main

        return connect_main(args.connect, args.rank, args.timeout, args.die_with_parent,
                            args.unix, args.nice)
    if args.command == "info":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from unison.info import main as info_main

        return info_main()
    script = bench_script()
    if script is None:
        print("unison bench: the benchmark is not installed with the package; it lives in "
              "benchmarks/run.py of a source checkout (git clone the repository, then "
              "python benchmarks/run.py --help)", file=sys.stderr)
        return 2
    # Replace this process, so that Ctrl-C and the exit status are the benchmark's own.
    os.execv(sys.executable, [sys.executable, str(script), *rest])
