"""``sess.call(f, x)`` then ``sess.sync()`` by the kind of argument x, block by block (issue
9: the function path; thirty-fifth pass).

    python benchmarks/ref_args.py [--workers 2] [--blocks 6] [--seconds 0.3] [--channel shm]

The rows: no argument (``noop``, the base), a plain int, a tuple of ints (a shape: plain
values inside the CALL as an int, since the thirty-seventh pass), a numpy scalar (inside the
CALL as its dtype and bytes, likewise), a Ref (its id rides inside the
CALL, and the worker puts its own object there), the int and the Ref by keyword (``x=``),
and the same Ref inside a list (pickled, the Ref as a lookup that the worker's unpickle
makes: how every Ref argument went before).
``f`` is ``harness.tasks.make_small``, which takes any one argument. Prints each row's block
medians (µs a round) and its ratio to the no-argument round's.
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
from harness.tasks import make_small, noop


def main() -> None:
    args = blocks_args(__doc__, 6)
    with unison.Session(args.workers, channel=args.channel) as sess:
        ref = sess.put(1)
        kinds: dict[str, tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = {
            "no argument": (noop, (), {}), "an int": (make_small, (1,), {}),
            "a tuple": (make_small, ((1024, 1024),), {}),
            "a numpy scalar": (make_small, (np.float32(0.5),), {}),
            "an int by keyword": (make_small, (), {"x": 1}),
            "a Ref": (make_small, (ref,), {}), "a Ref by keyword": (make_small, (), {"x": ref}),
            "a Ref in a list": (make_small, ([ref],), {})}

        def round_trip(fn: Callable[..., Any], call_args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Callable[[], None]:
            def go() -> None:
                sess.call(fn, *call_args, **kwargs)
                sess.sync()

            return go

        medians = block_medians({k: round_trip(*v) for k, v in kinds.items()},
                                args.blocks, args.seconds)
    print_block_ratios(medians, "no argument", "no argument's")


if __name__ == "__main__":
    main()
