"""``unison serve``: the main job's model (all-MiniLM-L6-v2, split across unison workers)
behind an OpenAI-compatible HTTP API, on Starlette and uvicorn (the ``serve`` extra).

    server.py    the command: flags, logging, uvicorn run programmatically, SIGTERM -> exit 0
    config.py    ServeConfig: the options (imports nothing heavy)
    app.py       the ASGI app: POST /v1/embeddings, GET /health, GET /metrics; the lifespan
    schema.py    the OpenAI request checked (4xx JSON errors) and the reply built
    batcher.py   dynamic batching in the event loop: a bounded queue, one batch in flight,
                 each request's rows scattered back; a dead worker -> 503s, then a restart
    backends.py  what computes the embeddings: unison's ShardedEncoder (the product) or
                 sentence-transformers in this one process (the benchmark's baseline)
    metrics.py   Prometheus metrics, one registry per app

Nothing heavy is imported here: starlette, uvicorn and prometheus_client load with the
modules that need them.
"""

from __future__ import annotations

__all__ = ["MODEL_NAME", "MODEL_NAMES"]

MODEL_NAME = "all-MiniLM-L6-v2"
"""The model the server names in its replies."""
MODEL_NAMES = (MODEL_NAME, f"sentence-transformers/{MODEL_NAME}")
"""What a request's ``model`` may say (its sentence-transformers name too); another name gets
404 model_not_found, as from OpenAI, so a client never takes these embeddings for another
model's. A request without ``model`` is served."""
