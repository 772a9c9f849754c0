"""Whether an exception came from a signal: Ctrl-C, or any Python signal handler (a SIGALRM
handler's time limit, a SIGTERM handler's sys.exit). Such an exception lands between any two
bytecodes, so inside a send or a wait the session cannot know whether its message went or
a reply was read: it closes, as for Ctrl-C. Exceptions the session raises itself (a
``timeout=``'s TimeoutError) keep their own handling."""

from __future__ import annotations

import functools
import os
import signal
import types

__all__ = ["raised_by_a_signal"]

_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
"""The unison package's folder: no signal handler's code lies there."""


def raised_by_a_signal(exc: BaseException) -> bool:
    """Whether ``exc`` is a KeyboardInterrupt, or came out of a Python signal handler
    installed now (its traceback passes through the handler's code)."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    outside = []  # the frames not of unison's own code: a handler is one of them
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith(_OURS):
            outside.append(code)
        tb = tb.tb_next
    if not outside:  # raised by unison itself (a timeout, a worker's error): no lookup of
        return False  # every signal's handler (about 0.1 ms)
    codes = _handler_codes()
    return any(code in codes for code in outside)


def _handler_codes() -> set[types.CodeType]:
    """The code objects of the Python signal handlers installed now."""
    codes = set()
    for sig in signal.valid_signals():
        try:
            code = _code(signal.getsignal(sig))
        except (ValueError, OSError):  # a signal this platform will not report on
            continue
        if code is not None:
            codes.add(code)
    return codes


def _code(handler: object) -> types.CodeType | None:
    """The code a handler runs: a function's, a bound method's or functools.partial's
    function's, or a callable object's ``__call__``; None for SIG_DFL, SIG_IGN, C code."""
    while True:
        if isinstance(handler, functools.partial):
            handler = handler.func
        elif isinstance(handler, types.MethodType):
            handler = handler.__func__
        else:
            break
    code = getattr(handler, "__code__", None)
    if code is None and callable(handler) and not isinstance(handler, type):
        code = getattr(type(handler).__call__, "__code__", None)  # a callable object's
    return code if isinstance(code, types.CodeType) else None
