"""Types of a small allreduce's C steps (_coll.c)."""

from collections.abc import Sequence
from typing import Any

RECORD: tuple[int, int, int, int, int, int, int]
SOURCE: str  # the start of the C file's sha256 (setup.py)

# (code, sig, desc, which, ranks, pauses, long_ns): collective/shm.py's _plan
Plan = tuple[int, int, int, int, tuple[int, ...], int, int]

class Reducer:
    last_gen: int
    def __init__(self, buffer: Any, rank: int, records: Sequence[int], slots: Sequence[int],
                 slot_size: int, owner: Any = None) -> None: ...
    def end(self, call_id: int, /) -> None: ...
    def small(self, a: Any, out: Any, plan: Plan, call: int, budget_ns: int, /) -> int: ...
    def after_meet(self, a: Any, out: Any, plan: Plan, gen: int, /) -> int: ...
    def release(self) -> None: ...
