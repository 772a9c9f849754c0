"""Fuzzing the TCP channel's decoders (issue 12; issue 14 asks for every decoder that reads
bytes another process wrote): whatever an authenticated worker or an unauthenticated peer
sends, the controller takes only whole, valid frames, reports a broken stream once, never
unpickles a byte of it, never raises and never hangs.

A real TcpChannel listens on loopback and real sockets send the bytes hypothesis makes;
each example is one connection (a stream that went out of step is closed for good).
The worker's end is fuzzed for the other risk, a fast path: one read that brings exactly one
call is parsed in place, so streams cut anywhere must still come out whole and in order.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unison.channel.tcp import _HEAD, _MAGIC, TcpChannel, TcpWorkerChannel, dial

pytestmark = pytest.mark.timeout(300)

SECRET = b"s" * 32
FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def channel() -> Iterator[TcpChannel]:
    logging.getLogger("unison.tcp").setLevel(logging.CRITICAL)  # thousands of drops, on purpose
    chan = TcpChannel(1, "127.0.0.1", "127.0.0.1", SECRET)
    yield chan
    chan.close()
    logging.getLogger("unison.tcp").setLevel(logging.NOTSET)


def _join(chan: TcpChannel) -> tuple[socket.socket, int]:
    """A worker that passed the handshake: rank 0 of a fresh connection."""
    chan._peers[0] = None
    chan._claimed.clear()
    chan.offer(0, pickle.dumps("init"))
    sock, incarnation, init, _, _ = dial(chan.address, SECRET, 0, timeout=10)
    assert pickle.loads(init) == "init"
    deadline = time.monotonic() + 10
    while chan._peers[0] is None:
        assert time.monotonic() < deadline, "the handshake did not finish"
        time.sleep(0.001)
    return sock, incarnation


def _collect(chan: TcpChannel, until: float) -> list[bytes | None]:
    got: list[bytes | None] = []
    while time.monotonic() < until:
        for rank, data in chan.recv(0.05):
            assert rank == 0
            assert data is None or isinstance(data, bytes)
            got.append(data)
            if data is None:
                return got
    return got


def _frame(inc: int, payload: bytes) -> bytes:
    return _HEAD.pack(_MAGIC, inc, len(payload), 0) + payload


@FUZZ
@given(payloads=st.lists(st.binary(max_size=300), max_size=4), tail=st.binary(max_size=300))
def test_whole_frames_come_through_then_garbage_ends_the_stream(channel, payloads, tail):
    sock, inc = _join(channel)
    with sock:
        sock.sendall(b"".join(_frame(inc, p) for p in payloads) + tail)
        sock.shutdown(socket.SHUT_WR)
        got = _collect(channel, time.monotonic() + 10)
    assert got[-1] is None, "the stream's end was not reported"
    # the valid frames, in order, bytes as sent; the random tail (a truncated frame, or one
    # with a bad header: neither names this connection's magic and incarnation) adds none
    assert got[:-1] == payloads


@FUZZ
@given(magic=st.integers(0, 2**32 - 1), inc_delta=st.integers(-3, 3),
       size=st.integers(0, 2**64 - 1), count=st.integers(0, 2**32 - 1))
def test_a_bad_header_is_never_taken_and_never_waited_on(channel, magic, inc_delta, size, count):
    sock, inc = _join(channel)
    header = struct.pack("<IQQI", magic, (inc + inc_delta) % 2**64, size, count)
    valid = magic == _MAGIC and inc_delta == 0 and size <= 64 and count == 0
    with sock:
        sock.sendall(header + b"\0" * min(size, 64))
        if not valid:  # the controller drops us at the header, before any payload comes
            got = _collect(channel, time.monotonic() + 10)
            assert got == [None]
            assert "malformed" in channel.where(0) or "out-of-band" in channel.where(0)
            return
        sock.shutdown(socket.SHUT_WR)
        got = _collect(channel, time.monotonic() + 10)
    assert got == [b"\0" * size, None]


@FUZZ
@given(data=st.binary(max_size=600))
def test_unauthenticated_bytes_never_join(channel, data):
    channel._peers[0] = None
    channel._claimed.clear()
    channel.offer(0, pickle.dumps("init"))
    host, _, port = channel.address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(10)
            while sock.recv(4096):  # the controller's challenge, then its hang-up
                pass
        except OSError:
            pass  # reset by the controller: dropped
    assert channel._peers[0] is None


def test_the_handshake_threads_do_not_pile_up(channel):
    before = threading.active_count()
    socks = []
    for _ in range(20):  # peers that connect and say nothing keep a thread for 5 s at most
        host, _, port = channel.address.rpartition(":")
        socks.append(socket.create_connection((host, int(port)), timeout=10))
    for s in socks:
        s.close()
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before


@FUZZ
@given(payloads=st.lists(st.one_of(st.none(), st.binary(min_size=1, max_size=3000)),
                         max_size=6),
       cuts=st.lists(st.integers(0, 8000), max_size=5))
def test_a_worker_reads_frames_however_the_stream_is_cut(payloads, cuts):
    """The worker's end: calls sent back to back, heartbeats among them (None), the stream cut
    anywhere into separate sends: every call comes out whole and in order (a read that brings
    exactly one, more than one, or part of one), heartbeats never; then the end."""
    inc = 7
    stream = b"".join(_HEAD.pack(_MAGIC, inc, 0, 0) if p is None else _frame(inc, p)
                      for p in payloads)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
    worker = TcpWorkerChannel(conn, inc)

    def send() -> None:
        with sender:
            for lo, hi in itertools.pairwise(bounds):
                sender.sendall(stream[lo:hi])
                time.sleep(0.001)  # most often a separate segment, read on its own

    thread = threading.Thread(target=send)
    thread.start()
    try:
        got = []
        while (item := worker.recv()) is not None:
            data, bufs = item
            assert bufs == []
            got.append(bytes(data))
    finally:
        thread.join()
        worker.close()
    assert got == [p for p in payloads if p is not None]
