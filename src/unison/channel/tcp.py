"""The TCP channel: workers on other hosts, in Ray actors, or started by hand.

    controller                                         worker (``unison worker --connect``)
    listen(bind, port) <---- connect ------------------ socket
      accept thread: HMAC challenge both ways  <------> (multiprocessing.connection's)
                hello (rank wanted, pid, host, build) <-- then its WorkerSpec, its incarnation -->
    send(msg) -> frame ----------------------------->  recv(): the worker loop reads it
    recv() <- frames (each names the incarnation) <--  reply(data)

One TCP connection per worker carries everything, both ways. Before a byte of it is
unpickled, both ends prove they hold the session's secret, with multiprocessing.connection's
challenge (an HMAC over a random nonce; the secret never crosses). What is not a valid
handshake, or arrives too slowly, is logged and dropped, and the listener goes on: a port
scanner or a peer with the wrong secret never reaches the session. The traffic is not
encrypted: run it on a private network or through a tunnel (docs/cluster.md).

A command is ``[magic, incarnation, payload length, buffer count]``, the payload, then per
buffer its length and bytes. A reply is ``[magic, incarnation, payload length, progress]``
and its pickle, in band. The incarnation is a random number the controller gave that
connection: a frame that names another (a stale worker's, or garbage) is never taken for a
reply; neither is a frame with a bad magic or a length over ``MAX_FRAME``. Such a worker is
out of step for good: the channel drops it, logs why, and reports its stream ended, so
the session raises WorkerDied naming the reason. Replies also carry their request's id
(protocol), which the session checks.

The progress word is ``commands run << 1 | holds errors nobody fetched``, as on the pipe
channel; a worker about to wait, with progress it has not told, sends it alone (a report:
its own magic, no payload). So sync after a quick call reads a report instead of sending
SYNC and waiting for its answers (``settled``): one message each way where it was two
(dispatch over loopback at N=2 took 47-51 against 74-75 µs a round, docs/benchmarks.md,
"Issue 9, thirty-third pass"). Only one thread reads the connections at a time (recv for
the whole of its call), so ``settled`` looks only where none does, and lets go as soon as
a recv of another thread wants them (a yield pipe): then that sync asks. Sends read the
connections every _DRAIN_EVERY commands, so a controller that only calls takes the
reports before a worker blocks writing one.

A dead worker's connection closes (its keeper holds a copy and dies with it). A silent
death (a host powered off, a cable pulled) sends nothing, so here, and only here, where no
pidfd can tell, the controller sends a heartbeat: an empty frame to each worker every
``HEARTBEAT_S`` (the worker skips it), and looks at each connection's TCP_INFO: what it sent
unacknowledged for 1 s, or two window probes unanswered, end that worker's stream
(``_silent``): WorkerDied well within 2 s. A worker whose window stays closed while it
computes answers the probes, and lives; its host lost after the window has been closed
for T seconds is seen after the next two probes, which the kernel spaces out as the wait
grows: up to about 2T (4 minutes at most). The workers' side has the kernel's keepalive probes,
which see a silent controller within about 2 s where nothing is in flight; a worker cut off
in the middle of sending a reply ends when the kernel gives up retransmitting (minutes).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import secrets
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from unison._fdwait import FdSet, poll_fds, readable, reuse
from unison.channel import (
    Channel,
    PartialSendError,
    Reply,
    SendTimeout,
    Stall,
    WorkerChannel,
    arena,
    drain_fd,
    half_sent,
    held,
    own_error,
    receive_buffer,
    reported,
    stall,
    write_frame,
)
from unison.pacing import SPIN, cores, crowd, spin

__all__ = ["MAX_FRAME", "TcpChannel", "TcpWorkerChannel", "check_frame", "dial"]

log = logging.getLogger("unison.tcp")

_MAGIC = 0x31534E55  # b"UNS1", little-endian: a command
_HEAD = struct.Struct("<IQQI")  # magic, incarnation, payload length, buffer count
_REPLY_MAGIC = 0x32534E55  # b"UNS2": a reply
_REPORT_MAGIC = 0x50534E55  # b"UNSP": a progress report (no payload)
_REPLY = struct.Struct("<IQQQ")  # magic, incarnation, payload length, progress word
_BUF = struct.Struct("<Q")
MAX_FRAME = 1 << 32
"""The largest payload or buffer a frame may carry (bytes); larger is malformed."""
_MAX_BUFFERS = 1 << 16
_HELLO = struct.Struct("<iq")  # rank wanted (-1: any), pid; then the host name, a NUL
# and the worker's build (``build``)
_OFFER_S = 8.0
"""How long a worker that proved itself waits, in its handshake, for the session to offer
it its part (the session listens before it has made its collectives: a second with torch's)."""
_HANDSHAKE_S = 5.0
"""How long a peer has to pass the handshake before it is dropped."""
_NOT_READY = (f"the session did not get ready for its workers within {_OFFER_S:g} s of this "
              "one joining: start it again once the controller has printed its address")
_LET_GO_S = 2.0
"""How long close() waits for a thread still reading the connections to let go of them
(woken, it does at once)."""
_CHUNK = 1 << 20
_SMALL = 1 << 16  # a frame this small is joined to its head and sent in one call
_DRAIN_EVERY = 1024
"""Sends between two reads of the connections at least: a worker reports at most once per
command, so a controller that only calls, never waiting, still reads the reports before its
worker blocks writing one (and reads no command meanwhile)."""
HEARTBEAT_S = 0.25
"""How often the controller sends each worker an empty frame (see the module's docstring)."""
_SILENT_MS = 1000
"""A worker's host that has acknowledged nothing of what we sent for this long is gone
(``_silent``)."""
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_INFO = struct.Struct("=3xB20xI28xI")  # struct tcp_info: probes, unacked, last_ack_recv


def _tune(sock: socket.socket) -> None:
    """No Nagle delay on small messages; the kernel's keepalive as the heartbeat where
    nothing is in flight: a peer silent for 1 s is probed every second, and an unanswered
    probe fails the connection. Not TCP_USER_TIMEOUT: Linux fails a connection whose
    receiver keeps its window closed that long, though it answers every probe (a worker
    busy in a call while more is queued for it than the buffers hold, a controller that
    reads nothing for a while): a healthy peer was reported dead (an audit, 2026-12-06).
    The controller tells a host that is gone by ``_silent`` instead."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 1)):
        opt = getattr(socket, name, None)
        if opt is not None:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)


def _silent(sock: socket.socket) -> bool:
    """Whether the peer's host has stopped acknowledging: data in flight and no ACK for
    _SILENT_MS, or two window probes in a row unanswered (its window closed, then it went).
    A peer that keeps its window closed but answers the probes is alive: RFC 1122 keeps such
    a connection open. False where the kernel does not say (not TCP, not Linux)."""
    if _TCP_INFO is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _INFO.size)
    except OSError:
        return False  # closed meanwhile: the reader says why
    if len(info) < _INFO.size:
        return False
    probes, unacked, last_ack = _INFO.unpack(info)
    return bool(probes >= 2 or (unacked > 0 and last_ack > _SILENT_MS))


def _timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel-level timeouts on blocking reads and writes (SO_RCVTIMEO/SO_SNDTIMEO), which
    multiprocessing.connection's plain os.read/os.write honour; 0 turns them off."""
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class _Peer:
    """One worker's connection, as the controller sees it."""

    def __init__(self, rank: int, sock: socket.socket, incarnation: int, host: str,
                 pid: int) -> None:
        self.rank, self.sock, self.incarnation = rank, sock, incarnation
        self.host, self.pid = host, pid
        self.fd = sock.fileno()
        self.buf = bytearray()
        """A reply begun and not whole yet (every whole one is parsed as soon as it is read)."""
        self.open = True
        self.ended = ""
        """Why its stream ended, once it has (read while writing to it, say)."""
        self.write_lock = threading.Lock()
        """Held while a frame is written: the heartbeat never cuts into one."""
        self.owed = b""
        """The rest of a heartbeat the kernel took only part of: written before any other
        frame (under the write lock), so that none lands inside it."""

    def fileno(self) -> int:
        return self.fd


class _Drops:
    """How many dropped connections are logged: ``BURST`` at once, then one every ``EVERY``
    seconds, each saying how many went unsaid before it. One a connection made a scanner,
    or a stranger's loop, fill a log (an audit of security, issue 9, forty-seventh pass)."""

    BURST = 10
    EVERY = 10.0

    def __init__(self) -> None:
        self._lock = threading.Lock()  # (each handshake has its thread)
        self._tokens = float(self.BURST)
        self._at = time.monotonic()
        self._unsaid = 0

    def say(self) -> int | None:
        """None: say nothing of this one; else say it, and this many unsaid before it."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.BURST, self._tokens + (now - self._at) / self.EVERY)
            self._at = now
            if self._tokens < 1:
                self._unsaid += 1
                return None
            self._tokens -= 1
            more, self._unsaid = self._unsaid, 0
            return more

    @property
    def unsaid(self) -> int:
        """How many were dropped since the last word (said at the channel's close)."""
        return self._unsaid


class TcpChannel(Channel):
    """The controller's end: a listener and one connection per worker."""

    wakes_at_deaths = True  # (Channel.wakes_at_deaths)

    linger = 2.0
    """At close, how long to wait for the workers to hang up after we did (the session sets
    it from close()'s grace: 0 after a death)."""

    def __init__(self, num_workers: int, bind: str, advertise: str, secret: bytes,
                 port: int = 0, local: frozenset[int] = frozenset(),
                 on_local: Callable[[int, int], None] | None = None) -> None:
        """``local``: ranks on this host, which join over a Unix socket instead and get
        the fds their spec names (SCM_RIGHTS): their traffic then goes through shared
        memory (channel.mixed), and ``on_local(rank, pid)`` is told of each."""
        if len(secret) < 16:
            raise ValueError("the session's secret must be at least 16 bytes")
        self.n = num_workers
        self._secret = secret
        self._host = socket.gethostname()
        self._crowded = num_workers + 1 > cores()
        """Whether this host has fewer CPUs than the session's processes, were all its
        workers here: then the workers that join from here sleep at once when they wait."""
        crowd.expect(num_workers + 1)  # at most so many runnable tasks here are peers
        self._local = local
        self._on_local = on_local
        self._fds: dict[int, list[int]] = {}
        self._lifelines: list[socket.socket] = []
        """The local workers' Unix connections: their keepers watch them hang up."""
        self._specs: list[bytes | None] = [None] * num_workers
        self._peers: list[_Peer | None] = [None] * num_workers
        self._claimed: set[int] = set()
        self._lock = threading.Lock()
        self._offered = threading.Condition(self._lock)
        """Notified at each offer (and at close): a worker that joined before its part was
        offered waits for it (``_claim``)."""
        self._handshakes: dict[socket.socket, float] = {}
        """Connections in their handshake, and when it must be done (the accept loop shuts
        down those past it, and close all): a read timeout alone let a peer that sends a
        byte every few seconds hold one for minutes."""
        self._drops = _Drops()
        self.refusal = ""
        """Why the last worker that proved it holds the secret was refused ("" if none was):
        the start's timeout says it."""
        self._why: dict[int, str] = {}
        self._watch: list[int] = []
        self._closed = False
        self._rx = threading.Lock()
        """Held by whoever reads the connections (the scratch buffer, each peer's ``buf``):
        recv, for the whole call; settled; a send that waits for room. A recv that waits
        for it makes a settled let go (``_wait_rx``)."""
        self._yield_r, self._yield_w = os.pipe()
        """Written by a recv that finds the rx lock held: a settled holding it lets go."""
        for fd in (self._yield_r, self._yield_w):
            os.set_blocking(fd, False)
        self._backlog: list[tuple[int, bytes | Reply | None]] = []
        """Replies read by settled, a send's drain or a send waiting for room, for the next
        recv."""
        self._sent = [0] * num_workers
        """Per worker, the commands written to its connection (heartbeats not counted)."""
        self._unread = 0
        """Sends since the last drain (_DRAIN_EVERY)."""
        self._progress = [0] * num_workers
        """Per worker, its last progress word: commands run << 1 | whether it holds errors
        nobody fetched (``settled``)."""
        self._settle_poller: tuple[list[int], select.poll] | None = None
        self._sleep_set: FdSet | None = None
        """recv's sleep: the open connections, the wake pipe and the watch fds."""
        self._look_set: FdSet | None = None
        """pending's look: the open connections."""
        self._scratch = bytearray(_CHUNK)
        self._scratch_view = memoryview(self._scratch)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._epoll = select.epoll()
        """Every open connection and the wake pipe: readable when any is (for channel.mixed,
        whose waits sleep on shared memory's eventfd and this)."""
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self.unix = ""
        self._unix: socket.socket | None = None
        try:  # (a port in use, an address not ours: the fds made above go with the error)
            self._listener = socket.create_server((bind, port), backlog=max(16, num_workers))
            self.address = f"{advertise}:{self._listener.getsockname()[1]}"
            if local:  # abstract namespace: no file to leave behind; this host only
                self.unix = f"unison-{secrets.token_hex(8)}"
                self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._unix.bind("\0" + self.unix)
                self._unix.listen(max(16, num_workers))
        except BaseException:
            for fd in (self._yield_r, self._yield_w, self._wake_r, self._wake_w):
                os.close(fd)
            self._epoll.close()
            for sock in (getattr(self, "_listener", None), self._unix):
                if sock is not None:
                    sock.close()
            raise
        self._accepter = threading.Thread(target=self._accept_loop, name="unison-tcp-accept",
                                          daemon=True)
        self._accepter.start()
        self._stop = threading.Event()
        self._beater = threading.Thread(target=self._heartbeat, name="unison-tcp-heartbeat",
                                        daemon=True)
        self._beater.start()

    # -- joining -----------------------------------------------------------------------------

    def offer(self, rank: int, init: bytes, fds: Sequence[int] = ()) -> None:
        """What worker ``rank`` gets once it has proved it holds the secret (its pickled
        WorkerSpec, and for a local rank the fds it names). A worker may join only once its
        init is offered."""
        if fds:
            self._fds[rank] = list(fds)
        with self._offered:
            self._specs[rank] = init
            self._offered.notify_all()

    def endpoint(self, rank: int) -> tuple[dict[str, Any], list[int]]:
        spec = {"kind": "tcp", "address": self.address, "secret": self._secret.hex(),
                "rank": rank}
        if rank in self._local:
            spec["unix"] = self.unix
        return spec, []

    def wait_fd(self) -> int:
        """An fd readable while any connection has data (or a worker joined)."""
        return self._epoll.fileno()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                listeners = {s.fileno(): s for s in (self._listener, self._unix)
                             if s is not None}
                ready = readable(list(listeners), 0.5)
                self._end_handshakes(time.monotonic())
                if not ready:
                    continue
                sock, addr = listeners[ready[0]].accept()
            except (OSError, ValueError):
                continue  # closed under us (the loop's test ends it), or a failed accept
            with self._lock:
                self._handshakes[sock] = time.monotonic() + _HANDSHAKE_S
            threading.Thread(target=self._admit, args=(sock, addr), daemon=True,
                             name="unison-tcp-handshake").start()

    def _end_handshakes(self, before: float) -> None:
        """Shut down the connections whose handshake is due before ``before``: the reads
        of their handshake thread end at once."""
        with self._lock:  # (under it: a handshake that just passed has left the dict)
            for sock, due in self._handshakes.items():
                if due <= before:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)

    def _admit(self, sock: socket.socket, addr: Any) -> None:
        """Handshake with one caller; a worker that passes joins, anything else is dropped."""
        rank = -1
        unix = sock.family == socket.AF_UNIX
        try:
            if not unix:
                _tune(sock)
            _timeouts(sock, _HANDSHAKE_S)
            conn = Connection(os.dup(sock.fileno()))
            try:
                deliver_challenge(conn, self._secret)
                answer_challenge(conn, self._secret)
                hello = conn.recv_bytes(512)
                if len(hello) < _HELLO.size:
                    raise ValueError("a short hello")
                wanted, pid = _HELLO.unpack_from(hello)
                named, _, built = bytes(hello[_HELLO.size:]).partition(b"\0")
                host = named.decode("utf-8", "replace")
                refusal = _other_build(built.decode("utf-8", "replace"))
                if not refusal:
                    with self._lock:  # a worker: it may wait for its part to be offered
                        self._handshakes[sock] = time.monotonic() + _OFFER_S + _HANDSHAKE_S
                    rank, refusal = self._claim(wanted, unix)
                if refusal:
                    conn.send_bytes(pickle.dumps(("refused", refusal)))
                    self.refusal = refusal
                    raise ValueError(refusal)
                incarnation = secrets.randbits(63) | 1
                spin = not (self._crowded and host == self._host)
                conn.send_bytes(pickle.dumps(("welcome", incarnation, self._specs[rank], spin)))
            finally:
                conn.close()
            with self._lock:  # passed: no deadline for it any more
                self._handshakes.pop(sock, None)
            if unix:
                self._admit_local(rank, sock)
                return
            _timeouts(sock, 0)
            sock.setblocking(False)
            peer = _Peer(rank, sock, incarnation, host, pid)
            with self._lock:
                if self._closed:
                    raise OSError("the session closed")
                self._peers[rank] = peer
                self._epoll.register(peer.fd, select.EPOLLIN)
            self._wake()
            log.debug("worker %d joined from %s (pid %d on %s)", rank, addr, pid, host)
        except Exception as exc:
            if rank >= 0:
                with self._lock:
                    self._claimed.discard(rank)
            more = self._drops.say()
            if more is not None:
                log.warning("unison: dropped a connection from %s: %s: %s%s", addr,
                            type(exc).__name__, exc or "the peer failed the handshake",
                            f" (and {more} more since the last word)" if more else "")
            sock.close()
        finally:
            with self._lock:
                self._handshakes.pop(sock, None)

    def _admit_local(self, rank: int, sock: socket.socket) -> None:
        """A worker on this host: hand it the fds of its shared memory, keep the connection
        as its keeper's lifeline, and say who it is (the kernel's word for its pid)."""
        pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  struct.calcsize("3i")))[0]
        with self._lock:  # close() sets _closed under it, then its owners close the fds:
            if self._closed:  # sent after that, their numbers could be another file's
                raise OSError("the session closed")
            socket.send_fds(sock, [b"F"], self._fds.get(rank, []))  # (handshake timeouts)
            self._lifelines.append(sock)
        _timeouts(sock, 0)
        if self._on_local is not None:
            self._on_local(rank, pid)
        log.debug("worker %d joined on this host (pid %d)", rank, pid)

    def _claim(self, wanted: int, unix: bool = False) -> tuple[int, str]:
        """A rank for a worker that proved it holds the secret, and "", or -1 and why not.
        One that joined before its part was offered (a worker started before the session,
        retrying its connect, comes in while the session still makes its collectives) waits
        for the offer, up to _OFFER_S: refused then, it was told the session was full."""
        deadline = time.monotonic() + _OFFER_S
        with self._offered:
            while True:
                rank, refusal, final = self._claim_now(wanted, unix)
                left = deadline - time.monotonic()
                if final or left <= 0 or self._closed:
                    return rank, refusal
                self._offered.wait(left)

    def _claim_now(self, wanted: int, unix: bool) -> tuple[int, str, bool]:
        """``_claim``'s look (the lock held), and whether its answer is final (False: wait
        for an offer)."""
        if wanted >= 0:
            if wanted >= self.n:
                return -1, (f"rank {wanted} is out of range: the session has {self.n} "
                            f"workers (ranks 0 to {self.n - 1}); pass one of those to --rank"), True
            if (wanted in self._local) != unix:
                return -1, (f"rank {wanted} runs on the controller's host and joins over "
                            "its Unix socket (--unix)" if not unix else
                            f"rank {wanted} joins over TCP, not the Unix socket"), True
            if wanted in self._claimed:
                return -1, (f"rank {wanted} has joined already: start this worker with "
                            "another --rank, or without one (the first free rank)"), True
            if self._specs[wanted] is None:
                return -1, _NOT_READY, False
            self._claimed.add(wanted)
            return wanted, "", True
        waiting = False
        for r in range(self.n):
            if r not in self._claimed and (r in self._local) == unix:
                if self._specs[r] is not None:
                    self._claimed.add(r)
                    return r, "", True
                waiting = True
        if waiting:
            return -1, _NOT_READY, False
        return -1, (f"all {self.n} workers of the session have joined: this one is one "
                    "too many (open the session with more workers to use it)"), True

    def ended(self) -> int | None:
        """A worker whose connection broke or closed, if any (for the session's report)."""
        return next((p.rank for p in self._peers
                     if p is not None and (p.ended or not p.open)), None)

    def joined(self) -> list[int]:
        """The ranks connected so far."""
        return [r for r, p in enumerate(self._peers) if p is not None]

    def where(self, rank: int) -> str:
        """Where worker ``rank`` connected from, and why its stream ended (if it did)."""
        peer = self._peers[rank]
        text = "" if peer is None else f"pid {peer.pid} on {peer.host}"
        why = self._why.get(rank) or (peer.ended if peer is not None else "")
        return f"{text}; {why}" if why and text else why or text

    def started(self, watch: Sequence[int] = ()) -> None:
        self._watch = list(watch)

    # -- sending -------------------------------------------------------------------------------

    def send(self, data: bytes, ranks: Sequence[int], buffers: Sequence[Any] = (), *,
             deadline: float | None = None) -> None:
        raws = [pb.raw() for pb in buffers]
        check_frame(data, raws)
        written = False  # once a worker has it, a timeout further on is a partial send
        moving = stall(deadline)
        for r in ranks:
            peer = self._peers[r]
            if peer is None or not peer.open:
                raise BrokenPipeError(f"worker {r} is not connected")
            head = _HEAD.pack(_MAGIC, peer.incarnation, len(data), len(raws))
            was = written
            try:
                if not raws and len(data) <= _SMALL:  # one send, no frame bookkeeping
                    frame = head + data
                    with peer.write_lock:
                        written = True  # (until the count is taken: it may have gone)
                        try:
                            n = 0 if peer.owed else peer.sock.send(frame)
                        except BlockingIOError:
                            n = 0
                        written = was or n > 0
                        if n < len(frame):  # the connection is full: wait for room
                            written = self._write(peer, [memoryview(frame)[n:]], moving,
                                                  written)
                        else:
                            written = True
                else:
                    parts: list[Any] = [head, data]
                    for raw in raws:
                        parts += [_BUF.pack(raw.nbytes), raw]
                    with peer.write_lock:
                        written = self._write(peer, parts, moving, written)
            except BaseException as exc:
                if not own_error(exc):  # (a signal handler's): once a worker got the message,
                    if written:  # or part of it, lockstep is gone
                        raise half_sent(exc, f"worker {r}'s connection") from exc
                elif isinstance(exc, OSError) and not isinstance(exc, SendTimeout):
                    peer.ended = peer.ended or f"its connection failed: {exc}"  # (so that
                raise  # the session blames the right worker)
            self._sent[r] += 1
        self._unread += 1
        if self._unread >= _DRAIN_EVERY:
            self._unread = 0
            self._drain()

    def _write(self, peer: _Peer, frame: list[Any], deadline: Stall | None,
               written: bool) -> bool:
        """Write a frame to ``peer`` (its write lock held), after the rest of a heartbeat
        begun (``owed``). While its connection is full, read what it sends: it may be
        blocked writing replies to us, and neither of us would ever move again."""
        def check_watch() -> None:
            if self._watch and readable(self._watch):
                raise BrokenPipeError("a worker died while its connection was full")
            if peer.ended:  # (its host gone, say: the kernel would probe it for minutes)
                raise BrokenPipeError(f"worker {peer.rank}'s connection ended: {peer.ended}")

        def wait(seconds: float) -> None:
            has_data, _ = poll_fds([peer.fd], [peer.fd], seconds)
            if has_data and not peer.ended and self._rx.acquire(blocking=False):
                try:  # (where a recv holds the lock, it reads them itself)
                    got: list[tuple[int, bytes | Reply | None]] = []
                    self._take(peer, got)  # parsed now: a reply left unparsed waits for
                    self._keep(got)  # bytes that may never come (its caller times out)
                    if _ended(peer):
                        self._wake()  # the next recv drops it (not here: we write to it)
                finally:
                    self._rx.release()

        what = f"worker {peer.rank}'s connection"
        if peer.owed:
            def pay(parts: list[memoryview]) -> int:
                n = peer.sock.sendmsg(parts)
                peer.owed = peer.owed[n:]
                return n

            try:
                write_frame(pay, [peer.owed], what, deadline, written, check_watch, wait)
            except PartialSendError as exc:
                if written or exc.__cause__ is not None:  # (another's exception: ``owed``
                    raise  # may have missed its count)
                raise SendTimeout(  # only the heartbeat's bytes went: the rest is owed still
                    f"{what} stayed full until the deadline; nothing of this message was "
                    "sent: wait for the workers (sync), or close the session") from None
        return write_frame(peer.sock.sendmsg, frame, what, deadline, written, check_watch,
                           wait)

    def _heartbeat(self) -> None:
        """An empty frame to every worker each HEARTBEAT_S, between frames, as much of it
        as goes without waiting (a full connection needs none: its data is acknowledged,
        or fails, the same way; the next write's deadline sees a peer that reads nothing).
        What the kernel did not take is ``owed``: the next heartbeat or frame writes it
        first. Waiting here instead, a deadline that passed in the middle of a heartbeat
        left half a frame in the stream, and the worker took the next command for a
        malformed frame."""
        while not self._stop.wait(HEARTBEAT_S):
            for peer in list(self._peers):
                if peer is None or not peer.open:
                    continue
                if not peer.ended and _silent(peer.sock):
                    peer.ended = (f"its host acknowledged nothing we sent for over "
                                  f"{_SILENT_MS / 1000:g} s (powered off, or the network "
                                  "between us is down)")
                    self._wake()  # recv drops it; a settled wait asks, and recv drops it
                    self._unsettle()
                if not peer.write_lock.acquire(blocking=False):
                    continue
                try:
                    beat = peer.owed or _HEAD.pack(_MAGIC, peer.incarnation, 0, 0)
                    peer.owed = beat[peer.sock.send(beat):]
                except (OSError, ValueError):
                    pass  # full (BlockingIOError): skipped; else the next recv says why
                finally:
                    peer.write_lock.release()

    # -- receiving -----------------------------------------------------------------------------

    def recv(
        self, timeout: float | None, watch: Sequence[int] | None = None
    ) -> list[tuple[int, bytes | Reply | None]]:
        """See Channel.recv: the backlog first, then the connections (``watch``: deprecated,
        ignored)."""
        if not self._rx.acquire(blocking=False):
            self._wait_rx()
        try:
            out, self._backlog = self._backlog, []
            if out:
                timeout = 0  # replies in hand: add only what is there now
            open_peers = [p for p in self._peers if p is not None and p.open]
            held = [p for p in open_peers if p.ended]
            poll = self._epoll.poll  # the open peers' sockets and the wake pipe
            if held or timeout == 0 or (open_peers and spin(  # a reply is often a few µs
                    lambda: bool(poll(0)), SPIN if timeout is None else min(SPIN, timeout))):
                ready = {fd for fd, _ in poll(0)}  # away: yield before we sleep (one
            else:  # epoll_wait per look: a select of the list cost 4x as much); then sleep,
                waits: list[Any] = [p.fd for p in open_peers]  # deaths too
                waits += [self._wake_r, *self._watch]
                self._sleep_set = sleep = reuse(self._sleep_set, waits)
                ready = set(sleep.readable(timeout))
            if self._wake_r in ready:
                drain_fd(self._wake_r)
            self._read_ready(open_peers, ready, held, out)
            return out
        finally:
            self._rx.release()

    def _wait_rx(self) -> None:
        """Take the rx lock for recv, which another thread holds. Where that is settled,
        waiting for progress reports, it sees the yield pipe readable and lets go (its sync
        asks instead): a thread waiting for its replies never waits for another's sync. A
        byte left behind where the holder was not settled makes the next settled ask once."""
        self._unsettle()
        self._rx.acquire()

    def _unsettle(self) -> None:
        """Make a settled wait let go of the connections (the yield pipe readable)."""
        try:
            os.write(self._yield_w, b"x")
        except OSError:
            pass  # it is readable already (or closed: close() is under way)

    def _read_ready(self, peers: list[_Peer], ready: set[int], held: list[_Peer],
                    out: list[tuple[int, bytes | Reply | None]]) -> None:
        """Read each of ``peers`` whose socket is in ``ready``, or that holds bytes read
        ahead (``held``); caller holds the rx lock."""
        for peer in peers:
            if peer.fd in ready or peer in held:
                self._read(peer, out)

    def _read(self, peer: _Peer, out: list[tuple[int, bytes | Reply | None]]) -> None:
        """Whole replies from ``peer`` to ``out``, reports taken; caller holds the rx lock."""
        if not peer.ended:
            self._take(peer, out)
        if _ended(peer):
            self._drop(peer, peer.ended, out)

    def _take(self, peer: _Peer, out: list[tuple[int, bytes | Reply | None]]) -> None:
        """Read what ``peer``'s socket holds and put the whole replies there are to ``out``,
        reports taken; a stream that ended or went out of step sets ``ended`` (the caller
        drops it). Caller holds the rx lock."""
        n = self._recv(peer)  # usually one whole reply or report, nothing else: no buffer
        if n and (peer.buf or not self._one_reply(peer, n, out)):
            peer.buf += self._scratch_view[:n]
            self._frames(peer, out)

    # -- progress: sync without a message, where the reports are in -------------------------

    settles = True

    def settled(self, ranks: Sequence[int], timeout: float) -> bool:
        """Channel.settled, from the progress reports in the reply streams, as the pipe
        channel's: each worker in ``ranks`` has run every command sent to it and holds no
        error nobody fetched. Waits for the reports up to ``timeout``, reading the
        connections (replies found go to the backlog), only where no other thread reads
        them, and only until one wants to (``_wait_rx``): False tells nothing more, and the
        caller asks (SYNC). A watch fd readable, or a stream ended: False, so that the
        caller's long way notices the death."""
        if not self._rx.acquire(blocking=False):
            return False
        try:
            out: list[tuple[int, bytes | Reply | None]] = []
            open_peers = [p for p in self._peers if p is not None and p.open]
            held = [p for p in open_peers if p.ended]
            if held:
                self._read_ready(open_peers, set(), held, out)
            poller = self._settle_set([p.fd for p in open_peers])
            end = time.perf_counter() + timeout
            got = poller.poll(0)
            while True:
                if got:
                    ready = {fd for fd, _ in got}
                    if self._yield_r in ready:
                        drain_fd(self._yield_r)
                        self._keep(out)
                        return False  # a recv wants the connections: it reads them
                    self._read_ready(open_peers, ready, [], out)
                    if len(ready) > sum(p.fd in ready for p in open_peers):
                        self._keep(out)
                        return False  # a watch fd (a death): the long way looks
                if out:
                    self._keep(out)
                    if any(data is None for _, data in out):
                        return False
                    out = []
                looked = self._look(ranks)
                if looked:
                    return looked == 1
                left = end - time.perf_counter()
                if left <= 0:
                    return False
                found = spin(poller.poll, min(SPIN, left), 0.0, 0)  # yield, then sleep
                got = found if isinstance(found, list) else poller.poll(
                    max(0, math.ceil(left * 1000)))
        except (OSError, ValueError):  # close() from another thread (it does not wait for
            return False  # this lock): the long way says the session is closed
        finally:
            self._rx.release()

    def _settle_set(self, peers: list[int]) -> select.poll:
        """settled's poll set: the open connections, the watch fds, the yield pipe; made
        again only when they change."""
        fds = [*peers, *self._watch, self._yield_r]
        if self._settle_poller is None or self._settle_poller[0] != fds:
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            self._settle_poller = (fds, poller)
        return self._settle_poller[1]

    def _look(self, ranks: Sequence[int]) -> int:
        """``reported``, where every worker in ``ranks`` is still connected; 2 (ask: the
        long way says what happened) where one is not."""
        peers = self._peers
        for r in ranks:
            peer = peers[r]
            if peer is None or not peer.open:
                return 2
        return reported(self._sent, self._progress, ranks)

    def holding(self, ranks: Sequence[int]) -> list[int]:
        """Channel.holding: as of each worker's last reply or report read."""
        return held(self._progress, ranks)

    def _keep(self, got: list[tuple[int, bytes | Reply | None]]) -> None:
        """Replies read by a wait other than recv: into the backlog, for the next recv.
        Wakes an event loop (the wake pipe is among ``wake_fds``) when it grew."""
        if got:
            self._backlog += got
            self._wake()

    def _drain(self) -> None:
        """Read what every connection holds now, unless a recv is reading (it takes it)."""
        if not self._rx.acquire(blocking=False):
            return
        try:
            open_peers = [p for p in self._peers if p is not None and p.open]
            ready = {fd for fd, _ in self._epoll.poll(0)}
            out: list[tuple[int, bytes | Reply | None]] = []
            self._read_ready(open_peers, ready, [p for p in open_peers if p.ended], out)
            self._keep(out)
        finally:
            self._rx.release()

    def _recv(self, peer: _Peer) -> int:
        """Read what the socket holds into the scratch buffer (one for all peers: a fresh
        1 MiB bytes object per read would cost an mmap); 0 when nothing came (``ended`` says
        if the stream ended)."""
        try:
            n = peer.sock.recv_into(self._scratch)
        except BlockingIOError:
            return 0
        except OSError as exc:
            peer.ended = f"its connection failed: {exc}"
            return 0
        if not n:
            peer.ended = "its connection closed"
        return n

    def _one_reply(self, peer: _Peer, n: int,
                   out: list[tuple[int, bytes | Reply | None]]) -> bool:
        """Whether the ``n`` bytes just read are exactly one reply or one report, well formed
        (then the reply is in ``out``, the progress taken); else the caller buffers them and
        parses them as a stream."""
        if n < _REPLY.size:
            return False
        magic, incarnation, size, progress = _REPLY.unpack_from(self._scratch)
        if incarnation != peer.incarnation or _REPLY.size + size != n:
            return False
        if magic == _REPLY_MAGIC:
            out.append((peer.rank, bytes(self._scratch_view[_REPLY.size:n])))
        elif magic != _REPORT_MAGIC or size:
            return False
        self._progress[peer.rank] = progress
        return True

    def _frames(self, peer: _Peer, out: list[tuple[int, bytes | Reply | None]]) -> None:
        """The whole replies in the peer's buffer to ``out``, reports taken."""
        buf = peer.buf
        at = 0
        while len(buf) - at >= _REPLY.size:
            magic, incarnation, size, progress = _REPLY.unpack_from(buf, at)
            problem = _check_reply(magic, incarnation, size, peer.incarnation)
            if problem:
                peer.ended = f"it sent a malformed frame ({problem})"
                break
            end = at + _REPLY.size + size
            if len(buf) < end:
                break
            if magic == _REPLY_MAGIC:
                out.append((peer.rank, bytes(buf[at + _REPLY.size:end])))
            self._progress[peer.rank] = progress
            at = end
        del buf[:at]

    def _drop(self, peer: _Peer, why: str, out: list[tuple[int, bytes | Reply | None]]) -> None:
        """A worker's stream ended, or went out of step: say so once, and close it (after
        the whole replies it sent before)."""
        self._frames(peer, out)
        if why != "its connection closed":
            log.error("unison: worker %d (%s): %s; it is dropped", peer.rank, peer.host, why)
        self._why.setdefault(peer.rank, why)
        peer.open = False
        try:
            self._epoll.unregister(peer.fd)
        except (OSError, ValueError):
            pass
        peer.sock.close()
        out.append((peer.rank, None))

    def wake_fds(self) -> list[int]:
        return [p.fd for p in self._peers if p is not None and p.open] + [self._wake_r]

    def pending(self) -> bool:
        """Channel.pending; False once closed, by another thread too, in the middle of
        the look (an await's spin looks without the router's lock)."""
        try:
            peers = [p for p in self._peers if p is not None and p.open]
            if self._backlog or any(p.ended for p in peers):
                return True
            if not peers:
                return False
            self._look_set = look = reuse(self._look_set, [p.fd for p in peers])
            return bool(look.readable())
        except (OSError, ValueError):  # a socket closed meanwhile
            if self._closed:
                return False
            raise

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # full, or closed (-1)
            pass

    rearm_wake = _wake  # (recv empties the wake pipe, a poll's too)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._offered.notify_all()
        self._end_handshakes(math.inf)  # (their threads end at once)
        self._stop.set()
        if self._beater is not threading.current_thread():
            self._beater.join(timeout=2.0)
        unsaid = self._drops.unsaid
        if unsaid:
            log.warning("unison: dropped %d more connections since the last word", unsaid)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread's poll
        except OSError:
            pass
        if self._unix is not None:
            try:
                self._unix.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._accepter is not threading.current_thread():
            self._accepter.join(timeout=2.0)
        self._listener.close()
        if self._unix is not None:
            self._unix.close()
        # A recv or settled in another thread may be reading the connections, or polling
        # the pipes by number: closed under it, those numbers go to the next file opened,
        # whose bytes it would take. Wake it, and go on once it has let go of them.
        self._wake()
        self._unsettle()
        if not self._rx.acquire(timeout=_LET_GO_S):
            log.warning("unison: a thread kept reading the closed session's connections; "
                        "they are left open")
            return
        try:
            self._hang_up()
            self._epoll.close()
            for fd in (self._wake_r, self._wake_w, self._yield_r, self._yield_w):
                os.close(fd)
            self._wake_r = self._wake_w = self._yield_r = self._yield_w = -1
            self._watch = []
        finally:
            self._rx.release()

    def _hang_up(self) -> None:
        """Close every connection (close() holds the rx lock): first hang up, giving each
        worker ``linger`` seconds to end on its own."""
        peers = [p for p in self._peers if p is not None and p.open]
        for peer in peers:
            try:
                peer.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        deadline = time.monotonic() + self.linger
        waiting = list(peers)
        while waiting and time.monotonic() < deadline:
            by_fd = {p.fd: p for p in waiting}
            for fd in readable(list(by_fd), deadline - time.monotonic()):
                peer = by_fd[fd]
                self._recv(peer)  # (nobody reads them now: only whether the stream ended)
                if _ended(peer):
                    waiting.remove(peer)
        for peer in peers:
            peer.open = False
            peer.sock.close()
        for line in self._lifelines:
            line.close()
        self._lifelines = []


def check_frame(data: bytes, raws: Sequence[memoryview]) -> None:
    """ValueError, before anything is sent, for a part of a message over MAX_FRAME: the
    worker would refuse the frame and leave without a word (WorkerDied, "it stopped
    answering"); or for a buffer in another session's shared array (``sess.empty``): it
    would go as a copy, and the workers' writes to it would be lost. channel.mixed asks
    before its shared-memory half goes."""
    if raws and arena._shared_ranges and any(arena.is_shared(raw) for raw in raws):
        raise arena.anothers_error()
    if len(data) > MAX_FRAME or (raws and any(raw.nbytes > MAX_FRAME for raw in raws)):
        big = max([len(data), *(raw.nbytes for raw in raws)])
        raise ValueError(
            f"a value of {big:,} bytes is over the TCP channel's limit of {MAX_FRAME:,} "
            "bytes per part of a message: nothing was sent. Send it in pieces (several "
            "puts of slices), or make it on the workers")


def _nothing(*_: object) -> None:
    return None


def _ended(peer: _Peer) -> str:
    """Why the peer's stream ended ("" if it has not): read afresh after a call set it."""
    return peer.ended


def build() -> str:
    """What both ends of a connection must share: unison's version and the Python that runs
    it (the functions cloudpickle sends by value carry that Python's bytecode)."""
    from unison import __version__

    return (f"unison {__version__} on {sys.implementation.name} "
            f"{sys.version_info[0]}.{sys.version_info[1]}")


def _other_build(theirs: str) -> str:
    """Why a worker of build ``theirs`` cannot join this controller's session, "" if it can:
    another version's messages could be read wrong, and a function's bytecode would not
    load (a worker with no build in its hello runs an older unison)."""
    ours = build()
    if theirs == ours:
        return ""
    return (f"the worker runs {theirs or 'an older unison'}, the controller {ours}: install "
            "the same unison version and Python (major.minor) on every host")


def _check_head(magic: int, incarnation: int, size: int, count: int, expected: int) -> str:
    if magic != _MAGIC:
        return f"bad magic {magic:#x}"
    if incarnation != expected:
        return f"incarnation {incarnation:#x} is not this connection's {expected:#x}"
    if size > MAX_FRAME:
        return f"a payload of {size} bytes, over the limit of {MAX_FRAME}"
    if count > _MAX_BUFFERS:
        return f"{count} buffers, over the limit of {_MAX_BUFFERS}"
    return ""


def _check_reply(magic: int, incarnation: int, size: int, expected: int) -> str:
    if magic == _MAGIC:
        return ("a reply in the format of an older unison: the worker runs another version "
                "than the controller; install the same one on every host")
    if magic not in (_REPLY_MAGIC, _REPORT_MAGIC):
        return f"bad magic {magic:#x}"
    if incarnation != expected:
        return f"incarnation {incarnation:#x} is not this connection's {expected:#x}"
    if size > MAX_FRAME:
        return f"a payload of {size} bytes, over the limit of {MAX_FRAME}"
    if magic == _REPORT_MAGIC and size:
        return f"a progress report with a payload of {size} bytes"
    return ""


def _whole_frame(buf: bytearray, k: int, incarnation: int) -> int:
    """Where the command at the start of ``buf[:k]`` ends, when it is all there, well formed
    and without out-of-band buffers (the worker's one-read fast path); else 0."""
    if k < _HEAD.size:
        return 0
    magic, inc, size, count = _HEAD.unpack_from(buf)
    end: int = _HEAD.size + size
    if count or end > k or _check_head(magic, inc, size, count, incarnation):
        return 0
    return end


# -- the worker's end ------------------------------------------------------------------------


def _handshake_broke(address: str, exc: BaseException) -> str:
    """Why a handshake that proved nothing ended: not the secret (that is
    AuthenticationError's), but a controller that did not answer, or went."""
    if isinstance(exc, (TimeoutError, BlockingIOError)):  # (SO_RCVTIMEO: EAGAIN)
        return (f"the controller at {address} did not answer within {_HANDSHAKE_S * 2:g} s "
                f"of the handshake (is it stopped, or is that port another program's?)")
    return (f"the controller at {address} closed the connection during the handshake: its "
            "session closed or timed out starting, or it died; or that port is not a unison "
            f"session's ({exc or type(exc).__name__})")


class Refused(RuntimeError):
    """The controller would not take this worker (its rank is taken, out of range, ...)."""


def dial(address: str, secret: bytes, rank: int = -1, timeout: float = 60.0,
         unix: str = "") -> tuple[socket.socket, int, bytes, list[int], bool]:
    """Connect to a controller (retrying until ``timeout`` while it is not listening yet),
    prove we hold the secret and check it does, and get our init. Returns the connected
    socket, our incarnation, the pickled WorkerSpec, the fds it names (none over TCP; a
    worker on the controller's host, ``unix``: the name of its Unix socket, gets its shared
    memory's), and whether our waits should spin (TcpWorkerChannel's ``spin``)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:  # (99999 would dial
        # 99999 mod 65536)
        raise ValueError(f"--connect takes HOST:PORT, a port from 1 to 65535, not {address!r}")
    if not -1 <= rank < 2**31:  # -1: the first free rank (what no --rank asks for)
        raise ValueError(f"--rank takes a rank from 0 (leave it out for the first free one), "
                         f"not {rank}")
    if math.isnan(timeout) or timeout < 0:  # NaN: a deadline never reached, retried for ever
        raise ValueError(f"--timeout takes seconds >= 0 (inf: keep trying), not {timeout}")
    deadline = time.monotonic() + timeout
    while True:
        try:
            if unix:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect("\0" + unix)
                except OSError:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((host.strip("[]"), int(port)), timeout=5.0)
            break
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ConnectionError(f"could not reach the controller at {address} within "
                                      f"{timeout:g} s: {exc}") from exc
            time.sleep(0.2)
    try:
        sock.settimeout(None)
        if not unix:
            _tune(sock)
        _timeouts(sock, _HANDSHAKE_S * 2)
        conn = Connection(os.dup(sock.fileno()))
        try:
            try:
                answer_challenge(conn, secret)
                deliver_challenge(conn, secret)
            except AuthenticationError as exc:
                raise PermissionError(
                    f"the controller at {address} refused us: the secret does not match "
                    f"(UNISON_SECRET), or it is not a unison session ({exc})") from exc
            except (EOFError, OSError) as exc:
                raise ConnectionError(_handshake_broke(address, exc)) from exc
            try:
                conn.send_bytes(_HELLO.pack(rank, os.getpid())
                                + socket.gethostname().encode()[:128].replace(b"\0", b"")
                                + b"\0" + build().encode())
                answer = pickle.loads(conn.recv_bytes(MAX_FRAME))  # (it proved itself)
            except (EOFError, OSError) as exc:
                raise ConnectionError(_handshake_broke(address, exc)) from exc
        finally:
            conn.close()
        if answer[0] != "welcome":
            raise Refused(f"the controller at {address} refused this worker: {answer[1]}")
        fds: list[int] = []
        if unix:
            _, fds, _, _ = socket.recv_fds(sock, 1, 256)
        _timeouts(sock, 0)
        return sock, int(answer[1]), bytes(answer[2]), fds, bool(answer[3])
    except BaseException:
        sock.close()
        raise


class TcpWorkerChannel(WorkerChannel):
    """A worker's end: the connection ``dial`` made, read by the worker's loop itself (no
    thread hand-off: the kernel's socket buffers hold what the controller sends ahead, and
    the controller reads our replies while it waits to write, so neither side blocks the
    other for good).

    ``spin``: whether a wait yields the core for a while before it sleeps in ``recv``. The
    controller says no to workers on its own host when that host has fewer CPUs than the
    session's processes: a spinning worker there holds a core the controller or a busy peer
    needs: sleeping made dispatch 0.91x and 0.88x the time at N=2 and 4 on 2 CPUs (python
    benchmarks/compare_revs.py --base fc543f2 --head ec7e5fe --tcp). With a core each,
    spinning saves the wake-up.

    ``peers``: the session's processes, controller included, that may run on this host at
    most (``pacing.crowd.expect``): runnable tasks beyond them are strangers. 0: unknown,
    and a wait's look does not count tasks."""

    def __init__(self, sock: socket.socket, incarnation: int, spin: bool = True,
                 peers: int = 0) -> None:
        crowd.expect(peers)
        self._sock = sock
        self._inc = incarnation
        self._spin = spin
        self._send_lock = threading.Lock()
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._have = bytearray()  # received ahead of the frame being read, from _off on
        self._off = 0
        self._scratch = bytearray(_CHUNK)
        self._scratch_view = memoryview(self._scratch)
        self._fresh = True
        self._taken = 0
        """Commands recv returned: each is run by the time the next is asked for."""
        self._holding = 0
        """1 while this worker holds errors nobody fetched (``unreported``), else 0."""
        self._told = 0
        """The progress word the controller last got: commands run << 1 | holding."""
        self._idle: Callable[[], None] | None = None

    def _wait_first(self) -> None:
        """Until the first command is in; then forget what the wait saw (pacing.crowd)."""
        self._poll.poll()
        crowd.forget()

    def recv(self) -> tuple[memoryview, list[Any]] | None:
        try:
            if self._fresh:  # the wait for the session's first command spans the other
                self._fresh = False  # workers' start (and in a Ray actor, Ray's), which no
                self._wait_first()  # later wait should take for a crowd
            if not self._have:
                if not self._poll.poll(0):  # about to wait: first say what has run
                    self._tell()
                    if self._spin:  # the next command is often a few µs away
                        spin(lambda: bool(self._poll.poll(0)), SPIN)
                whole = self._one_frame()
                if whole is not None:
                    self._taken += 1
                    return whole, []
            while True:
                magic, inc, size, count = _HEAD.unpack(self._read(_HEAD.size))
                problem = _check_head(magic, inc, size, count, self._inc)
                if problem:
                    raise OSError(f"a malformed frame from the controller: {problem}")
                if size or count:
                    break
                if self._idle is not None:  # a heartbeat: nothing to run
                    self._idle()
            data = memoryview(self._read(size))
            bufs: list[Any] = []
            for _ in range(count):
                (length,) = _BUF.unpack(self._read(_BUF.size))
                if length > MAX_FRAME:
                    raise OSError(f"a buffer of {length} bytes from the controller")
                bufs.append(memoryview(self._read(length)))
            self._taken += 1
            return data, bufs
        except (EOFError, OSError):
            return None

    def _tell(self) -> None:
        """Report this worker's progress, where the controller has not heard it and no
        command is in (a wait is next): its sync reads that instead of asking."""
        progress = self._taken << 1 | self._holding
        if progress != self._told and not self._poll.poll(0):
            with self._send_lock:
                self._sock.sendall(_REPLY.pack(_REPORT_MAGIC, self._inc, 0, progress))
            self._told = progress

    def unreported(self, count: int) -> None:
        self._holding = 1 if count else 0  # told with the next reply or report

    def on_idle(self, fn: Callable[[], None]) -> None:
        self._idle = fn

    def _one_frame(self) -> memoryview | None:
        """The fast path, nothing read ahead: one recv, and when it brought one whole call
        (no out-of-band buffers), its body, parsed straight from the scratch buffer; what
        came after it is kept for the next. Else all it read is kept for the general path
        (None); a closed connection raises EOFError."""
        k = self._sock.recv_into(self._scratch)
        if not k:
            raise EOFError
        end = _whole_frame(self._scratch, k, self._inc)
        if end > _HEAD.size:  # a call, not a heartbeat (an empty frame)
            if end < k:
                self._have += self._scratch_view[end:k]
            return memoryview(self._scratch[_HEAD.size:end])
        self._have += self._scratch_view[:k]
        return None

    def _read(self, n: int) -> bytearray | memoryview:
        """Exactly ``n`` bytes: first what an earlier read brought ahead, then the socket's.
        A small remainder is read through the scratch buffer, taking what follows with it
        (a frame's head and body, and frames sent back to back, cost one recv); a large one
        goes straight into the result, copied once."""
        have, off = self._have, self._off
        if len(have) - off >= n:
            self._off = off = off + n
            ahead = have[off - n : off]
            if off == len(have):
                have.clear()
                self._off = 0
            return ahead
        out = receive_buffer(n)
        view = memoryview(out)
        got = len(have) - off
        view[:got] = have[off:]
        have.clear()
        self._off = 0
        while got < n:
            self._tell()  # (a heartbeat, or the start of a command, came alone)
            if n - got < _CHUNK:
                k = self._sock.recv_into(self._scratch)
                take = min(k, n - got)
                view[got : got + take] = self._scratch_view[:take]
                have += self._scratch_view[take:k]
            else:
                k = take = self._sock.recv_into(view[got:])
            if not k:
                raise EOFError
            got += take
        return out

    def reply(self, data: bytes, buffers: Sequence[Any] = ()) -> None:
        """A reply is the last thing its command does (worker.serve), so it reports that
        command as run, with whether this worker holds errors nobody fetched."""
        if buffers:
            raise ValueError("the TCP channel pickles replies in band")
        if len(data) > MAX_FRAME:
            raise MemoryError(f"a reply of {len(data)} bytes is over the TCP channel's limit "
                              f"of {MAX_FRAME}")
        self._told = progress = self._taken << 1 | self._holding
        head = _REPLY.pack(_REPLY_MAGIC, self._inc, len(data), progress)
        with self._send_lock:  # blocking: waits only while the controller is slow to read
            if len(data) <= _SMALL:
                self._sock.sendall(head + data)
            else:
                write_frame(self._sock.sendmsg, [head, data], "the controller's connection",
                            None, False, _nothing, _nothing)

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
