"""Run the unison benchmark: ``python benchmarks/run.py --help``.

The code lives in ``unison.bench`` (also reachable as ``unison bench`` and
``python -m unison.bench``); this file is the entry point that the docs name.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from unison.bench import main
except ImportError:  # a checkout without unison installed: use its src/ directly
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from unison.bench import main

if __name__ == "__main__":
    sys.exit(main())
