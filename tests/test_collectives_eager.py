"""send is eager: it returns once the data is copied out, whatever its size, so two ranks
can both send before they receive. Large messages spill into memfds of their own, which the
sender closes once they are taken (or can never be taken): nothing piles up, nothing is left
in /dev/shm."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import pytest

import unison

QUICK = 60.0  # a deadlock shows up as TimeoutError instead of stalling the run


def payload(rank: int, nbytes: int) -> np.ndarray:
    return np.frombuffer(hashlib.shake_128(b"rank %d" % rank).digest(nbytes), np.uint8)


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def swap(nbytes: int) -> str:
    """Both ranks send first, then receive: only an eager send lets this finish."""
    r = unison.rank()
    peer = 1 - r
    unison.send(payload(r, nbytes), peer)
    return digest(unison.recv(peer))


def burst(count: int, nbytes: int) -> list[int]:
    """Every rank sends ``count`` messages to every other rank, then receives them all."""
    r, n = unison.rank(), unison.world_size()
    for i in range(count):
        for j in range(n):
            if j != r:
                unison.send(np.full(nbytes, i % 251, np.uint8), j)
    got = []
    for j in range(n):
        if j != r:
            got += [int(unison.recv(j)[0]) for _ in range(count)]
    return got


def unreceived(nbytes: int) -> None:
    """Rank 0 sends a large message that nobody receives in this call."""
    if unison.rank() == 0:
        unison.send(np.zeros(nbytes, np.uint8), 1)


def spill_fds() -> int:
    """How many message spills this worker holds open."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "unison-send" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return count


@pytest.mark.parametrize("nbytes", [8 << 20, 64 << 20], ids=["8MiB", "64MiB"])
def test_both_ranks_send_large_messages_before_receiving(shared, nbytes):
    sess = shared(2)
    got = sess.run(swap, nbytes, timeout=QUICK)
    assert got == [digest(payload(1, nbytes)), digest(payload(0, nbytes))]
    assert sess.run(spill_fds, timeout=QUICK) == [0, 0]  # taken: closed by the sender


@pytest.mark.parametrize("nbytes", [16, 1 << 20], ids=["inline", "spilled"])
def test_many_messages_each_way_before_any_receive(shared, nbytes):
    sess = shared(3)
    got = sess.run(burst, 20, nbytes, timeout=QUICK)
    for r in range(3):
        assert got[r] == list(range(20)) * 2
    assert sess.run(spill_fds, timeout=QUICK) == [0, 0, 0]


def test_a_message_never_received_is_released(shared):
    sess = shared(2)
    for _ in range(3):
        sess.run(unreceived, 4 << 20, timeout=QUICK)
    # the receiver left each call without taking it: the sender closes it by the next call
    assert sess.run(spill_fds, timeout=QUICK) == [0, 0]
    assert sess.run(swap, 1 << 20, timeout=QUICK) == [digest(payload(1, 1 << 20)),
                                                      digest(payload(0, 1 << 20))]


def stale_then_exchange(count: int) -> Any:
    """More messages than the ring holds, none received in their call, then a fresh
    exchange: stale places are reused instead of blocking the sender."""
    if unison.rank() == 0:
        for i in range(count):
            unison.send(i, 1)
    return None


def test_stale_messages_do_not_block_later_sends(shared):
    from unison.collective.shm import RING

    sess = shared(2)
    sess.run(stale_then_exchange, RING, timeout=QUICK)
    sess.run(stale_then_exchange, RING, timeout=QUICK)
    got = sess.run(burst, RING, 8, timeout=QUICK)  # as many as the ring holds
    assert got == [list(range(RING)), list(range(RING))]
