"""Run the unison benchmark: ``python benchmarks/run.py --help`` lists the flags.

unison against the usual ways to drive N local worker processes (one Pipe per worker,
multiprocessing queues, a Manager mailbox; Ray and mpi4py where installed) and against
``floor``, the smallest pure-Python shared-memory ring doing the same round trip (the floor
unison is read against, "unison / floor"), every workload side by side in one run. The
harness lives in ``benchmarks/harness/`` (what each workload measures: ``harness/measure.py``);
the allreduce comparison in ``benchmarks/collectives.py``.

This file is also the user's script of the ``dispatch_script_fn`` workload: ``script_fn``
below is a function of ``__main__``, which unison sends by value, as it would any function
of a script that drives a session.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import unison  # noqa: F401
except ImportError:  # a checkout without unison installed: use its src/ directly
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from harness.cli import main

SCALE = 3
"""A global of the script that ``script_fn`` reads, as script functions usually do."""


def script_fn(x: int, y: float) -> float:
    """The ``dispatch_script_fn`` workload's call: a function of the script, two arguments."""
    return x * SCALE + y


if __name__ == "__main__":
    sys.exit(main(script=(script_fn, (7, 0.5))))
