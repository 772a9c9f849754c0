"""What the workers run in each workload: module functions, so every system (stdlib pickle
included) sends them by name. The script-defined function of ``dispatch_script_fn`` lives in
``benchmarks/run.py`` instead, because it has to be a function of ``__main__``."""

from __future__ import annotations

import os
from typing import Any


def noop() -> None:
    """The trivial call of the dispatch workload."""


def small_value() -> int:
    """The small result of the gather_small workload: an int that differs per worker."""
    return os.getpid()


def make_block(nbytes: int) -> Any:
    """The array a worker holds for the fetch workload: float64, every page written."""
    import numpy as np

    return np.full(nbytes // 8, float(os.getpid()), dtype=np.float64)


PAGE = 4096
"""The page size ``touch`` reads one byte of."""


def touch(value: Any) -> int:
    """Read one byte of every page of ``value``: a numpy array, or a list or tuple of them
    (anything else is left alone); the sum of the bytes read. unison hands data over as
    shared memory mapped lazily, whose page faults land on the first reader, while every
    baseline has copied the data into its own pages already. So every system's timed put and
    fetch end with this (nearly free for data already in the reader's memory): the faults
    count where they happen, inside the timing."""
    import numpy as np

    total = 0
    for a in value if isinstance(value, (list, tuple)) else (value,):
        if not isinstance(a, np.ndarray) or a.size == 0:
            continue
        if not (a.flags.c_contiguous or a.flags.f_contiguous):
            a = np.ascontiguousarray(a)  # the copy reads every element
        flat = a.ravel(order="K").view(np.uint8)  # a view: the array is contiguous
        # every PAGE-th byte, and the last: the array need not start on a page boundary
        total += int(flat[::PAGE].sum()) + int(flat[-1])
    return total


def check_block(block: Any, nbytes: int) -> None:
    """Raise unless ``block`` is what ``make_block(nbytes)`` made on some worker."""
    import numpy as np

    ok = (isinstance(block, np.ndarray) and block.dtype == np.float64
          and block.nbytes == nbytes and block[0] == block[-1] != 0)
    if not ok:
        raise RuntimeError(f"fetch returned {type(block).__name__} "
                           f"{getattr(block, 'shape', '')}: expected {nbytes} bytes of float64")


class Small:
    """A class the workers construct (``sess.call(Small, 1)``): benchmarks/class_call.py."""

    __slots__ = ("x",)

    def __init__(self, x: int = 0) -> None:
        self.x = x


def make_small(x: int = 0) -> Small:
    """The same object made by a module function, for the comparison."""
    return Small(x)


def result_of(shape: str) -> Any:
    """A result of each shape for benchmarks/result_shapes.py: plain (``int``), small
    containers of plain values (``pair``, ``list3``, ``nested``, ``dict``: marshal too), a
    small numpy array or scalar (``array``, ``float64``: marshal as protocol.ARRAY), or
    not (``object``: pickle)."""
    pid = os.getpid()
    if shape in ("array", "float64"):
        import numpy as np

        return np.full(4, pid, dtype=np.float64) if shape == "array" else np.float64(pid)
    if shape == "int":
        return pid
    if shape == "pair":
        return pid, 1.5
    if shape == "list3":
        return [pid, "x", None]
    if shape == "nested":
        return (pid, (1.5,))
    if shape == "dict":
        return {"pid": pid, "loss": 0.25}
    return Small(pid)
