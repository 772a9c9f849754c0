"""The ``unison`` command: ``unison demo`` runs the main job, ``unison bench`` the benchmark."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unison", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="split a matrix multiply across workers and check it")
    demo.add_argument("--workers", type=int, default=2)
    demo.add_argument("--size", type=int, default=512)
    sub.add_parser("bench", help="the dispatch benchmark against the baselines (see --help)",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from unison.demo import main as demo_main

        return demo_main(args.workers, args.size)
    from unison.bench import main as bench_main

    return int(bench_main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
