"""Out-of-band buffers: large payloads in one shared, sparse memory file (a memfd).

    writer (the controller for commands,                reader (a worker for commands,
            a worker for its replies)                           the controller for replies)
    place(buffers) -> block b (copy once, or none when   view(desc) -> a mapping of b's pages
      the buffer is a shared array already in the arena)   (commands: copy-on-write; shared
                                                            arrays and replies: shared)
    sent[b][r] += 1 before the message is published      done[b][r] += 1 when that mapping
                                                          is garbage (weakref.finalize)
    b is reused only when sent == done for every reader and the writer holds no array on
    it: a reader's numpy array keeps its block alive for as long as the array lives.

The counters live at the start of the file itself, so a reader's finalizer can count even
after its session has closed (the file lives as long as any mapping of it). The file is
anonymous (memfd): it has a name for /proc (``unison-<session>-...``) but no path, so nothing
can outlive the processes that map it, even after SIGKILL. Pages are only backed when
touched; blocks that are no longer needed keep their pages for reuse up to a cache limit,
and past it are given back to the kernel (MADV_REMOVE).

A reader maps blocks with libc's mmap through ctypes rather than ``mmap.mmap``, which
would hold a duplicate file descriptor per mapping: a program that keeps a thousand
fetched arrays must not run out of descriptors.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import mmap
import os
import pickle
import platform
import resource
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from unison import _native

PAGE = mmap.ALLOCATIONGRANULARITY
MIN_BLOCK = 1 << 16
SLOTS = 1 << 16
WRITABLE = 1 << 32  # descriptor flag: a shared array, writable by the workers
KEEP = 1 << 29  # bytes of freed blocks kept backed for reuse


def counters_size(num_readers: int) -> int:
    """Bytes of the per-(block, reader) sent/done counters at the start of the file."""
    size = SLOTS * num_readers * 8
    return (size + PAGE - 1) // PAGE * PAGE


def default_size() -> int:
    """An arena as large as the machine's memory (it is sparse: only used pages count)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 1 << 34
    return max(1 << 30, min(ram, 1 << 40))


def create_file(name: str, num_readers: int, size: int | None = None) -> int:
    """A new arena file: its fd (close-on-exec; pass it to the other side explicitly)."""
    return sealed_memfd(name, counters_size(num_readers) + (size or default_size()))


def sealed_memfd(name: str, size: int) -> int:
    """A memfd of ``size`` bytes that nobody can shrink: a process that maps shared memory
    another one could truncate would take a SIGBUS at its next touch of the lost pages."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Block:
    __slots__ = ("backed", "cap", "held", "offset", "slot")

    def __init__(self, offset: int, cap: int, slot: int) -> None:
        self.offset, self.cap, self.slot = offset, cap, slot
        self.held = False  # the writer holds an array on it (sess.empty)
        self.backed = False  # free, with its pages kept for reuse (counted in _kept)


class Arena:
    """The writer's side: allocates blocks and places buffers. Used under the writer's send
    lock, except ``shared_array``'s finalizer, which only flips a flag.

    ``fd``: an arena file made by ``create_file`` (the arena then owns it), or None for a
    new one named ``name``."""

    def __init__(self, name: str, num_readers: int, fd: int | None = None,
                 keep: int = KEEP, commands: bool = False) -> None:
        self.fd = create_file(name, num_readers) if fd is None else fd
        try:  # a file of our own is closed if this fails (a Ctrl-C, no memory to map)
            self.size = os.fstat(self.fd).st_size
            self._map = mmap.mmap(self.fd, self.size)
        except BaseException:
            if fd is None:
                os.close(self.fd)
            raise
        self._commands = commands
        """A session's arena for its commands: the one whose shared arrays its workers write."""
        self._n = num_readers
        self._keep = keep
        base = counters_size(num_readers)
        self._counters = memoryview(self._map)[:base].cast("I")  # [slot*n*2 + 2r] sent, +1 done
        self._base = self._top = base
        self._slots = 0
        self._spare: list[int] = []  # slots of blocks given back below _top (_lower_top)
        self._free: dict[int, list[_Block]] = {}
        self._busy: list[_Block] = []
        self._kept = 0
        # (start address, end, its mapping, block) of each shared array. Replaced whole, and
        # only here, never by a finalizer: so readers need no lock, and a mapping that is
        # gone (its weak reference dead) is skipped, as its address may be reused.
        self._shared: tuple[tuple[int, int, weakref.ref[Any], _Block], ...] = ()
        self._lock = threading.Lock()

    def place(self, buffers: Sequence[Any], ranks: Sequence[int]) -> list[tuple[int, int, int]]:
        """Put each buffer (a PickleBuffer, or any contiguous buffer) in the arena for
        ``ranks``: descriptors (offset, length, slot | flags) that a reader turns back into
        memory. All or nothing: on MemoryError (the arena is full), or ValueError (a buffer
        in another session's shared array), nothing is counted."""
        views = [_raw(b) for b in buffers]
        spots: list[tuple[_Block, int, int]] = []
        try:
            for mv in views:
                found = self._find_shared(mv)
                if found is not None:
                    spots.append((found[0], found[1], WRITABLE))
                else:
                    self._check_not_anothers(mv)
                    block = self.alloc(mv.nbytes)
                    # not counted until below: held, or the next buffer's alloc would
                    # reclaim it (sent == done) and place that buffer on the same block
                    block.held = True
                    spots.append((block, block.offset, 0))
        except BaseException:  # full (MemoryError), or another session's array
            for block, _, flags in spots:  # never counted: they go back at the next reclaim
                if not flags:
                    block.held = False
                    self._busy.remove(block)
                    self._free.setdefault(block.cap, []).append(block)
            raise
        out = []
        for mv, (block, offset, flags) in zip(views, spots):
            if not flags:
                self._map[offset : offset + mv.nbytes] = mv
                block.held = False
            self._count(block.slot, ranks)
            out.append((offset, mv.nbytes, block.slot | flags))
        return out

    def place_shared(self, buffer: Any, ranks: Sequence[int]) -> tuple[int, int, int] | None:
        """The descriptor of ``buffer`` if it lies in a shared array (counted as sent to
        ``ranks``), else None: the pipe channel sends only those by reference."""
        mv = _raw(buffer)
        found = self._find_shared(mv)
        if found is None:
            self._check_not_anothers(mv)
            return None
        block, offset = found
        self._count(block.slot, ranks)
        return (offset, mv.nbytes, block.slot | WRITABLE)

    def count_sent(self, descs: Sequence[tuple[int, int, int]], ranks: Sequence[int]) -> None:
        """Count descriptors (from ``place_shared(buffer, ())``) as sent to ``ranks``."""
        self._adjust(descs, ranks, 1)

    def unplace(self, descs: Sequence[tuple[int, int, int]], ranks: Sequence[int]) -> None:
        """Take back descriptors that were placed but will never be sent."""
        self._adjust(descs, ranks, -1)

    def _adjust(self, descs: Sequence[tuple[int, int, int]], ranks: Sequence[int],
                delta: int) -> None:
        c = self._counters
        for _, _, slot_flags in descs:
            base = (slot_flags & 0xFFFFFFFF) * self._n * 2
            for r in ranks:
                i = base + 2 * r
                c[i] = (c[i] + delta) & 0xFFFFFFFF

    def place_bytes(self, data: bytes | memoryview, ranks: Sequence[int]) -> tuple[int, int, int]:
        """A whole message too large for its ring."""
        return self.place([data], ranks)[0]

    def shared_array(self, nbytes: int) -> memoryview:
        """Memory in the arena that the controller writes and the workers see without a copy.
        Mapped by libc's mmap, not ``mmap.mmap``, which would hold a duplicate of the file's
        fd for each array: a thousand arrays would take a usual ``ulimit -n``."""
        block = self.alloc(nbytes)
        block.held = True
        try:
            mv = map_block(self.fd, block.offset, block.cap, True, (_unhold, block))
        except BaseException:  # (ENOMEM: an address-space limit) the block is free again
            block.held = False
            raise
        mapping: Any = mv.obj  # what the arrays over it keep alive; unmapped when it goes
        addr = ctypes.addressof(mapping) + block.offset % PAGE
        entry = (addr, addr + block.cap, weakref.ref(mapping), block)
        with self._lock:
            self._shared = (*(e for e in self._shared if e[2]() is not None), entry)
        _register((addr, addr + block.cap, weakref.ref(mapping, _forget_dead)))
        return mv

    def _check_not_anothers(self, mv: memoryview) -> None:
        """Raise where a command's buffer lies in another session's shared array: it would
        go as a copy, and the workers' writes to it would be lost in silence."""
        if self._commands and is_shared(mv):
            raise anothers_error()

    def _find_shared(self, mv: memoryview) -> tuple[_Block, int] | None:
        if not self._shared:
            return None
        addr = _address(mv)
        if addr is None:
            return None
        for start, end, alive, block in self._shared:
            if start <= addr and addr + mv.nbytes <= end and alive() is not None:
                return block, block.offset + (addr - start)
        return None

    def _count(self, slot: int, ranks: Sequence[int]) -> None:
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
            if not self._fits(cap):
                self._reclaim(give_back_all=True)
                self._lower_top()
                if not self._fits(cap):
                    raise self._full(nbytes, cap)
            if self._spare:
                slot = self._spare.pop()
            else:
                slot = self._slots
                self._slots += 1
            block = _Block(self._top, cap, slot)
            self._top += cap
        self._busy.append(block)
        return block

    def _fits(self, cap: int) -> bool:
        """Whether a new block of ``cap`` bytes fits above ``_top``, with a slot for it."""
        return self._top + cap <= self.size and (bool(self._spare) or self._slots < SLOTS)

    def _lower_top(self) -> None:
        """Give back the free blocks that end at ``_top``, so that their room may take a
        block of another size (a freed block stays in its size class). Their slots are
        reused: a free block's counters are equal (sent == done), so no reader counts on
        them any more."""
        ends = {b.offset + b.cap: b for free in self._free.values() for b in free}
        while (block := ends.pop(self._top, None)) is not None:
            self._free[block.cap].remove(block)
            if block.backed:
                self._map.madvise(mmap.MADV_REMOVE, block.offset, block.cap)
                block.backed = False
                self._kept -= block.cap
            self._top = block.offset
            self._spare.append(block.slot)

    def _full(self, nbytes: int, cap: int) -> MemoryError:
        room = self.size - self._base
        if cap > room:
            return MemoryError(
                f"{nbytes:,} bytes need a block of {cap >> 20} MiB (blocks come in powers of "
                f"two), more than the session's shared memory holds ({room >> 20} MiB, as "
                "much as this machine's memory) even with nothing else in it: send smaller "
                "arrays (several puts of slices, several sess.empty), or make the data on "
                "the workers")
        held = sum(b.cap for b in self._busy)
        return MemoryError(
            f"the session's shared memory is full ({self.size >> 20} MiB, as much as this "
            f"machine's memory; {held >> 20} MiB of it in {len(self._busy)} blocks in use): "
            "free the Refs that hold large arrays (ref.free(), or drop them), or send "
            "smaller ones, and drop fetched results and sess.empty arrays that are no "
            "longer needed")

    def _reclaim(self, give_back_all: bool = False) -> None:
        still = []
        for block in self._busy:
            if self._in_use(block):
                still.append(block)
                continue
            self._free.setdefault(block.cap, []).append(block)
            if give_back_all or self._kept + block.cap > self._keep:
                self._map.madvise(mmap.MADV_REMOVE, block.offset, block.cap)
            else:
                block.backed = True
                self._kept += block.cap
        self._busy = still

    def close(self) -> None:
        self._counters.release()
        try:
            self._map.close()
        except BufferError:
            pass  # a view the user still holds keeps it mapped until it goes
        os.close(self.fd)


class Malformed(OSError):
    """Bytes another process wrote (an arena descriptor, a ring entry) that break the
    format: nothing of them is used. An OSError, as a broken stream is everywhere in
    unison (the pipe worker's reader ends on one, the TCP channel raises one)."""


class ArenaReader:
    """A reader's side: turns descriptors into memory, and counts when that memory is gone.

    ``shared``: map every block shared (replies, which the reader owns until it drops
    them), rather than copy-on-write for all but the writer's shared arrays (commands, so
    that each worker may change what it got without the others seeing it)."""

    def __init__(self, fd: int, rank: int, num_readers: int, shared: bool = False) -> None:
        self.fd = fd
        # no mmap.mmap: it would hold a duplicate of ``fd`` for as long as the reader lives
        self._counters = map_block(fd, 0, counters_size(num_readers), shared=True).cast("I")
        self._low = counters_size(num_readers)  # where blocks may lie: [_low, _size)
        self._size = os.fstat(fd).st_size
        self._base = 2 * rank + 1
        self._stride = 2 * num_readers
        self._shared = shared
        self._lock = threading.Lock()  # finalizers may run on any of the reader's threads
        self._wholes: dict[bool, _Whole | None] = {}  # the file mapped once: shared, private

    def view(self, desc: tuple[int, int, int]) -> memoryview:
        offset, length, slot_flags = desc
        slot = slot_flags & 0xFFFFFFFF
        # the other process wrote it: a block past the file's end would be mapped fine and
        # then kill us with SIGBUS at the first touch, a slot past the counters is an
        # IndexError in a finalizer. O(1) checks, before anything is mapped or counted.
        if (slot >= SLOTS or slot_flags >> 33 or offset < self._low or length < 0
                or length > self._size - offset):
            raise Malformed(
                f"an arena descriptor that points outside the arena: offset {offset}, "
                f"{length} bytes, slot and flags {slot_flags:#x} (blocks lie in bytes "
                f"{self._low}..{self._size}, slots below {SLOTS})")
        shared = self._shared or bool(slot_flags & WRITABLE)
        done = slot * self._stride + self._base
        if not length:
            self._done(done)
            return memoryview(bytearray())
        try:
            whole = self._whole(shared) if length <= WHOLE_VIEW_MAX else None
            if whole is not None:
                return whole.view(offset, length, (self._done, done))
            # counted only once unmapped: munmap completes every load and store this process
            # made there, so the writer never reuses a block a late access could still touch
            # (x86 keeps them in order anyway; ARM could let a store land after the count)
            return map_block(self.fd, offset, length, shared, then=(self._done, done))
        except BaseException:
            self._done(done)  # never mapped: the block may go back at once
            raise

    def _whole(self, shared: bool) -> _Whole | None:
        """The whole file mapped once, shared or private, made at the first view; None
        where that should not be (``whole_mapping_fits``; private: a kernel whose
        /proc/self/pagemap does not tell written pages, ``written_pages_seen``) or cannot
        be: then each view maps its own block, as before (docs/benchmarks.md, issue 9,
        forty-fourth pass)."""
        if shared in self._wholes:
            return self._wholes[shared]
        whole = None
        try:
            if whole_mapping_fits(self._size, shared) and (shared or written_pages_seen()):
                whole = _Whole(self.fd, self._size, shared)
        except OSError:
            pass
        self._wholes[shared] = whole
        return whole

    def views(self, descs: Sequence[tuple[int, int, int]]) -> list[memoryview]:
        """``view`` of each of a message's descriptors, or ``Unmapped`` where one cannot be
        mapped (an address space the worker's code capped with RLIMIT_AS, or full to
        vm.max_map_count): every block is then counted done (those mapped as their views
        go), so the writer gets them back, and the message's command fails, not the
        receiver. A descriptor that breaks the format still raises Malformed."""
        got: list[memoryview] = []
        for i, desc in enumerate(descs):
            try:
                got.append(self.view(desc))
            except Malformed:
                raise
            except (OSError, MemoryError) as exc:  # (view counted this one done)
                for rest in descs[i + 1:]:
                    self.view((rest[0], 0, rest[2]))  # nothing mapped: counted done
                return Unmapped(sum(d[1] for d in descs), exc)
        return got

    def _done(self, i: int) -> None:
        with self._lock:
            c = self._counters
            c[i] = (c[i] + 1) & 0xFFFFFFFF


class Unmapped(list[memoryview]):
    """A message's buffers that could not be mapped, as ``ArenaReader.views`` hands them on:
    the unpickling that asks for them (the call's arguments, the put's value) raises why,
    as the command's own error, and the worker goes on. Before, the mapping's OSError left
    the worker's loop and the session closed, where a MemoryError in the function itself
    was only that call's error."""

    def __init__(self, nbytes: int, exc: BaseException) -> None:
        super().__init__()
        self.nbytes = nbytes
        self.why = f"{type(exc).__name__}: {exc}"

    def __iter__(self) -> Iterator[memoryview]:
        raise MemoryError(
            f"this worker could not map the message's {self.nbytes:,} bytes of buffers "
            f"(shared memory): {self.why}. Its address space is full: an RLIMIT_AS set by "
            "the worker's code (resource.setrlimit), or too many mappings for the kernel's "
            "vm.max_map_count; raise the limit, or send smaller values")


# -- mappings without a file descriptor each ----------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munlock.restype = ctypes.c_int
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if platform.machine() in (
    "x86_64", "aarch64") and sys.platform == "linux" else 0)
"""Python 3.11's mmap lacks the name. Without it, a private writable mapping as large as
the machine's memory is refused by the kernel's overcommit check (it would be charged as
if every page were written)."""


def _mmap(fd: int, offset: int, size: int, flags: int,
          prot: int = mmap.PROT_READ | mmap.PROT_WRITE) -> int:
    """libc's mmap of ``size`` bytes of ``fd`` at ``offset`` (fd -1: anonymous): the
    address; OSError saying why where it fails."""
    addr = _libc.mmap(None, size, prot, flags, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mapping {size} bytes of shared memory: {os.strerror(err)}")
    return int(addr)


def _at_garbage(obj: object, fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)`` once ``obj`` is garbage, but never at the interpreter's exit: there
    ``weakref.finalize`` runs every finalizer left, and an unmap (or a private view's pages
    dropped) would pull the memory from under arrays still alive, which an atexit handler
    registered earlier, a daemon thread or a ``__del__`` at teardown still reads (SIGSEGV).
    The process's end unmaps everything; a count of done it skips no longer matters."""
    weakref.finalize(obj, fn, *args).atexit = False


def map_block(fd: int, offset: int, length: int, shared: bool,
              then: tuple[Callable[[Any], None], Any] | None = None) -> memoryview:
    """``length`` bytes of ``fd`` at ``offset``, mapped read-write; unmapped when the
    returned view's ``obj`` (and every view or array over it) is garbage, and only then
    ``then[0](then[1])`` is called."""
    start = offset - offset % PAGE
    size = offset - start + length
    addr = _mmap(fd, start, size, mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE)
    holder = (ctypes.c_ubyte * size).from_address(addr)
    _at_garbage(holder, _unmap, addr, size, then, os.getpid())
    return memoryview(holder).cast("B")[offset - start :]


WHOLE_VIEW_MAX = KEEP
"""Views larger than this map their own block, as the writer gives such blocks' pages back
as soon as they are free (past KEEP): no reuse would find them mapped, and the page tables
a whole mapping keeps for the span until it goes (0.2% of it) would be paid for nothing."""
WHOLE_SPAN_MAX = 1 << 45
"""Address space (32 TiB, a quarter of x86-64's) that a process's whole mappings may take,
each as large as the machine's memory: past it, views map their blocks one by one."""
_whole_span = 0
_span_lock = threading.Lock()


def whole_mapping_fits(size: int, shared: bool) -> bool:
    """Whether a reader may map a whole arena file of ``size`` bytes once: on x86 (elsewhere
    only the ``munmap`` before a view's count orders its last stores before the writer's
    reuse), under no address-space limit (the mapping would take room the process's own
    allocations count on), with new mappings not locked (``mlockall(MCL_FUTURE)`` would
    fill the whole file in at once), within WHOLE_SPAN_MAX, and, copy-on-write, unless
    overcommit is strict (``vm.overcommit_memory=2`` ignores MAP_NORESERVE and would charge
    the whole size to the machine's commit)."""
    if not _native.ordered_memory() or not _NORESERVE:
        return False
    if resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY:
        return False
    if not shared and _overcommit_strict():
        return False
    return _whole_span + size <= WHOLE_SPAN_MAX and not _new_mappings_locked()


def _overcommit_strict() -> bool:
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip() == "2"
    except OSError:
        return True


def _new_mappings_locked() -> bool:
    """Whether a new mapping is locked (and so filled in) as it is made: an untouched page
    of a fresh anonymous mapping is in memory."""
    try:
        addr = _mmap(-1, 0, PAGE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, mmap.PROT_READ)
    except OSError:
        return True
    try:
        vec = ctypes.c_ubyte(0)
        if _libc.mincore(addr, PAGE, ctypes.byref(vec)) != 0:
            return True
        return bool(vec.value & 1)
    finally:
        _libc.munmap(addr, PAGE)


def _count_span(size: int) -> None:
    """Count ``size`` bytes of whole mappings made (negative: unmapped)."""
    global _whole_span
    with _span_lock:
        _whole_span += size


class _Whole:
    """A whole arena file mapped once, for a reader's views: each view is a window into it.
    A block the writer reuses then finds its pages mapped here already, where a mapping per
    view took a page fault for each 64 KiB of it every time (a 64 MiB reply: 10.6 of the
    fetch's 19.7 ms; docs/benchmarks.md, issue 9, forty-fourth pass). The pages stay the
    writer's: those it gives back (MADV_REMOVE) leave this mapping too.

    Private (copy-on-write: a command's arrays in a worker): a page the reader wrote is its
    own copy from then on, which would hide what the writer puts there next; so as a view
    goes, if /proc/self/pagemap shows any of its pages written, the view's pages are
    dropped (MADV_DONTNEED), and the next view faults them in afresh from the file.

    Unmapped once the reader and every view are gone."""

    def __init__(self, fd: int, size: int, shared: bool) -> None:
        flags = (mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE) | _NORESERVE
        addr = _mmap(fd, 0, size, flags)
        self.addr, self.shared = addr, shared
        _count_span(size)
        _at_garbage(self, _unmap_whole, addr, size)

    def view(self, offset: int, length: int,
             then: tuple[Callable[[Any], None], Any]) -> memoryview:
        """``length`` bytes at ``offset``; ``then[0](then[1])`` once the view is garbage."""
        holder = (ctypes.c_ubyte * length).from_address(self.addr + offset)
        holder._whole = self  # type: ignore[attr-defined]  # the mapping outlives each view
        _at_garbage(holder, _view_gone, self, offset, length, then, os.getpid())
        return memoryview(holder).cast("B")

    def forget_writes(self, offset: int, length: int) -> None:
        """Drop the pages of [offset, offset + length) if the reader wrote any of them (or
        pagemap cannot be read: then always), so that they show the file again. Pages the
        worker's code locked (``mlock``) are unlocked first: a locked page is not dropped.
        Raises where they stay: the view's block is then never counted done (the writer
        never reuses it), rather than its next message read stale."""
        start = self.addr + offset - offset % PAGE
        size = (self.addr + offset + length - start + PAGE - 1) // PAGE * PAGE
        if _written(start, size) is False:
            return
        if _libc.madvise(start, size, mmap.MADV_DONTNEED) != 0:
            _libc.munlock(start, size)
            if _libc.madvise(start, size, mmap.MADV_DONTNEED) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) of a private view")


def _unmap_whole(addr: int, size: int) -> None:
    _libc.munmap(addr, size)
    _count_span(-size)


def _view_gone(whole: _Whole, offset: int, length: int,
               then: tuple[Callable[[Any], None], Any], owner: int) -> None:
    """A view of a whole mapping is gone: in the process that made it (see ``_unmap``),
    drop its written pages (private), then count it done, after a fence (where no munmap
    completes this process's loads and stores first, an ARM core could let a late store to
    the block land after the count, and the writer's reuse)."""
    if os.getpid() == owner:
        if not whole.shared:
            whole.forget_writes(offset, length)
        _native.fence()
        then[0](then[1])


# -- which pages of a private mapping this process wrote ---------------------------------------

_PM_ENTRY = 8  # /proc/self/pagemap: a 64-bit word per page; its top byte holds
# bit 63 present, 62 swapped, 61 file page (or shared anonymous). A private mapping's page
# that was never written is a file page, or not there; one written is present without the
# file bit, or swapped (only anonymous pages swap through a private mapping's entries).
_UNWRITTEN = (0b000, 0b101)
_WRITTEN_TABLE = bytes(0 if (b >> 5) in _UNWRITTEN else 1 for b in range(256))


def _written(addr: int, size: int) -> bool | None:
    """Whether this process wrote (copied on write) any page of [addr, addr + size) of a
    private file mapping; None where /proc/self/pagemap cannot be read."""
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        at, end = addr // PAGE * _PM_ENTRY, (addr + size) // PAGE * _PM_ENTRY
        while at < end:  # 64 KiB of entries (256 MiB of pages) at a time
            want = min(end - at, 1 << 16)
            words = os.pread(fd, want, at)
            if len(words) != want:
                return None
            if 1 in words[7::_PM_ENTRY].translate(_WRITTEN_TABLE):
                return True
            at += want
        return False
    except OSError:
        return None
    finally:
        os.close(fd)


@functools.cache
def written_pages_seen() -> bool:
    """Whether this kernel's /proc/self/pagemap tells a private mapping's written pages
    from its file pages (as Linux has since 3.5), tried once a process on a file of its
    own: the private whole mapping relies on it, and where it does not, a view's page
    written once would hand stale data to the block's next message."""
    fd = os.memfd_create("unison-pagemap-probe", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 3 * PAGE)
        probe = _Whole(fd, 3 * PAGE, shared=False)
    except OSError:
        os.close(fd)
        return False
    try:
        os.pwrite(fd, b"f", PAGE)  # the file's own bytes, seen through the mapping
        base = probe.addr
        read = ctypes.c_char.from_address(base + PAGE).value  # page 1: read, a file page
        ctypes.c_char.from_address(base + 2 * PAGE).value = b"w"  # page 2: written, a copy
        os.pwrite(fd, b"n", 2 * PAGE)  # the file moves on; the copy does not show it
        seen = (read == b"f" and _written(base, PAGE) is False  # page 0: not there
                and _written(base + PAGE, PAGE) is False and _written(base + 2 * PAGE, PAGE)
                is True and ctypes.c_char.from_address(base + 2 * PAGE).value == b"w")
        if seen:
            probe.forget_writes(2 * PAGE, PAGE)
            seen = (_written(base + 2 * PAGE, PAGE) is False
                    and ctypes.c_char.from_address(base + 2 * PAGE).value == b"n")
        return seen
    finally:
        del probe
        os.close(fd)


def _unmap(addr: int, size: int, then: tuple[Callable[[Any], None], Any] | None,
           owner: int) -> None:
    """Unmap a block; count it done (``then``) only in the process that mapped it. A
    forked child inherits the mapping and its finalizer: had it counted the block when it
    dropped its copy (or at its exit), the writer would have reused the block under the
    parent's array, which then changed with no error."""
    _libc.munmap(addr, size)
    if then is not None and os.getpid() == owner:
        then[0](then[1])


# -- where the writer's shared arrays are (any session of this process) -------------------------

_Range = tuple[int, int, "weakref.ref[Any]"]
_shared_ranges: tuple[_Range, ...] = ()
"""(start, end, mapping) of every live ``shared_array`` of this process, for ``is_shared``:
replaced whole, so readers need no lock; a dead mapping is skipped until it is dropped.
Empty again once they are all gone, so that pickling arguments skips the look for them
(protocol.dumps)."""
_ranges_lock = threading.Lock()


def _register(entry: _Range) -> None:
    global _shared_ranges
    with _ranges_lock:
        _shared_ranges = (*(r for r in _shared_ranges if r[2]() is not None), entry)


def _forget_dead(_: object) -> None:
    """A shared array's mapping died: drop the dead ones now, where the lock is free (a
    collection inside ``_register`` must not wait for itself: then its next call does)."""
    global _shared_ranges
    if _ranges_lock.acquire(blocking=False):
        try:
            _shared_ranges = tuple(r for r in _shared_ranges if r[2]() is not None)
        finally:
            _ranges_lock.release()


def anothers_error() -> ValueError:
    """What a session raises for a buffer in another session's shared array (a session
    with no arena of its own, TCP, has none of its own)."""
    return ValueError(
        "an array passed to this session lies in the shared memory of another "
        "session (made by that session's empty()): this session's workers would "
        "write to a copy, and their writes would be lost. Pass it to the session "
        "that made it, or copy it first (np.array(a)) to send its values")


def _unhold(block: _Block) -> None:
    block.held = False


def _raw(buffer: Any) -> memoryview:
    if isinstance(buffer, pickle.PickleBuffer):
        return buffer.raw()
    return memoryview(buffer).cast("B")


def _address(mv: memoryview) -> int | None:
    interface = getattr(mv.obj, "__array_interface__", None)
    if interface is None:
        return None
    addr: int = interface["data"][0]
    return addr


def is_shared(mv: memoryview) -> bool:
    """Whether ``mv`` (a PickleBuffer's raw view) lies in a shared array of some session:
    such a buffer must travel by reference whatever its size, or writes would be lost."""
    if not _shared_ranges:
        return False
    addr = _address(mv)
    return addr is not None and lies_in_shared(addr, mv.nbytes)


def touches_shared(addr: int, nbytes: int) -> bool:
    """Whether any of the ``nbytes`` at ``addr`` lies in a shared array."""
    end = addr + nbytes
    return any(addr < stop and start < end and alive() is not None
               for start, stop, alive in _shared_ranges)


def lies_in_shared(addr: int, nbytes: int) -> bool:
    """``is_shared`` of the ``nbytes`` at ``addr`` (an array's memory, read from its
    ``__array_interface__``: no view needed, which some dtypes refuse)."""
    end = addr + nbytes
    return any(start <= addr and end <= stop and alive() is not None
               for start, stop, alive in _shared_ranges)
