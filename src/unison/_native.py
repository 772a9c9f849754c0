"""The optional C extensions (setup.py): one that was built at install, unless the user asked
for pure Python with UNISON_PURE=1. Each caller keeps a pure-Python path with the same
protocol, so a missing extension only costs speed."""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable
from typing import Any


def load(name: str) -> Any:
    """``unison.<name>`` (e.g. "_ring"), or None where it did not build or UNISON_PURE=1."""
    if os.environ.get("UNISON_PURE"):
        return None
    try:
        return importlib.import_module(f"unison.{name}")
    except ImportError:
        return None


def _lock_fence() -> None:
    """A full memory barrier in pure Python: taking a lock is a locked instruction on x86. A
    fresh lock, never released: an exception that a signal raises in here (Ctrl-C in the
    controller, Cancelled in a worker) must not leave a shared one held for the next fence."""
    threading.Lock().acquire()


_ring = load("_ring")
fence: Callable[[], None] = _lock_fence if _ring is None else _ring.fence
"""A full memory barrier (store-load ordering included): one C call where _ring was built."""
