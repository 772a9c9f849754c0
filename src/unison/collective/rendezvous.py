"""The collective segment of workers that share a host other than the controller's.

    the host's first worker (lowest rank)             each other worker of that host
    ---------------------------------------           ------------------------------
    shm.create(): the segment (memfd), as the
      controller makes its own
    offer(): listen on an abstract Unix socket  <---  take(): connect (retrying until the
      named in the spec; to each peer of our            first worker listens), check it runs
      user, the fd (SCM_RIGHTS); then close              as our user, receive the fd

The controller's segment reaches the workers on its own host with their channel's fds. A
host it cannot reach has no one to make a segment for it, so its first worker does, and
hands it over a socket whose name the controller chose at random and sent only over the
authenticated channel. Abstract sockets leave no file behind and vanish with the process.
Neither side trusts a process of another user (SO_PEERCRED), whatever it learnt the name
from. The controller cannot set such a segment's abort flag, so its waiters watch their
peers' pids instead (ShmCollectives(watch_peers=True)).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

from unison.errors import CollectiveError

__all__ = ["TAKE_S", "offer", "take"]

TAKE_S = 120.0
"""How long a worker waits for its host's first worker to offer the segment (s). The
workers start together; if the first one never comes, the session fails its start and
ends the others first."""
_RETRY = 0.01
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def offer(fd: int, name: str, peers: int) -> None:
    """Hand ``fd`` to the ``peers`` workers that ask under ``name``, from a daemon thread
    (the first worker goes on starting); it gives up after TAKE_S."""
    if peers <= 0:
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind("\0" + name)
        sock.listen(peers)
    except BaseException:
        sock.close()
        raise
    threading.Thread(target=_serve, args=(sock, fd, peers), daemon=True,
                     name="unison-coll-offer").start()


def _serve(sock: socket.socket, fd: int, peers: int) -> None:
    deadline = time.monotonic() + TAKE_S
    with sock:
        while peers > 0:
            sock.settimeout(max(0.0, deadline - time.monotonic()))
            try:
                conn, _ = sock.accept()
            except OSError:  # the deadline: the session failed its start
                return
            with conn:
                if _uid(conn) != os.getuid():
                    continue  # not ours, whatever it learnt the name from
                try:
                    socket.send_fds(conn, [b"u"], [fd])
                except OSError:
                    continue
                peers -= 1


def take(name: str, size: int) -> int:
    """The segment the host's first worker offers under ``name`` (at least ``size``
    bytes), waiting for it to listen."""
    deadline = time.monotonic() + TAKE_S
    while True:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
            try:
                sock.connect("\0" + name)
            except (ConnectionRefusedError, FileNotFoundError):
                if time.monotonic() > deadline:
                    raise CollectiveError(
                        f"the first worker of this host did not offer the collective segment "
                        f"within {TAKE_S:g} s: it failed to start or died (see its log, and "
                        "the session's WorkerDied); open the session again") from None
                time.sleep(_RETRY)
                continue
            if _uid(sock) != os.getuid():
                raise CollectiveError("the collective segment's socket is held by another "
                                      "user's process: refused; run every worker of a host as "
                                      "one user")
            sock.settimeout(max(1.0, deadline - time.monotonic()))
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
        if len(fds) != 1 or os.fstat(fds[0]).st_size < size:
            for fd in fds:
                os.close(fd)
            raise CollectiveError("the first worker of this host sent no collective segment "
                                  "of the session's size: are two sessions' workers mixed "
                                  "on this host? open the session again")
        return fds[0]


def _uid(sock: socket.socket) -> int:
    return int(_CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                            _CRED.size))[1])
