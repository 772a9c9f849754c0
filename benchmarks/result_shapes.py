"""``sess.run(f)`` by the shape of f's result, block by block (issue 9, thirty-fourth pass),
then ``ref.gather()`` of a Ref holding such a result (thirty-fifth pass).

    python benchmarks/result_shapes.py [--workers 2] [--blocks 6] [--seconds 0.3] [--channel shm]

A run whose result is a plain value (None, bool, int, float, str, bytes), or a small
tuple, list or dict of them (nested ones too), goes back by marshal, and on shared memory
the controller reads and decodes every worker's reply in one step; any other result (an
object here) is pickled and decoded reply by reply. A small numpy array or scalar goes by
marshal as its dtype, shape and bytes (thirty-seventh pass). A GET's value goes back the
same way.
Prints each row's block medians (µs a run, or a gather) and its ratio to the int's run.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import unison
from harness.measure import block_medians
from harness.report import blocks_args, print_block_ratios
from harness.tasks import result_of

SHAPES = ("int", "pair", "list3", "nested", "dict", "array", "float64", "object")
FETCHED = ("int", "pair", "array", "object")


def main() -> None:
    args = blocks_args(__doc__, 6)
    with unison.Session(args.workers, channel=args.channel) as sess:
        kinds: dict[str, Callable[[], object]] = {
            shape: functools.partial(sess.run, result_of, shape) for shape in SHAPES}
        for shape in FETCHED:  # the same values, kept on the workers and fetched
            kinds[f"gather {shape}"] = sess.call(result_of, shape).gather
        medians = block_medians(kinds, args.blocks, args.seconds)
    print_block_ratios(medians, "int", "the int's")


if __name__ == "__main__":
    main()
