"""The optional C extensions (setup.py): one that was built at install, unless the user asked
for pure Python with UNISON_PURE=1. Each caller keeps a pure-Python path with the same
protocol, so a missing extension only costs speed."""

from __future__ import annotations

import importlib
import os
from typing import Any


def load(name: str) -> Any:
    """``unison.<name>`` (e.g. "_ring"), or None where it did not build or UNISON_PURE=1."""
    if os.environ.get("UNISON_PURE"):
        return None
    try:
        return importlib.import_module(f"unison.{name}")
    except ImportError:
        return None
