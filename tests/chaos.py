"""A seeded chaos loop: random operations on real sessions, with random faults injected.

    python tests/chaos.py --rounds 5000 --seed 1 [--channels shm,pipe,inline]

("inline": shared memory with worker 0 inside the controller, Session(inline_worker0=True);
its faults strike the worker processes only.)

Each round draws one step from the seed's generator and checks its outcome:

    operation (call, run, put (one array or two), scatter, get, gather, collective, free,
               await, cancel, await abandoned by wait_for, sync, session closed and opened
               again)
        -> the result equals what a model of the workers' registers says it must, exactly
    fault     (SIGKILL or SIGSTOP of a worker, a worker that exits by itself, an exception
               in a worker or while pickling its result, a rank that leaves a collective,
               Ctrl-C in the controller, SIGKILL of a controller in a subprocess)
        -> the right error (type, worker named) within the fault's bound, and the session
           goes on where unison promises it does (docs/reliability.md)

After every round, nothing is left behind: the controller's fds, memfds, threads and child
processes return to what they were with the same session open (or, with none open, to what
they were before the first), and each worker's register file holds exactly the Refs alive
at the controller. A round that breaks a rule raises ChaosFailure naming the seed and round,
so ``--seed S --rounds R`` replays it. tests/test_chaos.py runs it in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import psutil

import unison

DEATH_BOUND = 2.0
"""Seconds within which a dead worker must be a WorkerDied at the controller."""
INTERRUPT_BOUND = 1.0
"""Seconds within which Ctrl-C must reach the caller of a wait."""
LEAK_GRACE = 3.0
"""Seconds a closed session's threads and processes get to end before they count as left."""
OP_TIMEOUT = 20.0
"""The bound of a healthy operation: a wait longer than this is a hang (a TimeoutError)."""


class ChaosFailure(AssertionError):
    """A round broke a rule: the message names the seed, the round and the step."""


# What the workers run. Module-level, so that they pickle by reference from tests/ (and by
# value when this file runs as a script).

def affine(x: int) -> int:
    return x * 10 + unison.rank()


def affine_of(xs: tuple[int, list[int]]) -> int:
    """``affine`` of a container: the CALL carries it as plain values too."""
    return affine(xs[0] + sum(xs[1]))


def plus_one(value: Any) -> Any:
    return value + 1


def slow_value(seconds: float, value: int, skip_pid: int = 0) -> int:
    """Sleep, then ``value``; not in process ``skip_pid`` (the chaos controller: worker 0
    inline there would hold the controller for the whole sleep)."""
    if os.getpid() != skip_pid:
        time.sleep(seconds)
    return value


def session_kw(channel: str) -> dict[str, Any]:
    """Session keywords for a drawn "channel": "inline" is shm with worker 0 inline."""
    return {"inline_worker0": True} if channel == "inline" else {"channel": channel}


def raise_on(rank: int, value: int) -> int:
    if unison.rank() == rank:
        raise ValueError(f"chaos: raised on purpose by worker {rank}")
    return value


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise RuntimeError("chaos: this result refuses to be pickled")


def unpicklable_on(rank: int, value: int) -> Any:
    return _Unpicklable() if unison.rank() == rank else value


def exit_on(rank: int, code: int) -> int:
    if unison.rank() == rank:
        os._exit(code)
    return 0


def allreduce_of(x: int) -> Any:
    return unison.allreduce(np.array([x + unison.rank()], dtype=np.int64))


def allgather_of(x: int) -> Any:
    return unison.allgather(x * 100 + unison.rank())


def leave_collective(rank: int, x: int) -> Any:
    if unison.rank() == rank:
        raise ValueError(f"chaos: worker {rank} left before the allreduce")
    return unison.allreduce(np.array([x], dtype=np.int64))


def register_count() -> int:
    from unison import worker

    return len(worker.registers)


def worker_pid() -> int:
    return os.getpid()


# The state the checks compare with.

@dataclasses.dataclass
class Held:
    """A Ref the controller holds, with what each of its workers must return."""

    ref: unison.Ref
    expected: list[Any]
    failed: bool = False  # its fetch must raise (a failed call)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What the controller process holds at one moment."""

    fds: frozenset[tuple[int, str]]
    threads: frozenset[int]
    children: frozenset[int]

    @classmethod
    def now(cls) -> Snapshot:
        fds = set()
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                fds.add((int(name), os.readlink(f"/proc/self/fd/{name}")))
        children = set()
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if child.status() != psutil.STATUS_ZOMBIE:
                    children.add(child.pid)
        threads = {t.ident or 0 for t in threading.enumerate() if t.is_alive()}
        return cls(frozenset(fds), frozenset(threads), frozenset(children))

    def beyond(self, base: Snapshot, exempt: set[int]) -> list[str]:
        """What is held now and was not in ``base``, in words (but ``exempt`` processes)."""
        out = [f"fd {fd} -> {target}" for fd, target in sorted(self.fds - base.fds)
               if not target.startswith("/proc/")]  # listdir's own fd
        names = {t.ident: t.name for t in threading.enumerate()}
        out += [f"thread {names.get(t, t)}" for t in sorted(self.threads - base.threads)]
        out += [f"process {p} {_cmdline(p)}"
                for p in sorted(self.children - base.children - exempt)]
        return out


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:120]
    except psutil.Error:
        return "(gone)"


def memfds() -> int:
    """The controller's open memfds made by unison."""
    n = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:unison"):
                n += 1
    return n


@dataclasses.dataclass
class Tally:
    """What a run did: steps by name, and the time each fault took to become an error."""

    steps: dict[str, int] = dataclasses.field(default_factory=dict)
    error_times: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    sessions: int = 0

    def step(self, name: str) -> None:
        self.steps[name] = self.steps.get(name, 0) + 1

    def took(self, fault: str, seconds: float) -> None:
        self.error_times.setdefault(fault, []).append(seconds)


class Chaos:
    """One seeded run. ``make_session(n, channel)`` opens the sessions (tests pass their own
    to use a shared Ray cluster); ``channels`` are the channels drawn from."""

    def __init__(self, seed: int, *, channels: tuple[str, ...] = ("shm", "pipe", "inline"),
                 max_workers: int = 3, make_session: Callable[..., unison.Session] | None = None,
                 controller_kills: bool = True, can_cancel: bool = True,
                 exempt: Callable[[], set[int]] = set) -> None:
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.channels = channels
        self.max_workers = max_workers
        self._make = make_session or (lambda n, ch: unison.Session(n, **session_kw(ch)))
        self.controller_kills = controller_kills
        self.can_cancel = can_cancel
        self.exempt = exempt  # processes that come and go beside us (a Ray cluster's)
        self.sess: unison.Session | None = None
        self.held: dict[int, Held] = {}
        self.pids: list[int] = []
        self.round = 0
        self.what = ""
        self.tally = Tally()
        self._next = 0
        self.base = Snapshot.now()
        self.open_base = self.base

    # -- the loop ---------------------------------------------------------------------------

    def run(self, rounds: int, time_limit: float | None = None) -> Tally:
        """``rounds`` rounds (fewer if ``time_limit`` seconds pass first: the count done is
        in the tally)."""
        start = time.monotonic()
        try:
            for self.round in range(rounds):
                if time_limit is not None and time.monotonic() - start > time_limit:
                    break
                self.one_round()
            self.close_session()
            self.check_left(self.base, "after the last session closed")
        finally:
            if self.sess is not None:
                self.sess.close(timeout=0)
        return self.tally

    def one_round(self) -> None:
        if self.sess is None:
            self.open_session()
        steps = self._steps()
        names = list(steps)
        weights = np.array([steps[n][0] for n in names], dtype=float)
        name = names[int(self.rng.choice(len(names), p=weights / weights.sum()))]
        self.what = name
        self.tally.step(name)
        try:
            steps[name][1]()
        except ChaosFailure:
            raise
        except Exception as exc:  # an error no rule allows: say where, to replay it
            self.fail(f"{type(exc).__name__}: {exc}")
        if self.sess is not None:
            self.check_registers()
            self.check_left(self.open_base, "with the session open")
        else:
            self.check_left(self.base, "with no session open")

    def _steps(self) -> dict[str, tuple[float, Callable[[], None]]]:
        """Each step with its weight: mostly operations, about one fault in six."""
        steps: dict[str, tuple[float, Callable[[], None]]] = {
            "call": (8, self.op_call), "run": (8, self.op_run), "put": (5, self.op_put),
            "put a pair": (2, self.op_put_pair), "scatter": (4, self.op_scatter),
            "gather": (8, self.op_gather),
            "get": (4, self.op_get), "call on a Ref": (4, self.op_call_on_ref),
            "allreduce": (4, self.op_allreduce), "allgather": (3, self.op_allgather),
            "free": (6, self.op_free), "await": (4, self.op_await),
            "await abandoned": (2, self.op_abandoned), "sync": (3, self.op_sync),
            "reopen": (2, self.op_reopen),
            "SIGKILL a worker": (2, self.fault_kill),
            "SIGKILL in a call": (2, self.fault_kill_busy),
            "SIGSTOP a worker": (2, self.fault_stop), "worker exits": (1.5, self.fault_exit),
            "exception in a worker": (2.5, self.fault_raise),
            "exception pickling a result": (2, self.fault_unpicklable),
            "a rank leaves a collective": (1.5, self.fault_leave_collective),
            "Ctrl-C in the controller": (1, self.fault_interrupt),
        }
        if self.can_cancel:
            steps["cancel"] = (2, self.op_cancel)
        if self.controller_kills:
            steps["SIGKILL the controller"] = (1, self.fault_kill_controller)
        return steps

    # -- sessions ---------------------------------------------------------------------------

    def open_session(self) -> None:
        n = int(self.rng.integers(1, self.max_workers + 1))
        channel = self.channels[int(self.rng.integers(len(self.channels)))]
        if channel == "inline":  # worker 0 in this process, and at least one process
            n = max(n, 2)
        self.what = f"opening Session({n}, {session_kw(channel)})"
        self.sess = self._make(n, channel)
        self.tally.sessions += 1
        self.pids = self.sess.run(worker_pid, timeout=OP_TIMEOUT)
        # Everything a session opens lazily, opened once before its baseline is taken.
        self.sess.run(allreduce_of, 0, timeout=OP_TIMEOUT)
        asyncio.run(self._awaited(self.sess.call(affine, 0)))
        self.sess.sync(timeout=OP_TIMEOUT)
        self.open_base = self.settled_snapshot()

    def close_session(self, *, dead: bool = False) -> None:
        """Close the session (it may have closed itself); its workers must be gone within
        the leak grace."""
        if self.sess is None:
            return
        sess, pids = self.sess, self.pids
        self.sess, self.held, self.pids = None, {}, []
        if dead:
            sess.close(timeout=0)
        else:
            with warnings_as_errors():
                sess.close()
        left = _wait_gone([p for p in pids if p != os.getpid()], LEAK_GRACE)  # (not
        if left:  # worker 0 inline: that is us)
            self.fail(f"workers {left} outlived their session's close()")

    def op_reopen(self) -> None:
        self.close_session()

    # -- operations -------------------------------------------------------------------------

    def _workers(self) -> list[int]:
        assert self.sess is not None
        return list(self.sess.workers)

    def _value(self) -> int:
        return int(self.rng.integers(-1000, 1000))

    def _keep(self, ref: unison.Ref, expected: list[Any], failed: bool = False) -> None:
        self._next += 1
        self.held[self._next] = Held(ref, expected, failed)

    def _pick(self, *, healthy: bool = True) -> tuple[int, Held] | None:
        keys = [k for k, h in self.held.items() if not (healthy and h.failed)]
        if not keys:
            return None
        key = keys[int(self.rng.integers(len(keys)))]
        return key, self.held[key]

    def op_call(self) -> None:
        assert self.sess is not None
        x = self._value()
        how = int(self.rng.integers(4))  # by position, by keyword, inside a container,
        ref = (self.sess.call(affine, x) if how == 0 else self.sess.call(affine, x=x)  # numpy
               if how == 1 else self.sess.call(affine_of, (x - 1, [1])) if how == 2
               else self.sess.call(affine, np.int64(x)))  # (its result numpy's too)
        self._keep(ref, [x * 10 + r for r in self._workers()])

    def op_run(self) -> None:
        assert self.sess is not None
        x = self._value()
        self.expect_equal(self.sess.run(affine, x, timeout=OP_TIMEOUT),
                          [x * 10 + r for r in self._workers()])

    def op_put(self) -> None:
        assert self.sess is not None
        size = int(self.rng.choice([1, 100, 10_000, 300_000]))  # small, and past the ring
        value = np.arange(size, dtype=np.int64) * self._value()
        self._keep(self.sess.put(value), [value] * len(self._workers()))

    def op_put_pair(self) -> None:
        """Two arrays in one message: each on its own block (two buffers once landed on one,
        when no free block of their size was left)."""
        assert self.sess is not None
        size = int(self.rng.choice([10_000, 300_000]))
        x = self._value()
        value = (np.full(size, x, dtype=np.int64), np.full(size, x + 1, dtype=np.int64))
        self._keep(self.sess.put(value), [value] * len(self._workers()))

    def op_scatter(self) -> None:
        assert self.sess is not None
        values = [self._value() for _ in self._workers()]
        self._keep(self.sess.scatter(values), values)

    def op_gather(self) -> None:
        picked = self._pick()
        if picked is None:
            return self.op_call()
        self.expect_equal(picked[1].ref.gather(timeout=OP_TIMEOUT), picked[1].expected)

    def op_get(self) -> None:
        picked = self._pick()
        if picked is None:
            return self.op_call()
        held = picked[1]
        i = int(self.rng.integers(len(held.ref.workers)))
        self.expect_equal([held.ref.get(held.ref.workers[i], timeout=OP_TIMEOUT)],
                          [held.expected[i]])

    def op_call_on_ref(self) -> None:
        assert self.sess is not None
        picked = self._pick()
        if (picked is None or len(picked[1].ref.workers) != len(self._workers())
                or isinstance(picked[1].expected[0], tuple)):
            return self.op_call()
        held = picked[1]
        ref = (self.sess.call(plus_one, value=held.ref) if self.rng.integers(2)
               else self.sess.call(plus_one, held.ref))  # by keyword, or by position
        self._keep(ref, [v + 1 for v in held.expected])

    def op_allreduce(self) -> None:
        assert self.sess is not None
        x = self._value()
        total = sum(x + r for r in self._workers())
        got = self.sess.run(allreduce_of, x, timeout=OP_TIMEOUT)
        self.expect_equal([int(v[0]) for v in got], [total] * len(got))

    def op_allgather(self) -> None:
        assert self.sess is not None
        x = self._value()
        every = [x * 100 + r for r in self._workers()]
        self.expect_equal(self.sess.run(allgather_of, x, timeout=OP_TIMEOUT),
                          [every] * len(every))

    def op_free(self) -> None:
        picked = self._pick(healthy=False)
        if picked is None:
            return
        key, held = picked
        del self.held[key]
        held.ref.free()

    def op_sync(self) -> None:
        assert self.sess is not None
        self.sess.sync(timeout=OP_TIMEOUT)

    async def _awaited(self, ref: unison.Ref) -> list[Any]:
        return await asyncio.wait_for(ref.gather_async(), OP_TIMEOUT)

    def op_await(self) -> None:
        assert self.sess is not None
        sess = self.sess
        x = self._value()

        async def both() -> tuple[list[Any], list[Any]]:
            ref = sess.call(affine, x)
            return await self._awaited(ref), await sess.run_async(affine, x + 1,
                                                                   timeout=OP_TIMEOUT)

        got = asyncio.run(both())
        self.expect_equal(got[0], [x * 10 + r for r in self._workers()])
        self.expect_equal(got[1], [(x + 1) * 10 + r for r in self._workers()])

    def op_abandoned(self) -> None:
        """``asyncio.wait_for`` gives up on a slow call: only the wait is abandoned, and the
        Ref gives the right values later."""
        assert self.sess is not None
        x = self._value()
        ref = self.sess.call(slow_value, 0.2, x, os.getpid())

        async def impatient() -> None:
            await asyncio.wait_for(ref.gather_async(), 0.01)

        try:
            asyncio.run(impatient())
        except asyncio.TimeoutError:  # TimeoutError from Python 3.11 on; its own class before
            pass
        else:
            self.fail("a 10 ms wait_for around a 200 ms call did not time out")
        self._keep(ref, [x] * len(self._workers()))

    def op_cancel(self) -> None:
        assert self.sess is not None
        ref = self.sess.call(slow_value, 30.0, 0, os.getpid())
        time.sleep(float(self.rng.choice([0.0, 0.05])))  # queued, or running
        started = time.monotonic()
        ref.cancel(timeout=DEATH_BOUND)
        self.within(started, DEATH_BOUND, "cancel")
        try:
            ref.gather(timeout=OP_TIMEOUT)
        except unison.CancelledError:
            pass
        else:
            self.fail("a cancelled call's Ref gave values")
        ref.free()

    # -- faults -----------------------------------------------------------------------------

    def _victim(self) -> tuple[int, int]:
        """A worker process to kill or stop (never worker 0 inline in this process)."""
        procs = [r for r, pid in enumerate(self.pids) if pid != os.getpid()]
        rank = procs[int(self.rng.integers(len(procs)))]
        return rank, self.pids[rank]

    def _expect_death(self, action: Callable[[], Any], rank: int, started: float,
                      fault: str) -> None:
        """``action`` must raise WorkerDied naming ``rank`` within DEATH_BOUND of
        ``started``; then the session is closed for good."""
        assert self.sess is not None
        try:
            action()
        except unison.WorkerDied as exc:
            self.within(started, DEATH_BOUND, fault)
            if exc.worker != rank:
                self.fail(f"WorkerDied named worker {exc.worker}, not {rank}: {exc}")
        else:
            self.fail(f"{fault}: worker {rank} died and the next wait returned")
        try:
            self.sess.run(affine, 1, timeout=OP_TIMEOUT)
        except unison.SessionClosed:
            pass
        else:
            self.fail("a session whose worker died still ran calls")
        self.close_session(dead=True)

    def fault_kill(self) -> None:
        assert self.sess is not None
        sess = self.sess
        rank, pid = self._victim()
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        self._expect_death(lambda: sess.run(affine, 1, timeout=OP_TIMEOUT), rank, started,
                           "SIGKILL")

    def fault_kill_busy(self) -> None:
        assert self.sess is not None
        ref = self.sess.call(slow_value, 30.0, 0, os.getpid())
        rank, pid = self._victim()
        time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        self._expect_death(lambda: ref.gather(timeout=OP_TIMEOUT), rank, started,
                           "SIGKILL in a call")

    def fault_exit(self) -> None:
        assert self.sess is not None
        sess = self.sess
        rank, _ = self._victim()
        code = int(self.rng.integers(1, 100))
        started = time.monotonic()

        def act() -> None:
            try:
                sess.run(exit_on, rank, code, timeout=OP_TIMEOUT)
            except unison.WorkerDied as exc:
                if exc.exitcode != code:
                    self.fail(f"worker exited with {code}, WorkerDied says {exc.exitcode}")
                raise

        self._expect_death(act, rank, started, "worker exits")

    def fault_stop(self) -> None:
        """A stopped worker: a wait with a timeout raises TimeoutError at the timeout; once
        it runs again, the session goes on and no late reply is taken for another call."""
        assert self.sess is not None
        rank, pid = self._victim()
        x = self._value()
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        try:
            self.sess.run(affine, x, timeout=0.3)
        except TimeoutError:
            self.within(started, 0.3 + DEATH_BOUND, "SIGSTOP")
        else:
            self.fail(f"worker {rank} was stopped and a run with timeout=0.3 returned")
        finally:
            os.kill(pid, signal.SIGCONT)
        self.sess.sync(timeout=OP_TIMEOUT)
        self.op_run()

    def fault_raise(self) -> None:
        assert self.sess is not None
        rank = int(self.rng.integers(len(self.pids)))
        x = self._value()
        ref = self.sess.call(raise_on, rank, x)
        try:
            ref.gather(timeout=OP_TIMEOUT)
        except unison.WorkerError as exc:
            if not isinstance(exc.__cause__, ValueError) or "on purpose" not in str(exc.__cause__):
                self.fail(f"WorkerError without the worker's ValueError: {exc!r}")
        else:
            self.fail("a call that raised on a worker gathered values")
        others = [r for r in self._workers() if r != rank]
        if others:
            self.expect_equal([ref.get(others[0], timeout=OP_TIMEOUT)], [x])
        ref.free()
        self.op_run()

    def fault_unpicklable(self) -> None:
        assert self.sess is not None
        rank = int(self.rng.integers(len(self.pids)))
        try:
            self.sess.run(unpicklable_on, rank, 1, timeout=OP_TIMEOUT)
        except unison.WorkerError as exc:
            if "refuses to be pickled" not in f"{exc} {exc.__cause__}":
                self.fail(f"WorkerError does not say why: {exc!r}")
        else:
            self.fail("a result that cannot be pickled came back")
        self.op_run()

    def fault_leave_collective(self) -> None:
        """One rank raises instead of entering an allreduce: every rank errs, nobody hangs,
        the session goes on."""
        assert self.sess is not None
        if len(self.pids) < 2:
            return self.fault_raise()
        rank = int(self.rng.integers(len(self.pids)))
        started = time.monotonic()
        try:
            self.sess.run(leave_collective, rank, 1, timeout=OP_TIMEOUT)
        except unison.WorkerError:
            self.within(started, DEATH_BOUND, "a rank leaves a collective")
        else:
            self.fail("an allreduce that one rank never entered returned")
        self.op_allreduce()

    def fault_interrupt(self) -> None:
        """Ctrl-C while the controller waits: KeyboardInterrupt at once, the workers
        stopped, the session closed."""
        assert self.sess is not None
        sess = self.sess
        main = threading.get_ident()
        timer = threading.Timer(0.05, signal.pthread_kill, (main, signal.SIGINT))
        started = time.monotonic()
        try:
            timer.start()
            sess.run(slow_value, 30.0, 0)
        except KeyboardInterrupt:
            self.within(started, 0.05 + INTERRUPT_BOUND, "Ctrl-C")
        else:
            self.fail("Ctrl-C during a run did not interrupt it")
        finally:
            timer.join()
        if not sess.closed:
            self.fail("the session stayed open after Ctrl-C")
        self.close_session(dead=True)

    def fault_kill_controller(self) -> None:
        """A controller in a subprocess is SIGKILLed: its workers end within the bound."""
        n = int(self.rng.integers(1, self.max_workers + 1))
        channel = self.channels[int(self.rng.integers(len(self.channels)))]
        if channel not in ("shm", "pipe", "inline"):
            channel = "auto"
        code = textwrap.dedent(f"""
            import os, sys, time, unison
            sess = unison.Session({n}, **{session_kw(channel)!r})
            print(*sess.run(os.getpid), flush=True)
            ref = sess.call(time.sleep, {float(self.rng.choice([0.0, 30.0]))})
            time.sleep(60)
        """)
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                stderr=subprocess.DEVNULL)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            pids = [int(p) for p in line.split()]
            if len(pids) != n:
                self.fail(f"the controller subprocess printed {line!r}")
            proc.kill()
            proc.wait()
            started = time.monotonic()
            left = _wait_gone(pids, DEATH_BOUND + 1.0)
            if left:
                self.fail(f"workers {left} outlived their SIGKILLed controller")
            self.tally.took("SIGKILL the controller", time.monotonic() - started)
        finally:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    # -- checks -----------------------------------------------------------------------------

    def fail(self, why: str) -> None:
        raise ChaosFailure(f"seed {self.seed}, round {self.round}, {self.what}: {why}")

    def expect_equal(self, got: list[Any], expected: list[Any]) -> None:
        if len(got) != len(expected) or not all(_same(g, e) for g, e in zip(got, expected)):
            self.fail(f"wrong result: got {_short(got)}, expected {_short(expected)}")

    def within(self, started: float, bound: float, fault: str) -> None:
        took = time.monotonic() - started
        self.tally.took(fault, took)
        if took > bound:
            self.fail(f"the error came after {took:.2f} s, over the {bound} s bound")

    def check_registers(self) -> None:
        """Each worker holds exactly the Refs the controller holds on it: nothing lost, and
        nothing kept after a free (frees ride on this very call)."""
        assert self.sess is not None
        counts = self.sess.run(register_count, timeout=OP_TIMEOUT)
        for rank, count in zip(self._workers(), counts):
            held = sum(rank in h.ref.workers for h in self.held.values())
            if count != held:
                self.fail(f"worker {rank} holds {count} objects; the controller holds "
                          f"{held} Refs on it")

    def settled_snapshot(self) -> Snapshot:
        """A snapshot once the threads and processes that are ending have ended."""
        last = Snapshot.now()
        deadline = time.monotonic() + LEAK_GRACE
        while time.monotonic() < deadline:
            time.sleep(0.02)
            now = Snapshot.now()
            if now == last:
                return now
            last = now
        return last

    def check_left(self, base: Snapshot, when: str) -> None:
        deadline = time.monotonic() + LEAK_GRACE
        while True:
            extra = Snapshot.now().beyond(base, self.exempt())
            if not extra:
                return
            if time.monotonic() > deadline:
                self.fail(f"left behind {when}: {'; '.join(extra)}")
            time.sleep(0.02)


@contextlib.contextmanager
def warnings_as_errors() -> Iterator[None]:
    """A clean close warns of nothing (an unreported error would be a lost one)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def _same(got: Any, expected: Any) -> bool:
    if isinstance(expected, np.ndarray):
        return isinstance(got, np.ndarray) and np.array_equal(got, expected)
    if isinstance(expected, tuple):
        return (isinstance(got, tuple) and len(got) == len(expected)
                and all(_same(g, e) for g, e in zip(got, expected)))
    return bool(got == expected)


def _short(values: list[Any]) -> str:
    text = repr([v.tolist()[:4] if isinstance(v, np.ndarray) else v for v in values])
    return text if len(text) < 200 else text[:200] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--channels", default="shm,pipe,inline")
    parser.add_argument("--max-workers", type=int, default=3)
    args = parser.parse_args(argv)
    started = time.monotonic()
    chaos = Chaos(args.seed, channels=tuple(args.channels.split(",")),
                  max_workers=args.max_workers)
    tally = chaos.run(args.rounds)
    took = time.monotonic() - started
    print(f"seed {args.seed}: {args.rounds} rounds, {tally.sessions} sessions in {took:.1f} s, "
          f"every round right and nothing left behind")
    for name, count in sorted(tally.steps.items(), key=lambda kv: -kv[1]):
        print(f"  {count:6d}  {name}")
    print("time from fault to error (s): fault, count, median, max")
    for name, times in sorted(tally.error_times.items()):
        print(f"  {name}: {len(times)}, {np.median(times):.3f}, {max(times):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
