"""A class called on the workers (``sess.call(Model, args)``) against a function that makes
the same object, round trip by round trip (issue 9: the function path).

    python benchmarks/class_call.py [--workers 2] [--blocks 8] [--seconds 0.3] [--channel shm]

Each round is ``sess.call(X, 1)`` then ``sess.sync()``, X the class ``harness.tasks.Small``
or the function ``harness.tasks.make_small``, in alternating blocks; prints each block's
median and the ratio of the medians. The session's function cache keeps a class that pickle
sends by name, as it keeps a function; before it did, each call of a class sent it again
(a DEFINE ahead of every CALL).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import unison
from harness.measure import block_medians
from harness.report import blocks_args
from harness.tasks import Small, make_small


def round_trip(sess: unison.Session, fn: Callable[[int], object]) -> Callable[[], None]:
    """One round: ``call(fn, 1)`` then ``sync()``."""
    def go() -> None:
        sess.call(fn, 1)
        sess.sync()

    return go


def main() -> None:
    args = blocks_args(__doc__, 8)
    with unison.Session(args.workers, channel=args.channel) as sess:
        medians = block_medians({"class": round_trip(sess, Small),
                                 "function": round_trip(sess, make_small)},
                                args.blocks, args.seconds)
    for name, got in medians.items():
        print(f"{name:8}: {' '.join(f'{m:.1f}' for m in got)} | median "
              f"{statistics.median(got):.1f} µs")
    ratio = statistics.median(medians["class"]) / statistics.median(medians["function"])
    print(f"class / function: {ratio:.2f}x")


if __name__ == "__main__":
    main()
