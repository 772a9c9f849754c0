"""One long input to the demo's tokenizer (what ``unison serve`` runs on each request's
texts): its peak memory and time, in a fresh process per kind of text.

    python benchmarks/long_input.py [--mb 8] [--kinds words punct one cjk hex cyrillic emoji
                                           marks deseret]
    PYTHONPATH=/tmp/wt/src python benchmarks/long_input.py ...   # another revision's tree

Before the forty-fifth pass of issue 9 the tokenizer took the whole text and then cut it
at 256 tokens; since, it takes a start of it that ends on a word boundary (an ASCII space or
mark; since the forty-sixth, also one beyond ASCII, or a CJK ideograph) and fills them. The
size is of the text in UTF-8, as in a request's body.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.report import header

TEXTS = {
    "words": "sentence number 7 ",  # repeated to the size asked for
    "punct": "a.",
    "one": "a",  # one word: no boundary to cut at (since the forty-sixth pass: its middle
    # is dropped, a word of over 100 letters being one [UNK] however long)
    "cjk": "中文文本没有空格",  # no space, no ASCII mark
    "hex": "0123456789abcdef",  # one word, as "one"
    "cyrillic": "слово",  # one word of letters beyond ASCII (tokenized whole before the 46th)
    "emoji": "\U0001f600",  # one word of emoji (since the forty-seventh pass, as "one")
    "marks": "e\u0301",  # one word of letters with combining marks (the normalizer drops them)
    "deseret": "\U00010400",  # one word of a script beyond the BMP
    "spaces": " ",  # no token at all (since the forty-eighth pass: the run's middle dropped)
    "controls": "\x01",  # dropped by the normalizer: no token either (as "spaces")
    "near": "x" * 1023 + " ",  # words a letter short of a run: each scanned once (48th pass)
}

_CHILD = """
import resource, sys, time
from unison.demo.config import model_dir
from unison.demo.tokenize import Tokenizer
tok = Tokenizer(model_dir(), 256)
unit, size = sys.argv[1], int(sys.argv[2])
text = unit * (size // len(unit.encode()))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
ids = tok.encode([text])[0]
took = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(len(ids), f"{took:.3f}", peak // 1024, (peak - base) // 1024)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=8.0)
    parser.add_argument("--kinds", nargs="+", choices=sorted(TEXTS), default=list(TEXTS))
    args = parser.parse_args()
    print(header(sys.argv[1:]))
    size = int(args.mb * 1_000_000)
    for kind in args.kinds:
        out = subprocess.run([sys.executable, "-c", _CHILD, TEXTS[kind], str(size)],
                             capture_output=True, text=True, check=True, env=dict(os.environ))
        ids, took, peak, grew = out.stdout.split()
        print(f"{kind}: {args.mb:g} MB of {TEXTS[kind]!r} repeated: {ids} ids in {took} s, "
              f"peak RSS {peak} MB ({grew} MB for the text)")


if __name__ == "__main__":
    main()
