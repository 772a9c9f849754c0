"""Dynamic batching in the event loop, and the workers' lifecycle behind it.

    submit(texts, tokens)  -> a Job (its rows, a future) at the queue's tail, at once:
                              429 when the queue's inputs would pass --max-queue,
                              503 while the model is starting, degraded or stopping
    the batch task         waits up to the window (from the oldest job's arrival) or until
                           --max-batch inputs wait, takes rows from the head (a large request
                           spans batches), awaits backend.embed (one batch in flight: the next
                           one gathers meanwhile), and scatters each job's rows into its array
    a worker dies          the batch in flight and every queued job fail with 503 at once;
                           health is "degraded" while a new backend loads on a thread (the loop
                           keeps answering); its time is measured (metric and log line)
    stop()                 no new jobs; the queue drains; the backend is closed

Why one batch in flight: the model is the bottleneck, so the next batch grows while this one
computes (large batches at saturation, no wait when idle), and a death fails one batch.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

import unison
from unison.serve.backends import Backend
from unison.serve.metrics import Metrics
from unison.serve.schema import APIError

__all__ = ["Batcher", "Job"]

log = logging.getLogger("unison.serve")

IDLE_LOOK = 1.0
"""Seconds between cheap looks (no message) at the workers while no batch is in flight, so
that a death between requests turns health "degraded" then, not at the next request. Each
worker's pidfd wakes the batcher at its death at once (``_watch``): the look is for where
there is none. Every 0.2 s, with uvicorn's own tick, it held an idle server at 0.37-0.39% of
a core, now 0.25-0.27% (python benchmarks/idle_cpu.py --modes serve; an audit of idle CPU,
issue 9, forty-eighth pass)."""


WAKE_CHUNK = 8
"""Requests whose rows are done are woken this many at a time, with a turn of the event loop
between: each then writes its reply, and the clients' next requests come in, as a burst the
size of a batch. In chunks, a /health that arrives meanwhile waits for one chunk's work, not
for a whole batch's (at 128 clients, a batch of 64 replies and 64 new requests is tens of
milliseconds of loop time on a busy core)."""


@dataclass(eq=False)
class Job:
    """One request's inputs, the rows computed so far, and the future its handler awaits."""

    texts: Sequence[str]
    tokens: Sequence[Sequence[int]]
    future: asyncio.Future[np.ndarray]
    arrived: float
    out: np.ndarray
    sent: int = 0
    """Rows handed to batches so far (the rest wait in the queue)."""
    filled: int = 0

    def __len__(self) -> int:
        return len(self.texts)


def unavailable(state: str, retry_after: int = 1) -> APIError:
    reasons = {
        "starting": "the model is loading; try again in a few seconds",
        "degraded": "a worker died and the model is being reloaded; try again shortly",
        "stopping": "the server is shutting down",
    }
    return APIError(503, reasons.get(state, f"the model is {state}"), kind="server_error",
                    code=f"model_{state}", headers={"Retry-After": str(retry_after)})


class Batcher:
    """Batches requests for one backend, replacing it when one of its workers dies."""

    def __init__(self, load: Callable[[], Backend], *, hidden: int, max_batch: int,
                 window: float, max_queue: int, metrics: Metrics,
                 batch_timeout: float = 60.0) -> None:
        if max_batch < 1 or max_queue < 1 or not 0 <= window < math.inf or not (
                0 < batch_timeout < math.inf):
            raise ValueError("max_batch and max_queue must be at least 1, window a finite "
                             "number >= 0, batch_timeout a finite number > 0")
        self._load_backend = load
        self.hidden = hidden
        self.max_batch = max_batch
        self.window = window
        self.max_queue = max_queue
        self.batch_timeout = batch_timeout
        self.metrics = metrics
        self.state = "starting"
        self.backend: Backend | None = None
        self.restarts = 0
        self.restart_seconds: list[float] = []
        self.load_seconds: float | None = None
        self._queue: collections.deque[Job] = collections.deque()
        self._queued = 0
        self._wake: asyncio.Event | None = None
        self._pidfds: list[int] = []  # the backend's processes' (``_watch``)
        self._death = False  # one of them ended: the idle loop asks the backend at once
        self._task: asyncio.Task[None] | None = None
        self._loading: asyncio.Future[Backend] | None = None
        self._stopping = False
        self._settled = True  # False from a load until the next idle moment: _settle
        self._stopped: asyncio.Future[None] | None = None  # the one stop()'s work
        self._batch_t0: float | None = None  # when the batch in the model began, if one is
        self._metrics_state()

    # -- the handlers' side --------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Inputs waiting for a batch."""
        return self._queued

    @property
    def batch_seconds(self) -> float | None:
        """How long the batch in the model has run (None: none is): one near batch_timeout
        is hung, or too large for it, while /health still says "ok"."""
        t0 = self._batch_t0
        return None if t0 is None else time.perf_counter() - t0

    @property
    def pids(self) -> list[int]:
        backend = self.backend
        return backend.pids if backend is not None and self.state == "ok" else []

    def admit(self, count: int) -> None:
        """APIError 503 unless the model serves now, 429 unless ``count`` more inputs fit in
        the queue: what ``submit`` checks, for a handler to ask before it tokenizes."""
        if self.state != "ok" or self._wake is None:
            raise unavailable(self.state)
        if self._queued + count > self.max_queue:
            raise APIError(429, f"the queue is full ({self._queued} inputs wait, at most "
                                f"{self.max_queue}): slow down and retry",
                           kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})

    def submit(self, texts: Sequence[str], tokens: Sequence[Sequence[int]]) -> Job:
        """Queue one request; APIError 429 (queue full) or 503 (not serving) at once."""
        self.admit(len(texts))
        loop = asyncio.get_running_loop()
        job = Job(texts, tokens, loop.create_future(), loop.time(),
                  np.empty((len(texts), self.hidden), dtype=np.float32))
        self._queue.append(job)
        self._queued += len(job)
        self.metrics.queue.set(self._queued)
        if self._wake is not None:  # (admit checked it)
            self._wake.set()
        return job

    def withdraw(self, job: Job) -> None:
        """The job's client went away: its rows not yet in a batch leave the queue now (their
        room is free again); those in a batch are computed and dropped; its handler gets
        APIError 499. Nothing if answered."""
        if job.future.done():
            return
        job.future.set_exception(APIError(499, "the client closed the connection before its "
                                               "answer", code="client_closed"))
        self._queued -= len(job) - job.sent
        job.sent = len(job)  # (the batch task pops it from the queue as it comes)
        self.metrics.queue.set(self._queued)
        self.metrics.withdrawn.inc()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start loading the model and batching (from the running loop); returns at once."""
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="unison-batcher")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The batch task ended: expected when stopping; otherwise nothing would ever answer
        the queue, so say so, refuse new requests (503) and fail the waiting ones."""
        if self._stopping:
            return
        exc = None if task.cancelled() else task.exception()
        log.critical("the batch task ended unexpectedly: %r", exc)
        self.state = "degraded"
        self._metrics_state()
        self._fail_queued(APIError(500, f"internal error: {exc!r}", kind="server_error",
                                   code="internal"))

    async def stop(self, timeout: float = 5.0) -> None:
        """Refuse new jobs, let queued ones finish for up to ``timeout`` seconds (the rest get
        503), then close the backend: a model still loading is waited for and closed too.
        A second call waits for the first's work (the server's SIGTERM starts it, with the
        drain's time; the lifespan's end calls it again)."""
        if self._stopped is None:
            self._stopped = asyncio.ensure_future(self._stop(timeout))
        await asyncio.shield(self._stopped)

    async def _stop(self, timeout: float) -> None:
        self._stopping = True
        self.state = "stopping"
        self._metrics_state()
        if self._wake is not None:
            self._wake.set()
        task = self._task
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout)
            except (asyncio.TimeoutError, Exception):
                task.cancel()
                try:
                    await task
                except BaseException:  # cancelled, or what ended it: closing comes next
                    pass
        self._fail_queued(unavailable("stopping"))
        loading, self._loading = self._loading, None
        if loading is not None:  # a thread still makes one: wait for it, then close it
            try:
                late = await loading
                if late is not self.backend:
                    await asyncio.to_thread(late.close)
            except Exception:
                pass
        backend, self.backend = self.backend, None
        self._unwatch()
        if backend is not None:
            await asyncio.to_thread(backend.close)

    def _watch(self, backend: Backend) -> None:
        """Wake the batch task at the death of any of ``backend``'s processes: a reader on
        each one's pidfd (where the platform has them; else the idle look finds it)."""
        loop = asyncio.get_running_loop()
        for pid in backend.pids:
            if pid == os.getpid():
                continue
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:  # gone already: ask at once
                self._death = True
                continue
            except (AttributeError, OSError):  # no pidfds here: the idle look finds it
                continue
            loop.add_reader(fd, self._died, fd)
            self._pidfds.append(fd)

    def _died(self, fd: int) -> None:
        asyncio.get_running_loop().remove_reader(fd)  # (level-triggered: once is enough)
        self._death = True
        if self._wake is not None:
            self._wake.set()

    def _unwatch(self) -> None:
        loop = asyncio.get_running_loop()
        for fd in self._pidfds:
            loop.remove_reader(fd)
            os.close(fd)
        self._pidfds, self._death = [], False

    def stopping(self) -> bool:
        """Whether stop() was called."""
        return self._stopping

    # -- the batch task ------------------------------------------------------------------------

    async def _run(self) -> None:
        if not await self._load():
            return
        assert self._wake is not None
        wake = self._wake
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                if self._stopping:
                    return
                if not self._settled:
                    self._settle()
                if self._death:  # a worker's pidfd turned readable (_watch): ask now
                    self._death = False
                    await self._look(force=True)
                    continue
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), IDLE_LOOK)
                except asyncio.TimeoutError:
                    await self._look()
                continue
            # gather: until the oldest job has waited the window, or a full batch waits
            deadline = self._queue[0].arrived + self.window
            while self._queued < self.max_batch and not self._stopping:
                left = deadline - loop.time()
                if left <= 0:
                    break
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), left)
                except asyncio.TimeoutError:
                    break
            parts = self._take()
            if parts:
                try:
                    await self._batch(parts)
                except asyncio.CancelledError:  # stop() gave up on it: its jobs get 503
                    self._fail(parts, unavailable("stopping"))
                    raise
                except Exception as exc:  # a bug here must not leave requests hanging
                    log.exception("the batch task failed on %d inputs", len(parts))
                    self._fail(parts, APIError(500, f"internal error: {exc!r}",
                                               kind="server_error", code="internal"))

    def _take(self) -> list[tuple[Job, int, int]]:
        """Up to max_batch rows from the head of the queue: ``(job, start, stop)`` each."""
        parts: list[tuple[Job, int, int]] = []
        n = 0
        queue = self._queue
        while queue and n < self.max_batch:
            job = queue[0]
            if job.future.done():  # failed with a part of it, or withdrawn: skip the rest
                queue.popleft()
                self._queued -= len(job) - job.sent
                continue
            k = min(len(job) - job.sent, self.max_batch - n)
            parts.append((job, job.sent, job.sent + k))
            job.sent += k
            n += k
            self._queued -= k
            if job.sent == len(job):
                queue.popleft()
        self.metrics.queue.set(self._queued)
        return parts

    async def _batch(self, parts: list[tuple[Job, int, int]]) -> None:
        backend = self.backend
        assert backend is not None
        texts = [t for job, a, b in parts for t in job.texts[a:b]]
        tokens = [t for job, a, b in parts for t in job.tokens[a:b]]
        t0 = time.perf_counter()
        try:
            rows = await self._embed(backend, texts, tokens)
        except (unison.WorkerDied, unison.SessionClosed) as exc:
            self._fail(parts, self._lost(exc))
            await self._recover(exc)
            return
        except asyncio.TimeoutError:
            hung = TimeoutError(f"a batch of {len(texts)} took over {self.batch_timeout} s")
            self._fail(parts, self._lost(hung))
            if backend.broken or backend.name == "unison":  # a hung worker: replace them all
                await self._recover(hung)
            return
        except Exception as exc:
            if backend.broken:
                self._fail(parts, self._lost(exc))
                await self._recover(exc)
                return
            log.exception("a batch of %d inputs failed", len(texts))
            self._fail(parts, APIError(500, f"the model failed on this batch: {exc!r}",
                                       kind="server_error", code="model_error"))
            return
        seconds = time.perf_counter() - t0
        self.metrics.batch_size.observe(len(texts))
        self.metrics.batch_seconds.observe(seconds)
        self.metrics.inputs.inc(len(texts))
        offset = 0
        woken = 0
        for job, a, b in parts:
            job.out[a:b] = rows[offset : offset + b - a]
            offset += b - a
            job.filled += b - a
            if job.filled == len(job) and not job.future.done():
                job.future.set_result(job.out)
                woken += 1
                if woken % WAKE_CHUNK == 0:
                    await asyncio.sleep(0)  # their replies go out now, /health may come between

    async def _embed(self, backend: Backend, texts: list[str],
                     tokens: list[Sequence[int]]) -> np.ndarray:
        """The model's rows for one batch, within batch_timeout; its start kept meanwhile
        (batch_seconds)."""
        self._batch_t0 = time.perf_counter()
        try:
            return await asyncio.wait_for(backend.embed(texts, tokens), self.batch_timeout)
        finally:
            self._batch_t0 = None

    def _lost(self, exc: BaseException) -> APIError:
        first = str(exc).splitlines()[0] if str(exc) else repr(exc)
        code = "model_timeout" if isinstance(exc, TimeoutError) else "worker_died"
        return APIError(503, f"the model's workers failed while this request was computed "
                             f"({first}); they are being restarted: retry shortly",
                        kind="server_error", code=code, headers={"Retry-After": "2"})

    def _fail(self, parts: list[tuple[Job, int, int]], error: APIError) -> None:
        for job, _, _ in parts:
            if not job.future.done():
                job.future.set_exception(error)

    def _fail_queued(self, error: APIError) -> None:
        while self._queue:
            job = self._queue.popleft()
            if not job.future.done():
                job.future.set_exception(error)
        self._queued = 0
        self.metrics.queue.set(0)

    def _settle(self) -> None:
        """Idle after a load: what it made is kept for good, so move it out of the collector's
        sight (no full collection walks the model's objects again); after a restart, a
        collection first, so that the closed backend's garbage is not frozen with it (the
        first load has none: no pause of the loop for it)."""
        self._settled = True
        if self.restarts:
            gc.collect()
        gc.freeze()

    # -- deaths and restarts -------------------------------------------------------------------

    async def _look(self, force: bool = False) -> None:
        """Idle: if a worker is gone (``force``: its pidfd said so), learn how (a round trip
        raises WorkerDied) and recover."""
        backend = self.backend
        if backend is None or not (force or backend.broken or backend.gone()):
            return
        try:
            await backend.probe()
        except Exception as exc:
            await self._recover(exc)

    async def _recover(self, exc: BaseException) -> None:
        """Fail what waits, load a new backend, count and time the restart."""
        if self._stopping:
            return
        t0 = time.monotonic()
        self.state = "degraded"
        self._metrics_state()
        log.warning("the model lost a worker (%s): failing %d queued inputs with 503, "
                    "reloading", str(exc).splitlines()[0] if str(exc) else repr(exc),
                    self._queued)
        self._fail_queued(unavailable("degraded"))
        old, self.backend = self.backend, None
        self._unwatch()
        if old is not None:
            try:
                await asyncio.to_thread(old.close)
            except Exception:
                log.exception("closing the broken backend failed")
            del old
            # what loading made was frozen, the session now closed too: out of the
            # collector's sight its cycles (and its shared memory's mappings) stayed for good,
            # one more set each restart. A collection may have them now; the next idle
            # moment freezes again (_settle), once our callers' frames let go of them.
            gc.unfreeze()
        if not await self._load():
            return
        took = time.monotonic() - t0
        self.restarts += 1
        self.restart_seconds.append(took)
        self.metrics.restarts.inc()
        self.metrics.restart_seconds.observe(took)
        self.metrics.last_restart.set(took)
        log.warning("workers restarted in %.2f s (restart %d); serving again, worker pids %s",
                    took, self.restarts, " ".join(map(str, self.pids)))

    async def _load(self) -> bool:
        """Make a backend on a thread (the loop keeps answering), retrying with a growing
        pause; False if the batcher stops first."""
        pause = 0.5
        while not self._stopping:
            t0 = time.monotonic()
            self._loading = asyncio.ensure_future(asyncio.to_thread(self._load_backend))
            try:
                backend = await asyncio.shield(self._loading)
            except Exception:
                self._loading = None
                log.exception("loading the model failed; trying again in %.1f s", pause)
                await asyncio.sleep(pause)
                pause = min(2 * pause, 10.0)
                continue
            self._loading = None
            if self.stopping():  # stop() came while it loaded
                await asyncio.to_thread(backend.close)
                return False
            self.backend = backend
            self._watch(backend)
            self._settled = False  # what loading made is frozen at the next idle moment
            self.load_seconds = time.monotonic() - t0
            self.state = "ok"
            self._metrics_state()
            log.info("model loaded in %.2f s (%s backend), worker pids %s", self.load_seconds,
                     backend.name, " ".join(map(str, backend.pids)))
            return True
        return False

    def _metrics_state(self) -> None:
        self.metrics.up.set(1 if self.state == "ok" else 0)
