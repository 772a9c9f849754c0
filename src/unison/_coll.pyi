"""Types of a small allreduce's C steps (_coll.c)."""

from collections.abc import Sequence
from typing import Any

RECORD: tuple[int, int, int, int, int, int, int]

class Reducer:
    def __init__(self, buffer: Any, rank: int, records: Sequence[int], slots: Sequence[int],
                 slot_size: int, owner: Any = None) -> None: ...
    def end(self, call_id: int, /) -> None: ...
    def allreduce(self, a: Any, out: Any, code: int, which: int, gen: int, desc: int, sig: int,
                  ranks: tuple[int, ...], stage: int, pauses: int, budget_ns: int,
                  long_ns: int) -> int: ...
