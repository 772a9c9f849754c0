"""Timeouts, checked once: every wait in unison turns its ``timeout=`` into a deadline here."""

from __future__ import annotations

import math
import numbers
import time

__all__ = ["deadline", "seconds"]


def seconds(value: object, name: str, none: bool = True) -> float:
    """A number of seconds, checked: a real number, not NaN, not negative (inf is allowed,
    and so is an int past a float's range, such as 10**400: it is inf). ``none``: whether
    the caller takes None (the message says so only then)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        also = " or None" if none else ""
        raise TypeError(f"{name} must be a number of seconds{also}, got {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:  # an int past a float's range: longer than any wait, as inf
        seconds = -math.inf if value < 0 else math.inf
    if math.isnan(seconds) or seconds < 0:
        also = " or None" if none else ""
        raise ValueError(f"{name} must be a number of seconds >= 0{also}, got {value!r}")
    return seconds


def deadline(timeout: object, name: str = "timeout") -> float | None:
    """The monotonic time at which a wait of ``timeout`` seconds ends (None: never; inf is
    the same as None)."""
    if timeout is None:
        return None
    secs = seconds(timeout, name)
    return None if secs == math.inf else time.monotonic() + secs
