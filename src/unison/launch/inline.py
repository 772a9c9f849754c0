"""Worker 0 inside the controller: ``Session(n, inline_worker0=True)``, opt-in.

    sess.call(f)  -> the entry goes into the command ring (workers 1..n-1 start on it)
                  -> pump(): worker 0's loop, run by the calling thread, takes every entry
                     there is for it now, runs it, and returns; its replies go into its reply
                     ring, read by the controller as any worker's

Workers 1..n-1 are local processes as always (LocalLauncher). Worker 0 speaks the same
protocol over the same shared memory, so every result, free and error is handled exactly as
for a process; what goes is one process on the cores. On 2 cores with N=2, three busy
processes become two, and the round trip stops sharing a core (Disco runs its worker 0 in
the controller for the same reason; docs/benchmarks.md has the figures). It pays only there:
with a core to spare (N=1 on 2 cores) worker 0's share runs after the controller's work
instead of beside it, and with N+1 well above the cores one process fewer changes little.

What worker 0 gives up, and why it is opt-in (docs/architecture.md):

* its failure isolation: a crash, ``os._exit`` or a hang in worker 0's code is the
  controller's; an exception is still that call's error, as on any worker. Its
  collectives' waits for peers watch the peers' pids, and give up at the sending call's
  deadline (a stopped peer would hold the controller otherwise), or with hang_timeout
  once the peers made no progress for that long (the wait for the others then ends in
  HangError: about twice hang_timeout in all);
* its calls run synchronously, in the thread that sends them (``call`` returns once worker
  0's share is done, the others' may still run). A call on worker 0 that waits for a later
  call (a recv in one call, its send in the next) never returns: put both in one call;
* nothing of worker 0 is left to cancel once ``call`` returns its Ref (its share is done;
  the board never signals the controller); ``sess.stacks()`` points to the controller's
  own stack; its output is the controller's, not prefixed;
* per-worker ``env`` and ``cpu_affinity`` cannot be given for it (they are the controller's);
* Ctrl-C in its call is Ctrl-C in the controller: KeyboardInterrupt, the session closed.

One such session per process at a time: worker 0's registers and identity are the
``unison.worker`` module's, as in a worker process (its identity only while it runs what
it was sent: ``unison.rank()`` elsewhere in the controller raises, as without a session).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from unison import collective, protocol, worker
from unison.cancel import Board
from unison.channel.shm import ShmChannel, ShmWorkerChannel
from unison.launch import DeathReport, Launcher
from unison.protocol import OK
from unison.spec import WorkerSpec

if TYPE_CHECKING:
    from unison.debug.hang import Watchdog

__all__ = ["InlineLauncher"]

_taken = threading.Lock()
"""Held while an inline worker 0 lives in this process."""


class InlineLauncher(Launcher):
    """Worker 0 in this process, the others from ``rest`` (a LocalLauncher)."""

    def __init__(self, rest: Launcher, chan: ShmChannel) -> None:
        if not _taken.acquire(blocking=False):
            raise RuntimeError(
                "another Session(inline_worker0=True) is open in this process: worker 0's "
                "registers are this process's, so only one session at a time can run it "
                "inline. Close that one first, or leave inline_worker0 off here")
        self._held = True
        self._rest = rest
        self._chan = chan
        self._worker: _InlineWorker | None = None
        self._lock = threading.RLock()  # pump() from several threads: one loop at a time
        self._pumping = 0  # the thread inside worker 0's call, if any (stop() leaves the
        # end of worker 0 to it: a signal handler's close in its call, or another thread's)
        self._closing = False

    def start(self, specs: Sequence[WorkerSpec], env: Mapping[int, Mapping[str, str]]) -> None:
        try:
            if env.get(0) or specs[0].cpus:
                raise ValueError(
                    "worker 0 runs inline in the controller: it has the controller's "
                    "environment and CPUs, so env[0] and cpu_affinity for rank 0 cannot be "
                    "given (set them on the controller's process)")
            self._worker = _InlineWorker(specs[0], self._chan)
            self._rest.start_deadline = self.start_deadline
            self._rest.start(specs[1:], env)
        except BaseException:
            self.stop(0)
            raise

    def check_free(self) -> None:
        """Raise RuntimeError where this thread is inside worker 0's call (code that
        interrupted it, a signal handler, makes a call): worker 0 could not run another
        until that one ends. The session asks before it sends anything (under its send
        lock, which only this thread may then hold), so the workers never see that call."""
        if self._pumping == threading.get_ident():  # (another thread's call: a sync
            raise RuntimeError(  # from here waits for it)
                "worker 0 runs inline in this thread, where it is in the middle of a call "
                "(this code interrupted it: a signal handler?), so it cannot run another: "
                "nothing was sent. Leave inline_worker0 off to use the session from a signal "
                "handler (close() works either way)")

    def pump(self, deadline: float | None = None) -> None:
        """Run what the ring holds for worker 0 now (after every send). ``deadline``: the
        sending call's, where its collectives give up waiting for peers (a stopped or stuck
        one would otherwise hold the controller past it)."""
        with self._lock:
            self.check_free()  # (the session asked before it sent: never raises here)
            self._pumping = threading.get_ident()
            try:
                if self._worker is not None:
                    self._worker.pump(deadline)
            finally:
                self._pumping = 0
                if self._closing:  # stop() came during worker 0's call (below)
                    self._end(run_rest=False)

    def watch_hangs(self, watchdog: Watchdog) -> None:
        """Session(hang_timeout=...): worker 0's collectives give up on peers that make no
        progress for that long (its waits run in the controller's thread, where no
        controller wait samples them)."""
        coll = self._worker._coll if self._worker is not None else None
        if coll is not None:
            coll.hang = lambda key, peers: _report(watchdog.stuck(("inline", key),
                                                                  lambda: peers))

    def in_call_elsewhere(self) -> bool:
        """Whether another thread is inside worker 0's call now."""
        return self._pumping not in (0, threading.get_ident())

    def watch_fds(self) -> list[int]:
        return self._rest.watch_fds()

    def ended(self) -> int | None:
        return self._rest.ended()

    def death(self, rank: int, grace: float) -> DeathReport:
        if rank == 0:  # a death nobody can name (a broken channel) falls on rank 0
            return DeathReport(0, None, "", "worker 0 runs inline in the controller")
        return self._rest.death(rank, grace)

    def describe(self, rank: int) -> str:
        return "inline in the controller" if rank == 0 else self._rest.describe(rank)

    def stop(self, grace: float) -> None:
        try:
            self._rest.stop(grace)
        finally:
            self._stop_worker_0()

    def _stop_worker_0(self) -> None:
        """Close worker 0 now, unless a thread is inside its call (this one: a signal
        handler's close; or another): pump closes it once that call returns, so a close
        never waits for as long as worker 0's call runs."""
        self._closing = True  # set before _pumping is read: pump reads them the other way
        # round, so one of the two sees the other's
        while not self._lock.acquire(timeout=0.01):
            if self._pumping:  # another thread is inside worker 0's call
                return
        try:
            if self._pumping != threading.get_ident():
                self._end(run_rest=True)
        finally:
            self._lock.release()

    def _end(self, run_rest: bool) -> None:
        """Close worker 0 (caller holds the lock); ``run_rest``: what the ring still holds
        for it first, while the controller's channel is open to read its replies."""
        inline, self._worker = self._worker, None
        try:
            if inline is not None:
                inline.close(run_rest)
        finally:
            if self._held:
                self._held = False
                _taken.release()


class _InlineWorker:
    """Worker 0's side, set up as ``worker.run`` sets up a process (identity, collectives,
    cancellation board, channel), on duplicates of the session's fds: its own to close."""

    def __init__(self, spec: WorkerSpec, chan: ShmChannel) -> None:
        self._fds = [os.dup(fd) for fd in spec.fds]
        try:
            spec = spec.with_fds(self._fds)
            # unison.rank() and friends answer inside worker 0's calls only (pump sets them):
            # elsewhere in the controller they raise, as in any process that is no worker
            self._identity = dict(
                rank=spec.rank, world_size=spec.world_size, group=spec.group,
                group_rank=spec.group_rank, group_size=spec.group_size)
            # its collectives run in the controller's thread, so no controller wait sees a
            # peer die and sets the abort flag: they watch the peers' pids themselves
            self._coll = collective.setup(spec.collective, spec.rank, spec.world_size,
                                          spec.num_groups, worker._current, watch_peers=True)
            self._board = Board(spec.world_size, fd=spec.cancel) if spec.cancel >= 0 else None
            self._chan = ShmWorkerChannel(spec.channel)
            self._own_reply_fd = spec.channel["reply_arena"]  # its Arena closes that one
            self._chan.make_room = chan.absorber()
            self._loop = worker.Loop()
            self._chan.reply(protocol.dumps((protocol.READY_REQ, OK, os.getpid())))
        except BaseException:
            self._forget()
            for fd in self._fds:
                os.close(fd)
            raise

    def pump(self, deadline: float | None = None) -> None:
        if self._coll is not None:
            self._coll.give_up_at = deadline
        worker._identity.update(self._identity)
        try:
            worker.serve(self._chan, self._coll, self._board, self._loop, self._chan.poll,
                         interrupts=True)
        except BaseException:
            with contextlib.suppress(Exception):  # (what escaped is the error to raise)
                self._chan.settle()  # or a sync with no timeout would wait for it for ever
            raise
        finally:
            worker._identity.clear()
            if self._coll is not None:
                self._coll.give_up_at = None

    def close(self, run_rest: bool = True) -> None:
        """Run what is left (SHUTDOWN answers with the unreported errors), then let go."""
        try:
            if run_rest:
                self.pump()
        finally:
            self._chan.release()
            if self._board is not None:
                self._board.close()
            self._forget()
            for fd in self._fds:
                if fd != self._own_reply_fd:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    @staticmethod
    def _forget() -> None:
        worker.registers.clear()
        worker._identity.clear()
        collective.teardown()


def _report(stuck: tuple[list[int], str] | None) -> str | None:
    return None if stuck is None else stuck[1]
