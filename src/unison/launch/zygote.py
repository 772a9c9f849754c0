"""Local workers forked from one process, so that they share one address-space layout.

    controller                               zygote (a fresh interpreter, one per session)
    Popen([python, -c, bootstrap]) -------> reads the plan: per rank, its pipes and fds
      stdin: the plan, then held open         forks a keeper per rank: the keeper takes the
                                              rank's pipes as 0, 1, 2 and goes on as
      socket  <--------------------------     unison.worker.main (spec, fork, lifeline)
        (rank, pid) + the keeper's pidfd      sends each keeper's pid and pidfd at once,
        (pid, wait status) when it ends       then reaps them and reports how each ended

Each worker used to be a fresh interpreter, and address-space randomization gave each its
own layout. Where the session's processes outnumber the CPUs, workers take turns on a CPU
and share its branch predictors, TLBs and caches, which are partly indexed by virtual
address: at N=8 on 2 CPUs a round took 20.8 µs with their own layouts and 16.2 with one
shared layout, and at N=4 the blocks that ran at 12.6 µs went (docs/benchmarks.md, "Issue
9, twenty-fifth pass"). Forked from one process, the workers share its layout, still
randomized anew for each session. A lone worker has no one to share it with, and starts
as an interpreter of its own (unison.launch.local).

A keeper is the zygote's child, not the controller's: ``Forked`` gives the launcher what
``subprocess.Popen`` gave (pid, poll, wait, kill, the three pipes), with the pidfd from the
zygote (opened before the zygote can reap it, so never another process's) and the exit
status from its report. The zygote runs no thread and imports nothing of unison's before
it forks; it leaves once every keeper has ended, or the controller has (it holds the
controller's pidfd). Each keeper still holds its own lifeline (its stdin) and checks its
parent, so a zygote that dies, or leaves, takes its keepers along.
"""

from __future__ import annotations

import functools
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

__all__ = ["UNKNOWN", "Forked", "Zygote", "fork_workers", "main", "usable"]

UNKNOWN = -(1 << 30)
"""``Forked.poll()`` of a keeper that ended after the zygote did: its status is not known."""

_REPORT = struct.Struct("<qq")  # (pid, wait status) when a keeper ends
_FORKING = 60.0
"""Seconds the controller waits for the zygote to fork every keeper (milliseconds, unless
the machine is drowning)."""
_AT_START = ("PYTHON", "LD_", "GLIBC_TUNABLES", "MALLOC_", "TZ", "LC_", "LANG")
"""Environment variables read when an interpreter starts: given per rank, they need one
(the time zone and the locale too: the C library reads them once, so a fork of the zygote
kept the zygote's, whatever its os.environ said)."""

def _zygote_failed(zygote: subprocess.Popen[bytes]) -> str:
    """Why the zygote forked no more workers: how it ended, where it did (its exit status,
    as a worker's death says it), or that it did not answer."""
    try:
        code: int | None = zygote.wait(1.0)
    except subprocess.TimeoutExpired:
        code = None
    if code is None:
        return (f"unison's zygote did not answer within {_FORKING:.0f} s before it forked "
                "every worker: the machine may be drowning (memory, processes); its stderr, "
                "above, may say more. Give it room, or start fewer workers")
    from unison.errors import describe_exitcode  # (the zygote imports none)

    return (f"unison's zygote ended before it forked every worker: "
            f"{describe_exitcode(code)}. Its stderr, above, may say why (an error in "
            "sitecustomize, say); where it was killed, most often a limit on processes or "
            "memory was reached (ulimit -u, a container's pids.max or memory limit): raise "
            "it, or start fewer workers")


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The folder unison is imported from."""
BOOT = ("import os, sys\nos.setpgid(0, 0)\n"  # local._OWN_GROUP says why
        "if not (getattr(sys.flags, 'safe_path', 0) or sys.flags.isolated):\n"
        "    del sys.path[0]\n"
        "if {root!r} not in sys.path: sys.path.insert(0, {root!r})\n")
"""How a worker's interpreter (or the zygote's) begins, before it imports anything: its own
process group; without the current folder, which python -c puts first on sys.path (unless
-P or -I), so a numpy.py lying there is never run; with unison's folder first, by hand, not
only by PYTHONPATH, which a worker started with the controller's -E or -I ignores. A
template: ``root`` is ROOT."""
_BOOTSTRAP = ("# unison.worker zygote\n" + BOOT +
              "import runpy; runpy.run_path({path!r})['main']({pid})")
"""The zygote runs this file, not the unison package: what unison reads as it is imported
(UNISON_PURE, the logging levels) is each worker's, from its own environment, and no
library has started a thread in the process that forks. The comment names the workers in
``ps``, whose command line is the zygote's. unison's folder goes first on sys.path, as in
unison.launch.local's bootstrap (BOOT says why)."""


def usable(env: Mapping[int, Mapping[str, str]] | None) -> bool:
    """Whether the workers can be forked from one zygote: Linux's pidfds and fd passing,
    and no environment given per rank that an interpreter reads as it starts (those
    workers start as interpreters of their own)."""
    if not _pidfds():
        return False
    return not any(key.startswith(_AT_START) for vars in (env or {}).values() for key in vars)


@functools.cache
def _pidfds() -> bool:
    """Whether this kernel has pidfds (Linux 5.3: pidfd_open; 5.1: pidfd_send_signal), not
    only this Python: an older kernel raises ENOSYS, and the workers start apart there."""
    if not (hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")
            and hasattr(signal, "pidfd_send_signal")):
        return False
    try:
        fd = os.pidfd_open(os.getpid())
    except OSError:
        return False
    try:
        signal.pidfd_send_signal(fd, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


class _Reports:
    """The controller's end of the zygote's socket: the exit statuses it reported (one
    SOCK_SEQPACKET message each, so a recv is one whole report)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._status: dict[int, int] = {}

    def status(self, pid: int, timeout: float) -> int | None:
        """The exit status of keeper ``pid`` (ended: its pidfd is readable), as
        ``Popen.returncode``; UNKNOWN if the zygote is gone without saying (its socket's
        EOF); None if it has not said within ``timeout``: a zygote that was not scheduled
        for a while (a loaded machine, a CPU quota) reports late, so ask again."""
        end = time.monotonic() + timeout
        with self._lock:
            while pid not in self._status:
                if self._sock.fileno() < 0:
                    return UNKNOWN
                if not _readable(self._sock.fileno(), max(end - time.monotonic(), 0)):
                    return None
                try:
                    data = self._sock.recv(_REPORT.size)
                except OSError:
                    data = b""
                if len(data) != _REPORT.size:  # the zygote is gone
                    self._sock.close()
                    return UNKNOWN
                got, raw = _REPORT.unpack(data)
                self._status[got] = os.waitstatus_to_exitcode(raw)
            return self._status[pid]

    def close(self) -> None:
        self._sock.close()


def _readable(fd: int, timeout: float | None) -> bool:
    """Whether ``fd`` is readable within ``timeout`` seconds (None: no limit), in poll:
    select refuses fds >= 1024. In the controller only: the zygote imports nothing of
    unison's."""
    from unison._fdwait import readable

    return bool(readable([fd], timeout))


class Forked:
    """A keeper forked by the zygote, as much of ``subprocess.Popen`` as the launcher uses."""

    def __init__(self, pid: int, pidfd: int, stdin: IO[bytes], stdout: IO[bytes],
                 stderr: IO[bytes], reports: _Reports) -> None:
        self.pid, self.pidfd = pid, pidfd
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self._reports = reports

    def poll(self) -> int | None:
        ended = (self.returncode is None and self.pidfd >= 0
                 and _readable(self.pidfd, 0.0))
        if ended:  # the zygote says how
            self.returncode = self._reports.status(self.pid, 1.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.pidfd < 0:  # closed: as it ended, if it was seen to
            return UNKNOWN if self.returncode is None else self.returncode
        if self.poll() is None and not _readable(self.pidfd, timeout):
            raise subprocess.TimeoutExpired(f"worker keeper {self.pid}", timeout or 0.0)
        code = self.poll()
        return UNKNOWN if code is None else code  # not said yet: poll() asks again later

    def ended(self) -> bool:
        """Whether the keeper has ended (its pidfd is readable), its status known or not."""
        if self.returncode is not None or self.pidfd < 0:
            return True
        return _readable(self.pidfd, 0)

    def kill(self) -> None:
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except (ProcessLookupError, OSError):
            pass  # ended already

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class Zygote:
    """The controller's hold on the zygote: its process (stdin: the plan, then held open)
    and its reports."""

    def __init__(self, popen: subprocess.Popen[bytes], reports: _Reports) -> None:
        self.popen, self.reports = popen, reports

    def end(self) -> None:
        """Once the keepers have ended: close its stdin and reap it (it leaves with its last
        keeper; killed if it has not within a second), then close the socket."""
        if self.popen.stdin is not None:
            try:
                self.popen.stdin.close()
            except OSError:
                pass
        try:
            self.popen.wait(1.0)
        except subprocess.TimeoutExpired:
            pass
        finally:  # (also a Ctrl-C in the wait: it was left running, unreaped, its socket open)
            if self.popen.returncode is None:
                self.popen.kill()
                self.popen.wait()
            self.reports.close()


def write_init(stream: IO[bytes], blob: bytes, deadline: float | None,
               ranks: Sequence[int]) -> None:
    """Write ``blob``, its length first, to a starting process's stdin, waiting for it to
    read until ``deadline`` at most (the session's start deadline: then TimeoutError). A
    blocking write of a blob over the pipe's 64 KiB (a spec of thousands of sys.path
    entries) to a process whose start was slow (a sitecustomize that sleeps) held the
    controller past start_timeout, and for good where it never read (an audit of the local
    launcher, issue 9, forty-sixth pass)."""
    from unison._fdwait import poll_fds  # (the zygote itself imports none of unison)
    from unison.errors import start_timed_out

    fd = stream.fileno()  # (nothing was written through the stream's buffer)
    os.set_blocking(fd, False)
    view = memoryview(len(blob).to_bytes(8, "little") + blob)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(start_timed_out(list(ranks))) from None
            poll_fds((), (fd,), left)  # (its milliseconds clamped: a month's deadline
            # overflowed a C int)


def fork_workers(python: Sequence[str], ranks: Sequence[int], fds: Mapping[int, Sequence[int]],
                 env: Mapping[str, str], rank_env: Mapping[int, Mapping[str, str]],
                 process_group: Mapping[str, Any], deadline: float | None = None,
                 ) -> tuple[Zygote, list[Forked]]:
    """Start the zygote (``python``: its interpreter and options, which the workers it
    forks keep) and have it fork a keeper per rank (each keeping ``fds[rank]``); the zygote
    and the keepers, in ``ranks`` order. ``deadline``: the session's start deadline
    (time.monotonic()), past which the start fails with TimeoutError."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # one per send
    made: list[int] = []  # fds of ours to close on failure
    plan = []
    pipes: dict[int, tuple[int, int, int]] = {}  # rank -> our ends: stdin, stdout, stderr
    keep = [theirs.fileno()]
    zygote = None
    forked: dict[int, Forked] = {}
    try:
        for rank in ranks:
            in_r, in_w = os.pipe()
            made += [in_r, in_w]  # each pair at once: the next pipe may fail (EMFILE)
            out_r, out_w = os.pipe()
            made += [out_r, out_w]
            err_r, err_w = os.pipe()
            made += [err_r, err_w]
            pipes[rank] = (in_w, out_r, err_r)
            plan.append((rank, in_r, out_w, err_w, tuple(fds[rank]),
                         dict(rank_env.get(rank, {}))))
            keep += [in_r, out_w, err_w, *fds[rank]]
        zygote = subprocess.Popen(
            [*python, "-c", _BOOTSTRAP.format(root=ROOT, path=__file__, pid=os.getpid())],
            stdin=subprocess.PIPE, pass_fds=sorted(set(keep)), env=dict(env),
            **process_group)
        assert zygote.stdin is not None
        write_init(zygote.stdin, pickle.dumps((theirs.fileno(), plan), protocol=5), deadline,
                   ranks)
        theirs.close()
        for _, in_r, out_w, err_w, _, _ in plan:
            for fd in (in_r, out_w, err_w):
                made.remove(fd)  # first: an interrupt between the two leaks it, where the
                os.close(fd)  # other order had the cleanup below close its number again
        reports = _Reports(ours)
        # the session's start deadline where it has one (its start_timeout may be longer
        # than ours: a slow sitecustomize; before, ours cut it to 60 s and blamed limits)
        until = time.monotonic() + _FORKING if deadline is None else deadline
        while len(forked) < len(plan):
            # (a day at most: a start_timeout of 1e10 s overflowed the socket's timeout)
            ours.settimeout(min(max(until - time.monotonic(), 0.001), 86400.0))
            try:
                msg, got_fds, _, _ = socket.recv_fds(ours, 64, 1)
                made += got_fds  # the keeper's pidfd, owned at once (a refusal below, or a
            except TimeoutError:  # Ctrl-C, leaked it)
                if time.monotonic() < until:
                    continue
                if deadline is not None:  # the session's start_timeout
                    from unison.errors import start_timed_out  # (the zygote imports none)

                    raise TimeoutError(start_timed_out(list(ranks))) from None
                msg = b""
            if not msg or not got_fds:
                raise RuntimeError(_zygote_failed(zygote))
            rank, pid = pickle.loads(msg)
            in_w, out_r, err_r = pipes[rank]
            for fd in (in_w, out_r, err_r, got_fds[0]):
                made.remove(fd)  # the file objects' below, which close them (as above)
            forked[rank] = Forked(pid, got_fds[0], os.fdopen(in_w, "wb"),
                                  os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"), reports)
        ours.settimeout(None)
        return Zygote(zygote, reports), [forked[rank] for rank in ranks]
    except BaseException:
        for proc in forked.values():  # each keeper waits for its init: none comes
            proc.kill()
            proc.close()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                stream.close()
        for fd in made:
            os.close(fd)
        ours.close()
        theirs.close()
        if zygote is not None:
            zygote.kill()
            zygote.wait()
            if zygote.stdin is not None:  # the plan's pipe: else open until the Popen is
                try:  # collected
                    zygote.stdin.close()
                except OSError:  # unflushed bytes to a killed zygote: the fd closes all the same
                    pass
        raise


def main(controller: int) -> None:
    """The zygote (the bootstrap's, never a user's): fork a keeper per rank of the plan on
    stdin, send each one's pid and pidfd, then report how each ends until none is left.

    It watches the controller itself, through a pidfd: a keeper's lifeline cannot tell, as
    a child the controller forked (multiprocessing's "fork" start) holds every lifeline too,
    and a keeper's parent is the zygote. Once the controller has ended, the zygote leaves,
    and each keeper, seeing its parent go, stops its worker and all it started within a
    second (unison.worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a controller's SIGCHLD of SIG_IGN would have the keepers reaped unseen, and the mask
    # of its thread would block Ref.cancel's signal in every worker (unison.worker's too)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    size = int.from_bytes(_read_exact(8), "little")
    sock_fd, plan = pickle.loads(_read_exact(size))
    try:
        lead = os.pidfd_open(controller)
    except OSError:
        os._exit(1)
    if os.getppid() != controller:
        os._exit(1)  # the controller went away before we started (the pidfd may be another's)
    sock = socket.socket(fileno=sock_fd)
    me = os.getpid()
    keepers: dict[int, int] = {}  # pidfd -> pid
    for rank, in_fd, out_fd, err_fd, keep, rank_env in plan:
        pid = os.fork()
        if pid == 0:
            _go_on_as_worker(in_fd, out_fd, err_fd, keep, rank_env, me)
        pidfd = os.pidfd_open(pid)  # before any wait: the pid is still this keeper's
        socket.send_fds(sock, [pickle.dumps((rank, pid))], [pidfd])
        keepers[pidfd] = pid
    # the ranks' pipes and the workers' channel and collective fds: theirs, not ours
    wanted = sorted({0, 1, 2, sock.fileno(), lead, *keepers})
    for low, high in zip(wanted, [*wanted[1:], 65536]):
        os.closerange(low + 1, high)
    poller = select.poll()  # a blocking wait: no CPU while nothing happens
    for fd in (lead, *keepers):
        poller.register(fd, select.POLLIN)
    while keepers:
        ready = [fd for fd, _ in poller.poll()]
        if lead in ready:
            os._exit(0)  # the controller has ended: its keepers see us go, and follow
        for pidfd in ready:
            pid = keepers.pop(pidfd)
            poller.unregister(pidfd)
            os.close(pidfd)
            _end_group(pid)
            _, raw = os.waitpid(pid, 0)
            try:
                sock.sendall(_REPORT.pack(pid, raw))
            except OSError:
                pass  # the controller is gone: its keepers follow it
    os._exit(0)  # every keeper has ended


def _end_group(keeper: int) -> None:
    """Kill what is left in an ended keeper's process group (its number), before it is
    reaped. Until then its zombie holds the number; once reaped, and the group empty, the
    number is free, and a later ``killpg`` of it could reach another program's group (with
    pid_max at 32,768 a busy machine comes round to it in minutes). So the controller never
    signals a group whose keeper has ended (local.WorkerProcess.kill); this is that group's
    end. The keeper, a subreaper, killed what it saw below it; a keeper killed outright
    leaves its worker's children here."""
    try:
        os.killpg(keeper, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _go_on_as_worker(in_fd: int, out_fd: int, err_fd: int, keep: Sequence[int],
                   rank_env: Mapping[str, str], zygote: int) -> None:
    """In the zygote's child: its rank's pipes as 0, 1 and 2, only its own fds, its own
    process group (Ctrl-C at a terminal reaches the controller alone), then a worker's
    start as unison.worker.main, with the zygote as the parent it watches."""
    try:
        os.setpgid(0, 0)
        for fd, std in ((in_fd, 0), (out_fd, 1), (err_fd, 2)):
            os.dup2(fd, std)
        wanted = sorted({0, 1, 2, *keep})
        for low, high in zip(wanted, [*wanted[1:], 65536]):
            os.closerange(low + 1, high)
        os.environ.update(rank_env)
        from unison.worker import main as worker_main

        worker_main(zygote)
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def _read_exact(n: int) -> bytes:
    """``n`` bytes of stdin (unison.worker's ``_read_init`` reads its spec the same way; the
    zygote imports nothing of unison's, so it has its own)."""
    buf = b""
    while len(buf) < n:
        chunk = os.read(0, n - len(buf))
        if not chunk:
            os._exit(1)  # the controller went away before it sent the plan
        buf += chunk
    return buf
