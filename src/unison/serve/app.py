"""The ASGI app: three routes, JSON errors for everything else, and a lifespan that starts the
batcher (the model loads in the background: /health says "starting" meanwhile) and, at
shutdown, drains it and closes the workers.

    POST /v1/embeddings   body (<= max_body_bytes, 413; within body_timeout, 408)
                          -> schema.parse_request (400s)
                          -> tokenize here (the Rust tokenizer; on a thread for long texts)
                          -> batcher.submit (429 queue full, 503 not serving) -> await rows
                             (the client gone first: its rows leave the queue; 499, unsent)
                          -> schema.embedding_reply
    GET  /health          {"status": "starting" | "ok" | "degraded" | "stopping", "workers":
                           [pids], "restarts": n, "queue": inputs waiting, "in_flight":
                           embedding requests being answered, "batch_seconds": how long the
                           batch in the model has run (null: none; past "batch_timeout" it
                           fails with 503, and unison's workers are replaced), ...}; HTTP 200
                           when ok, else 503
    GET  /metrics         Prometheus text (metrics.py)

/health and /metrics read a few fields and touch neither the queue nor the workers, so they
answer at once however busy the model is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from unison.serve import MODEL_NAME
from unison.serve.backends import Backend
from unison.serve.backends import load as load_backend
from unison.serve.batcher import Batcher, Job
from unison.serve.config import ServeConfig
from unison.serve.metrics import CONTENT_TYPE, Metrics, MetricsMiddleware
from unison.serve.schema import APIError, embedding_reply, error_body, parse_request

__all__ = ["ServeConfig", "create_app"]

log = logging.getLogger("unison.serve")

JSON = "application/json"
THREAD_TOKENIZE_CHARS = 32_768
"""Requests with more characters than this are tokenized on a thread (the tokenizer releases
the GIL), so that a long text never stalls the loop; shorter ones inline (microseconds)."""
WATCH_AFTER = 0.5
"""Seconds a request waits for its rows before its connection is watched for the client
leaving (a task awaiting the server's next message): such a task for every request cost the
loop 7% of its throughput at saturation, and clients give up after seconds."""
THREAD_JSON_FLOATS = 16 * 384
"""Replies of more floats than this, in JSON numbers (``encoding_format: float``; about 0.3 µs
a float), are written on a thread: the GIL's switch interval then lets the loop answer
/health between slices. Base64 replies (the openai client's default) cost next to nothing."""


def create_app(cfg: ServeConfig, load: Callable[[], Backend] | None = None) -> Starlette:
    """The app for ``cfg``. ``load`` makes the backend (on a thread); by default the one
    ``cfg.backend`` names. The model folder and tokenizer are read now, so a missing model
    package fails here, before any port is bound."""
    from unison.demo.config import load_config, model_dir
    from unison.demo.tokenize import Tokenizer

    cfg.check()
    folder = model_dir()
    model_cfg = load_config(folder)
    tokenizer = Tokenizer(folder, model_cfg.max_seq_length)
    metrics = Metrics()
    make = load if load is not None else (
        lambda: load_backend(cfg.backend, cfg.tp, cfg.dp, cfg.device))
    batcher = Batcher(make, hidden=model_cfg.hidden, max_batch=cfg.max_batch,
                      window=cfg.batch_window_ms / 1e3, max_queue=cfg.max_queue,
                      metrics=metrics, batch_timeout=cfg.batch_timeout)
    metrics.batch_running.set_function(lambda: batcher.batch_seconds or 0.0)

    async def tokenize(texts: Sequence[str]) -> list[list[int]]:
        if sum(map(len, texts)) > THREAD_TOKENIZE_CHARS:
            return await asyncio.to_thread(tokenizer.encode, texts)
        return tokenizer.encode(texts)

    async def encode_reply(rows: np.ndarray, b64: bool, prompt_tokens: int) -> bytes:
        if b64 or rows.size <= THREAD_JSON_FLOATS:
            return embedding_reply(rows, b64=b64, model=MODEL_NAME, prompt_tokens=prompt_tokens)
        return await asyncio.to_thread(embedding_reply, rows, b64=b64, model=MODEL_NAME,
                                       prompt_tokens=prompt_tokens)

    in_flight = 0
    held = _Held(cfg.max_bodies_bytes)

    async def embeddings(request: Request) -> Response:
        nonlocal in_flight
        in_flight += 1
        metrics.in_flight.set(in_flight)
        try:
            body = await _read_body(request, cfg.max_body_bytes, cfg.body_timeout, held)
            req = parse_request(body, max_inputs=cfg.max_inputs, dimensions=model_cfg.hidden)
            batcher.admit(len(req.inputs))  # before tokenizing: a 429 or 503 costs nothing
            tokens = await tokenize(req.inputs)
            job = batcher.submit(req.inputs, tokens)
            rows = await _rows(request, job, batcher)
            reply = await encode_reply(rows, req.base64, sum(map(len, tokens)))
        except APIError as exc:
            return _error(exc)
        finally:
            in_flight -= 1
            metrics.in_flight.set(in_flight)
        return Response(reply, media_type=JSON)

    async def health(request: Request) -> Response:
        state = batcher.state
        doc: dict[str, Any] = {
            "status": state,
            "backend": cfg.backend,
            "model": MODEL_NAME,
            "workers": batcher.pids,
            "restarts": batcher.restarts,
            "last_restart_seconds": (batcher.restart_seconds[-1]
                                     if batcher.restart_seconds else None),
            "queue": batcher.queued,
            "in_flight": in_flight,
            "batch_seconds": batcher.batch_seconds,
            "batch_timeout": batcher.batch_timeout,
        }
        if cfg.backend == "unison":
            doc["tp"], doc["dp"] = cfg.tp, cfg.dp
        return Response(json.dumps(doc), status_code=200 if state == "ok" else 503,
                        media_type=JSON)

    async def metrics_route(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        batcher.start()
        try:
            yield
        finally:
            log.info("shutting down: draining the queue, closing the model")
            # uvicorn has drained the requests by now (unison serve: or its drain has
            # stopped the batcher, whose stop this then waits for)
            await batcher.stop(timeout=1.0)
            log.info("model closed")

    app = Starlette(
        routes=[
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_route, methods=["GET"]),
        ],
        middleware=[Middleware(MetricsMiddleware, metrics=metrics)],
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.batcher = batcher
    app.state.metrics = metrics
    app.state.config = cfg
    return app


class _Held:
    """Bytes of request bodies held while they arrive, all requests together, and the most
    the server may hold (ServeConfig.max_bodies_bytes)."""

    def __init__(self, cap: int) -> None:
        self.cap, self.now = cap, 0


async def _read_body(request: Request, limit: int, seconds: float, held: _Held) -> bytes:
    """The body, refused with 413 past ``limit`` bytes (by its Content-Length, or as it
    streams in), so that no request can make the server hold more than that; with 503
    where the bodies arriving, all requests together, would pass ``held``'s cap (slow
    uploads, each under the limit, added up without one); and with 408 unless it has all
    come within ``seconds`` (uvicorn waits for a stalled upload for good, holding its
    connection, its buffers and a place in /health's in_flight)."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise APIError(400, f"bad Content-Length {length!r}") from None
        if declared > limit:
            raise APIError(413, f"the request body is {declared} bytes; at most {limit} "
                                "(--max-body-mb)", code="body_too_large")
    try:
        if sys.version_info >= (3, 11):  # a timer on this task: no task of its own
            async with asyncio.timeout(seconds):
                return await _body(request, limit, held)
        return await asyncio.wait_for(_body(request, limit, held), seconds)
    except asyncio.TimeoutError:  # (TimeoutError itself since 3.11)
        raise APIError(408, f"the request body did not all arrive within {seconds:g} s "
                            "(--body-timeout)", code="body_timeout", headers=_CLOSE) from None


_CLOSE = {"Connection": "close"}
"""For an answer given before the whole body came: the rest of it, arriving later on a
kept-alive connection, would be read as the next request (uvicorn's bare text 400)."""


async def _body(request: Request, limit: int, held: _Held) -> bytes:
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body passed {limit} bytes (--max-body-mb)",
                               code="body_too_large", headers=_CLOSE)
            if held.now + len(chunk) > held.cap:
                raise APIError(503, f"the server holds {held.now} bytes of request bodies "
                                    "still arriving, its most (--max-bodies-mb): retry later",
                               code="server_busy", headers=_CLOSE)
            held.now += len(chunk)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the client went away before sending the whole body") from None
    finally:
        held.now -= sum(map(len, chunks))
    return b"".join(chunks)


async def _rows(request: Request, job: Job, batcher: Batcher) -> np.ndarray:
    """The job's rows. Past WATCH_AFTER, its connection is watched: if the client goes, its
    rows still queued are withdrawn (APIError 499), so that they take neither queue room
    nor the model's time (a client that timed out and retried had its work done twice)."""
    loop = asyncio.get_running_loop()
    watching: list[asyncio.Task[None]] = []
    timer = loop.call_later(WATCH_AFTER, lambda: watching.append(
        loop.create_task(_watch(request, job, batcher))))
    try:
        return await job.future
    finally:
        timer.cancel()
        if watching:
            watching[0].cancel()


async def _watch(request: Request, job: Job, batcher: Batcher) -> None:
    """Withdraw the job once its client has gone: with the body read, the server's next
    message is ``http.disconnect`` (uvicorn sends it when the connection closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    batcher.withdraw(job)


def _error(exc: APIError) -> Response:
    return Response(exc.body(), status_code=exc.status, headers=exc.headers, media_type=JSON)


def _http_error(request: Request, exc: Exception) -> Response:
    """404, 405 and friends, as OpenAI-style JSON."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else str(exc)
    headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else {}
    body = error_body(f"{detail}: {request.method} {request.url.path}",
                      "invalid_request_error", code="not_found" if status == 404 else None)
    return Response(body, status_code=status, headers=headers, media_type=JSON)


def _server_error(request: Request, exc: Exception) -> Response:
    """Anything unforeseen: a 500 in JSON (uvicorn logs the traceback); the server goes on."""
    return Response(error_body(f"internal error: {exc!r}", "server_error", code="internal"),
                    status_code=500, media_type=JSON)
