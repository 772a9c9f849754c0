"""``python -m unison demo`` (or ``bench``): the same as the ``unison`` command."""

from __future__ import annotations

import sys

from unison.cli import main

if __name__ == "__main__":
    sys.exit(main())
