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
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import join_tcp
from unison.channel.tcp import (
    _HEAD,
    _MAGIC,
    _REPLY,
    _REPLY_MAGIC,
    _REPORT_MAGIC,
    MAX_FRAME,
    TcpChannel,
    TcpWorkerChannel,
)

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
    chan._why.clear()  # (where() says why the first stream of a rank ended)
    chan._sent[0] = chan._progress[0] = 0
    return join_tcp(chan, SECRET)


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
    """A worker's reply (its progress word: 0)."""
    return _REPLY.pack(_REPLY_MAGIC, inc, len(payload), 0) + payload


def _command(inc: int, payload: bytes) -> bytes:
    """A controller's command, as a worker reads it."""
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
@given(magic=st.one_of(st.sampled_from([_REPLY_MAGIC, _REPORT_MAGIC, _MAGIC]),
                       st.integers(0, 2**32 - 1)),
       inc_delta=st.integers(-3, 3), size=st.integers(0, 2**64 - 1),
       progress=st.integers(0, 2**64 - 1))
def test_a_bad_header_is_never_taken_and_never_waited_on(channel, magic, inc_delta, size,
                                                         progress):
    sock, inc = _join(channel)
    header = _REPLY.pack(magic, (inc + inc_delta) % 2**64, size, progress)
    reply = magic == _REPLY_MAGIC and size <= MAX_FRAME
    report = magic == _REPORT_MAGIC and size == 0
    with sock:
        sock.sendall(header + b"\0" * min(size, 64))
        if inc_delta or not (reply or report):  # dropped at the header, before any payload
            got = _collect(channel, time.monotonic() + 10)
            assert got == [None]
            assert "malformed" in channel.where(0)
            if magic == _MAGIC:  # an older unison's reply: say so
                assert "another version" in channel.where(0)
            return
        sock.shutdown(socket.SHUT_WR)  # a reply over 64 bytes ends cut short: never taken
        got = _collect(channel, time.monotonic() + 10)
    assert got == ([b"\0" * size] if reply and size <= 64 else []) + [None]
    assert channel._progress[0] == (progress if size <= 64 else 0)  # a whole one's word


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
    exactly one, more than one, or part of one), heartbeats never; then the end. What it
    sends back meanwhile is progress reports, each counting calls it took, never more."""
    inc = 7
    stream = b"".join(_HEAD.pack(_MAGIC, inc, 0, 0) if p is None else _command(inc, p)
                      for p in payloads)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
    worker = TcpWorkerChannel(conn, inc)

    back = bytearray()

    def send() -> None:
        for lo, hi in itertools.pairwise(bounds):
            sender.sendall(stream[lo:hi])
            time.sleep(0.001)  # most often a separate segment, read on its own
        sender.shutdown(socket.SHUT_WR)  # (as the controller closes: then it reads on)
        while chunk := sender.recv(4096):
            back.extend(chunk)

    thread = threading.Thread(target=send)
    thread.start()
    try:
        got = []
        while (item := worker.recv()) is not None:
            data, bufs = item
            assert bufs == []
            got.append(bytes(data))
    finally:
        worker.close()
        thread.join()
        sender.close()
    assert got == [p for p in payloads if p is not None]
    assert len(back) % _REPLY.size == 0
    told = [_REPLY.unpack_from(back, at) for at in range(0, len(back), _REPLY.size)]
    assert all(m == _REPORT_MAGIC and i == inc and n == 0 for m, i, n, _ in told)
    words = [w for *_, w in told]
    assert words == sorted(set(words)) and all(w <= 2 * len(got) for w in words)
