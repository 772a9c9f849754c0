"""Types of the C fast path of the shm channel's command ring (_ring.c)."""

from collections.abc import Sequence
from typing import Any

class Sender:
    def __init__(self, buffer: Any, cmd_base: int, ring_size: int, efds: Sequence[int],
                 sleeping_indices: Sequence[int]) -> None: ...
    def publish(self, payload: bytes, rankmask: int, pos: int, limit: int) -> int: ...

class Taker:
    def __init__(self, buffer: Any, cmd_base: int, ring_size: int, rank_bit: int,
                 read_idx: int, done_idx: int, ctl_done_idx: int, done_efd: int) -> None: ...
    def take(self, pos: int) -> tuple[bytes | bool | None, int]: ...
