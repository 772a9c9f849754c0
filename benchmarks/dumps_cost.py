"""What ``protocol.dumps`` costs for a few non-plain values, in this process (issue 9,
fortieth pass: each reducer run once). Plain values go by marshal and never come here.

    python benchmarks/dumps_cost.py [--number 20000] [--repeat 7]

``PYTHONPATH=<tree>/src`` picks the revision of unison, so two revisions can be run one
after the other. Prints the best of ``repeat`` runs of ``number`` pickles each, µs a pickle.
"""

from __future__ import annotations

import argparse
import datetime
import fractions
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

from harness.report import header
from unison import protocol

VALUES = {
    "a Fraction (a small importable object)": fractions.Fraction(3, 7),
    "a reply tuple holding one": (5, 0, fractions.Fraction(3, 7)),
    "1,000 float64 (in band)": np.ones(1000),
    "100 datetime.date": [datetime.date(2020, 1, 1 + i % 28) for i in range(100)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    print(header(sys.argv[1:]))
    for name, value in VALUES.items():
        def one(value: object = value) -> None:
            protocol.dumps(value, [])

        best = min(timeit.repeat(one, number=args.number, repeat=args.repeat))
        print(f"{name:40s} {best / args.number * 1e6:8.2f} µs")


if __name__ == "__main__":
    main()
