"""The optional C extensions (setup.py): one that was built at install, unless the user asked
for pure Python with UNISON_PURE=1. Each caller keeps a pure-Python path with the same
protocol, so a missing extension only costs speed."""

from __future__ import annotations

import functools
import hashlib
import importlib
import io
import os
import platform
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

_YES, _NO = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def pure_asked() -> bool:
    """Whether UNISON_PURE asks for pure Python. "0", "false" or "" do not: a run meant to
    measure the C path must never measure the fallback in silence. Another value raises."""
    value = os.environ.get("UNISON_PURE", "").strip().lower()
    if value in _YES:
        return True
    if value in _NO:
        return False
    raise ValueError(
        f"UNISON_PURE={os.environ['UNISON_PURE']!r} is neither on ({', '.join(_YES)}) nor "
        f"off ({', '.join(repr(v) for v in _NO)}): set it to 1 for pure Python, or unset it")


TSO_CPUS = ("x86_64", "AMD64", "i686", "i386")
"""CPUs with x86's total store order: stores become visible in program order, loads are not
reordered with loads. The shared-memory protocols' Python steps rely on it."""


def ordered_memory() -> bool:
    """Whether this CPU orders memory as x86 does (TSO_CPUS). Elsewhere (ARM, POWER) a
    plain store through a memoryview may become visible before an earlier one, so a reader
    could see a position or a generation before the bytes it covers: a wrong result with no
    error. The shared-memory channel, collectives and cancellation board are refused there."""
    return platform.machine() in TSO_CPUS


def unordered_why(what: str) -> str:
    """Why ``what`` is refused on this CPU, for its error message."""
    return (f"{what} relies on x86's total store order, and this CPU is "
            f"{platform.machine() or 'unknown'}: its stores may become visible out of order, "
            "so a reader could take data that is not all written yet")


def load(name: str, layout: Mapping[str, object] | None = None) -> Any:
    """``unison.<name>`` (e.g. "_ring"), or None where UNISON_PURE asks for pure Python, it
    was not built, or a build is there but unfit: it does not import, it was built from
    another source than the one beside it, or its constants differ from ``layout`` (by
    name: the caller's values of what the C code hard-codes). An unfit build warns, once,
    saying how to rebuild; where no build exists the fallback is silent (``unison info``
    says it: ``unused``)."""
    if pure_asked():
        unused[name] = "as UNISON_PURE asks"
        return None
    module, exc = _import(name)
    if module is None:
        builds = _builds(name)
        if not builds:
            unused[name] = ("it was not built (no C compiler when unison was installed?). "
                            + _REBUILD)
            return None
        why = (f"unison.{name} does not import ({exc}), although {', '.join(builds)} "
               f"lies in {Path(__file__).parent}. {_REBUILD}")
        _warn_once(why)
        unused[name] = why
        return None
    why = _stale(module) or _mismatch(module, layout or {})
    if why:
        _warn_once(why)
        unused[name] = why
        return None
    return module  # (a load without a layout never clears what one with it found)


unused: dict[str, str] = {}
"""Why a load of each extension here gave pure Python (``unison info``)."""


def built(name: str) -> bool:
    """Whether ``unison.<name>`` imports and matches the C file beside it, whatever
    UNISON_PURE says here: for tests whose own workers or children run it."""
    module, _ = _import(name)
    return module is not None and not _stale(module)


def _import(name: str) -> tuple[Any, ImportError | None]:
    """``unison.<name>``, or None and why not."""
    try:
        return importlib.import_module(f"unison.{name}"), None
    except ImportError as exc:
        return None, exc


_REBUILD = ("Rebuild it: `pip install -e .` in a checkout (or `python setup.py build_ext "
            "--inplace`); an installed copy, `pip install --force-reinstall --no-cache-dir "
            "unison` (pip's cache may hold a build made without a compiler). Until then "
            "unison uses pure Python: the same results, slower.")


def _builds(name: str) -> list[str]:
    """The files of this package that look like a build of ``name`` (for any Python)."""
    here = Path(__file__).parent
    return sorted(p.name for p in here.glob(f"{name}.*") if p.suffix in (".so", ".pyd"))


def _mismatch(module: Any, layout: Mapping[str, object]) -> str:
    """Why ``module``'s compiled constants are not ``layout``, or "". The C file's digest
    is checked only where that file lies beside the module (_stale); a wheel, or a build
    copied without it, is trusted there, and C reading another layout than Python's
    writes would misread memory with no error."""
    for key, want in layout.items():
        had = getattr(module, key, None)
        if had != want:
            return (f"{module.__name__} ({Path(module.__file__).name}) was built for another "
                    f"layout than the Python side's: its {key} is "
                    f"{'missing' if had is None else had}, the Python side's {want}. "
                    + _REBUILD)
    return ""


def source_digest(path: Path) -> str:
    """What setup.py compiles into each extension as ``SOURCE``: the start of its C file's
    sha256."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


@functools.cache  # a process loads _ring three times (channel, board, fence)
def _stale(module: Any) -> str:
    """Why ``module`` must not be used, or "". An editable install keeps its C file beside
    the built module, and a ``git pull`` changes the file but not the module: the Python
    side would then drive code of another version (a TypeError at a session's start at
    best, a misread layout at worst). A wheel carries the file it was built from, so the
    two agree; where no file is beside the module, only the layout check is left
    (_mismatch)."""
    built = Path(module.__file__)
    source = built.with_name(module.__name__.rpartition(".")[2] + ".c")
    try:
        digest = source_digest(source)
    except OSError:
        return ""
    had = getattr(module, "SOURCE", "")
    if had == digest:
        return ""
    return (f"{module.__name__} ({built.name}) was built from another {source.name} than "
            f"the one beside it (built from {had or 'an unrecorded version'}, the file is "
            f"now {digest}). " + _REBUILD)


WARNED = "UNISON_NATIVE_WARNED"
"""The environment variable in which a local launcher hands its workers the warnings above
that their controller gave (digests): they load the same build, and would repeat it, once
each; a worker says only one that differs (another build, another path). Not in the
controller's own os.environ: another program it starts must still say its own."""
_said: list[str] = []


@functools.cache  # once a process, where three modules load the same extension
def _warn_once(why: str) -> None:
    key = hashlib.sha256(why.encode()).hexdigest()[:12]
    if key in os.environ.get(WARNED, "").split():
        return
    warnings.warn(why, RuntimeWarning, stacklevel=3)
    _said.append(key)


def warned_env() -> dict[str, str]:
    """What a launcher adds to its workers' environment (``WARNED``): nothing where no
    warning was given."""
    keys = [*os.environ.get(WARNED, "").split(), *_said]
    return {WARNED: " ".join(keys)} if keys else {}


def _locked_flush() -> Callable[[], None]:
    """A full memory barrier in pure Python, as one call of a C method: a BufferedWriter's
    flush takes and releases the writer's lock (CPython's PyThread lock: a locked
    instruction each way on x86) within the call, with nothing to write. A fresh
    ``threading.Lock().acquire()`` behind a Python function cost 1,087 instructions more,
    and a pure worker's round has up to three fences (docs/benchmarks.md, "Issue 9,
    twenty-second pass"). Never held across a bytecode, so a signal's exception cannot
    leave it held, and other threads wait for the GIL, never for it."""
    return io.BufferedWriter(io.BytesIO()).flush


_ring = load("_ring")
fence: Callable[[], None] = _locked_flush() if _ring is None else _ring.fence
"""A full memory barrier (store-load ordering included): one C call where _ring was built,
else one call of a C method that takes a lock."""
