"""``sess.put(x)`` then ``sess.sync()`` by the kind of x, block by block, against a call
without arguments then sync (issue 9, thirty-sixth pass).

    python benchmarks/put_values.py [--workers 2] [--blocks 6] [--seconds 0.3] [--channel shm]

A plain value (None, bool, int, float, str, bytes, or a small tuple, list or dict of them:
protocol.is_plain) rides inside a marshalled PUT, a small numpy value as its dtype, shape
and bytes (protocol.array_payload: thirty-seventh pass); any other (an object here) is
pickled, and the PUT carries its pickle. Each round drops its Ref, freed with the next message, as
the dispatch workload's call does. ``scatter ints`` sends one marshalled PUT to all the
workers, ``{rank: value}``, each keeping its own.
Prints each row's block medians (µs a round) and its ratio to the call's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

import unison
from harness.measure import block_medians
from harness.report import blocks_args, print_block_ratios
from harness.tasks import Small, noop

VALUES: dict[str, Any] = {"put int": 7, "put pair": (7, 1.5),
                          "put dict": {"a": 1, "b": [2, 3]}, "put numpy": np.float32(7),
                          "put object": Small(7)}


def main() -> None:
    args = blocks_args(__doc__, 6)
    with unison.Session(args.workers, channel=args.channel) as sess:
        def call() -> None:
            sess.call(noop)
            sess.sync()

        def put(value: Any) -> Callable[[], None]:
            def go() -> None:
                sess.put(value)
                sess.sync()

            return go

        def scatter() -> None:
            sess.scatter(list(range(args.workers)))
            sess.sync()

        kinds = {"call": call, **{k: put(v) for k, v in VALUES.items()},
                 "scatter ints": scatter}
        medians = block_medians(kinds, args.blocks, args.seconds)
    print_block_ratios(medians, "call", "the call's")


if __name__ == "__main__":
    main()
