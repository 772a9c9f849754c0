"""Out-of-band buffers: large payloads in one shared, sparse memory file (a memfd).

    controller                                          worker r
    place(buffers) -> block b (copy once, or none when   view(desc) -> mmap of b's pages
      the buffer is a shared array already in the arena)   (copy-on-write; shared arrays:
                                                            the controller's own pages)
    sent[b][r] += 1 before the message is published      done[b][r] += 1 when that mmap
                                                          is garbage (weakref.finalize)
    b is reused only when sent == done for every worker and the controller holds no array
    on it: a worker's numpy array keeps its block alive for as long as the array lives.

The file is anonymous (memfd): it has a name for /proc (``unison-<session>-arena``) but no
path, so nothing can outlive the processes that map it, even after SIGKILL. Pages are
only backed when touched; blocks that are no longer needed keep their pages for reuse up to
a cache limit, and past it are given back to the kernel (MADV_REMOVE).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from typing import Any

PAGE = mmap.ALLOCATIONGRANULARITY
MIN_BLOCK = 1 << 16
SLOTS = 1 << 16
WRITABLE = 1 << 32  # descriptor flag: a shared array, writable by the workers
_KEEP = 1 << 29  # bytes of freed blocks kept backed for reuse


def counters_size(num_workers: int) -> int:
    """Bytes of the per-(block, worker) sent/done counters in the control segment."""
    return SLOTS * num_workers * 8


class _Block:
    __slots__ = ("backed", "cap", "held", "offset", "slot")

    def __init__(self, offset: int, cap: int, slot: int) -> None:
        self.offset, self.cap, self.slot = offset, cap, slot
        self.held = False  # the controller holds an array on it (sess.empty)
        self.backed = False  # free, with its pages kept for reuse (counted in _kept)


class Arena:
    """The controller's side: allocates blocks and places buffers. Used under the send lock,
    except ``shared_array``'s finalizer, which only flips a flag."""

    def __init__(self, name: str, num_workers: int, counters: memoryview, size: int) -> None:
        self.fd = os.memfd_create(f"{name}-arena", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.size = size
        self._n = num_workers
        self._counters = counters  # cast('I'): [slot*n*2 + 2*r] sent, [... + 1] done
        self._map = mmap.mmap(self.fd, size)
        self._top = 0
        self._slots = 0
        self._free: dict[int, list[_Block]] = {}
        self._busy: list[_Block] = []
        self._kept = 0
        self._shared: dict[int, tuple[int, _Block]] = {}  # address -> (end, block)
        self._lock = threading.Lock()

    def place(self, buffers: list[Any], ranks: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """Put each buffer (a PickleBuffer) in the arena for ``ranks``: descriptors
        (offset, length, slot | flags) that a worker turns back into memory."""
        out = []
        for pb in buffers:
            mv = pb.raw()
            n = mv.nbytes
            found = self._find_shared(mv)
            if found is not None:
                block, offset = found
                flags = WRITABLE
            else:
                block = self.alloc(n)
                offset, flags = block.offset, 0
                self._map[offset : offset + n] = mv
            self._count(block.slot, ranks)
            out.append((offset, n, block.slot | flags))
        return out

    def place_bytes(self, data: bytes, ranks: tuple[int, ...]) -> tuple[int, int, int]:
        """A whole message too large for the ring."""
        block = self.alloc(len(data))
        self._map[block.offset : block.offset + len(data)] = data
        self._count(block.slot, ranks)
        return (block.offset, len(data), block.slot)

    def shared_array(self, nbytes: int) -> mmap.mmap:
        """Memory in the arena that the controller writes and the workers see without a copy."""
        block = self.alloc(nbytes)
        block.held = True
        mm = mmap.mmap(self.fd, block.cap, offset=block.offset)
        probe = ctypes.c_char.from_buffer(mm)
        addr = ctypes.addressof(probe)
        del probe
        with self._lock:
            self._shared[addr] = (addr + block.cap, block)
        weakref.finalize(mm, self._unshare, addr, block)
        return mm

    def _unshare(self, addr: int, block: _Block) -> None:
        with self._lock:
            self._shared.pop(addr, None)
        block.held = False

    def _find_shared(self, mv: memoryview) -> tuple[_Block, int] | None:
        if not self._shared:
            return None
        interface = getattr(mv.obj, "__array_interface__", None)
        if interface is None:
            return None
        addr = interface["data"][0]
        with self._lock:
            for start, (end, block) in self._shared.items():
                if start <= addr and addr + mv.nbytes <= end:
                    return block, block.offset + (addr - start)
        return None

    def _count(self, slot: int, ranks: tuple[int, ...]) -> None:
        c, base = self._counters, slot * self._n * 2
        for r in ranks:
            i = base + 2 * r
            c[i] = (c[i] + 1) & 0xFFFFFFFF

    def _in_use(self, block: _Block) -> bool:
        if block.held:
            return True
        c, base = self._counters, block.slot * self._n * 2
        return any(c[base + 2 * r] != c[base + 2 * r + 1] for r in range(self._n))

    def alloc(self, nbytes: int) -> _Block:
        cap = max(MIN_BLOCK, 1 << (max(nbytes, 1) - 1).bit_length())
        free = self._free.get(cap)
        if not free:
            self._reclaim()
            free = self._free.get(cap)
        if free:
            block = free.pop()
            if block.backed:
                block.backed = False
                self._kept -= block.cap
        else:
            if self._top + cap > self.size or self._slots >= SLOTS:
                self._reclaim(give_back_all=True)
                raise MemoryError(
                    f"the session's shared memory is full ({self.size >> 20} MiB, as much as "
                    f"this machine's memory, in {self._slots} blocks): free the Refs that "
                    "hold large arrays (ref.free(), or drop them), or send smaller ones"
                )
            block = _Block(self._top, cap, self._slots)
            self._top += cap
            self._slots += 1
        self._busy.append(block)
        return block

    def _reclaim(self, give_back_all: bool = False) -> None:
        still = []
        for block in self._busy:
            if self._in_use(block):
                still.append(block)
                continue
            self._free.setdefault(block.cap, []).append(block)
            if give_back_all or self._kept + block.cap > _KEEP:
                self._map.madvise(mmap.MADV_REMOVE, block.offset, block.cap)
            else:
                block.backed = True
                self._kept += block.cap
        self._busy = still

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            pass  # a view the user still holds keeps it mapped until it goes
        os.close(self.fd)


class ArenaReader:
    """A worker's side: turns descriptors into memory, and counts when that memory is gone."""

    def __init__(self, fd: int, rank: int, num_workers: int, counters: memoryview) -> None:
        self.fd = fd
        self._counters = counters
        self._base = 2 * rank + 1
        self._stride = 2 * num_workers
        self._lock = threading.Lock()  # finalizers may run on any of the worker's threads

    def view(self, desc: tuple[int, int, int]) -> memoryview:
        offset, length, slot_flags = desc
        start = offset - offset % PAGE
        # a shared array maps the controller's pages; anything else is copy-on-write, so a
        # worker may change what it got without the others (or the block) seeing it
        flags = mmap.MAP_SHARED if slot_flags & WRITABLE else mmap.MAP_PRIVATE
        mm = mmap.mmap(self.fd, offset + length - start, flags=flags,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
        weakref.finalize(mm, self._done, (slot_flags & 0xFFFFFFFF) * self._stride + self._base)
        return memoryview(mm)[offset - start : offset - start + length]

    def _done(self, i: int) -> None:
        with self._lock:
            c = self._counters
            c[i] = (c[i] + 1) & 0xFFFFFFFF
