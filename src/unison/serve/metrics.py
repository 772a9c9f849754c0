"""Prometheus metrics of one app, in a registry of its own (two apps in one process, as in
tests, never share counters), and the ASGI middleware that counts and times every request.

    unison_serve_requests_total{route, status}    answers given, by route and HTTP status
    unison_serve_request_seconds{route}           latency, from the request to the last byte
                                                  (routes: embeddings, health, metrics)
    unison_serve_batch_size                       inputs per batch sent to the model
    unison_serve_batch_seconds                    the model's time per batch
    unison_serve_inputs_total                     texts embedded
    unison_serve_queue_inputs                     inputs waiting for a batch now
    unison_serve_requests_in_flight               embedding requests not yet answered
    unison_serve_withdrawn_requests_total         requests whose client left before the answer
    unison_serve_batch_running_seconds            how long the batch in the model has run
    unison_serve_worker_restarts_total            workers replaced after one died
    unison_serve_restart_seconds                  how long each replacement took (and the last)
    unison_serve_up                               1 while the model serves, else 0

Rendering is pure Python, about 10 µs a sample line: the buckets are few, and the server
turns off the ``_created`` samples (``prometheus_client.disable_created_metrics``, a switch
for the whole process), so that /metrics stays fast while the model saturates the cores.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["CONTENT_TYPE", "Metrics", "MetricsMiddleware"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_ROUTES = {"/v1/embeddings": "embeddings", "/health": "health", "/metrics": "metrics"}


class Metrics:
    """The app's counters, histograms and gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("unison_serve_requests", "HTTP requests answered",
                                ["route", "status"], registry=r)
        self.latency = Histogram("unison_serve_request_seconds",
                                 "Request latency, from its arrival to the last byte sent",
                                 ["route"], buckets=_LATENCY, registry=r)
        self.batch_size = Histogram("unison_serve_batch_size", "Inputs per batch sent to the model",
                                    buckets=_SIZES, registry=r)
        self.batch_seconds = Histogram("unison_serve_batch_seconds",
                                       "The model's time per batch", buckets=_LATENCY, registry=r)
        self.inputs = Counter("unison_serve_inputs", "Texts embedded", registry=r)
        self.queue = Gauge("unison_serve_queue_inputs", "Inputs waiting for a batch", registry=r)
        self.restarts = Counter("unison_serve_worker_restarts",
                                "Times the workers were replaced after one died", registry=r)
        self.restart_seconds = Histogram("unison_serve_restart_seconds",
                                         "Seconds from a worker's death to serving again",
                                         buckets=(0.5, 1, 2, 3, 5, 8, 13, 21, 34, 60),
                                         registry=r)
        self.last_restart = Gauge("unison_serve_last_restart_seconds",
                                  "Seconds the last replacement of the workers took", registry=r)
        self.in_flight = Gauge("unison_serve_requests_in_flight",
                               "Embedding requests received and not yet answered", registry=r)
        self.withdrawn = Counter("unison_serve_withdrawn_requests",
                                 "Requests whose client went away before the answer: their "
                                 "rows still queued were dropped", registry=r)
        self.batch_running = Gauge("unison_serve_batch_running_seconds",
                                   "How long the batch in the model has run (0: none)",
                                   registry=r)
        self.up = Gauge("unison_serve_up", "1 while the model serves (health ok), else 0",
                        registry=r)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        route = _ROUTES.get(path)
        if route is None:  # 404s and the like: counted, not timed (fewer lines to render)
            self.requests.labels("other", str(status)).inc()
            return
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)


class MetricsMiddleware:
    """Pure ASGI (no buffering, no task per request): counts each HTTP answer by route and
    status, and times it to the end of its body."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500  # what the client gets if the app raises before answering

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            path: Any = scope.get("path", "")
            self.metrics.observe_request(str(path), status, time.perf_counter() - t0)
