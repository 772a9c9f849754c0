"""Position arithmetic of a byte ring, shared by the shm channel's command and reply rings.

    position:  bytes written since the start; only grows (a Python int, so never overflows)
    offset:    where a position lies in the ring: pos & mask (the size is a power of two)

        lap k                          lap k+1
    |-------[entry][entry][WRAP.....]|[entry][entry]-------|
            ^read                      ^ an entry never straddles the end: the writer
                                         skips the rest of the lap, marking it WRAP

    writer: skip = ring.skip(pos, n)  -> mark WRAP at offset(pos) if skip, pos += skip
            wait until ring.fits(pos + n, slowest reader's position), write, publish pos + n
    reader: at a WRAP mark, pos = ring.next_lap(pos)

The hot paths inline ``pos & mask`` and the fast checks (a method call costs as much as the
arithmetic); everything else goes through these methods, so both rings agree on one layout.
"""

from __future__ import annotations

__all__ = ["Ring"]


class Ring:
    """A ring of ``size`` bytes (a power of two) addressed by ever-growing positions."""

    __slots__ = ("mask", "size")

    def __init__(self, size: int) -> None:
        if size <= 0 or size & (size - 1):
            raise ValueError(f"a ring's size must be a power of two, not {size}")
        self.size = size
        self.mask = size - 1

    def offset(self, pos: int) -> int:
        """Where position ``pos`` lies in the ring."""
        return pos & self.mask

    def skip(self, pos: int, n: int) -> int:
        """Bytes to skip before an entry of ``n`` bytes written at ``pos``, so that it does
        not cross the ring's end: 0 when it fits where it is."""
        off = pos & self.mask
        return self.size - off if off + n > self.size else 0

    def next_lap(self, pos: int) -> int:
        """The start of the lap after ``pos``'s: where a reader goes on at a wrap mark."""
        return (pos | self.mask) + 1

    def fits(self, end: int, read: int) -> bool:
        """Whether the writer may fill up to position ``end`` while the slowest reader is
        at ``read``: the bytes between them must not exceed the ring."""
        return end - read <= self.size
