"""What computes the embeddings behind the batcher.

    unison                 ShardedEncoder: tp x dp worker processes, the controller (this
                           process) only tokenizes, pads, sends and scatters rows back
    sentence-transformers  SentenceTransformer.encode in this one process, on a thread (the
                           baseline the benchmark compares against: same app, same batching)

A backend is made by ``load()`` on a thread (it blocks for seconds: the event loop keeps
answering /health meanwhile) and used from the event loop. ``broken`` says that it can no
longer serve (its session closed after a worker died): the batcher then makes a new one.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["BACKENDS", "Backend", "SentenceTransformersBackend", "UnisonBackend", "load"]

BACKENDS = ("unison", "sentence-transformers")


class Backend(Protocol):
    """One loaded model, ready to embed batches."""

    name: str

    @property
    def pids(self) -> list[int]:
        """The processes that compute (the workers; this process for the baseline)."""
        ...

    @property
    def broken(self) -> bool:
        """True once it can never serve again (a worker died: the session is closed)."""
        ...

    def gone(self) -> bool:
        """A cheap look (no message): has a process it needs ended?"""
        ...

    async def probe(self) -> None:
        """A round trip that raises what ended it (``unison.WorkerDied``)."""
        ...

    async def embed(self, texts: Sequence[str], tokens: Sequence[Sequence[int]]) -> np.ndarray:
        """Unit-length float32 embeddings, one row per text, in order: one batch."""
        ...

    def close(self) -> None:
        """Stop what it started (idempotent)."""
        ...


class UnisonBackend:
    """The product: ShardedEncoder's tp x dp workers, awaited without blocking the loop."""

    name = "unison"

    def __init__(self, tp: int, dp: int, device: str = "cpu") -> None:
        from unison.demo.encoder import ShardedEncoder

        self.encoder = ShardedEncoder(tp, dp, device=device, progress=False)

    @property
    def pids(self) -> list[int]:
        return list(self.encoder.pids)

    @property
    def broken(self) -> bool:
        return self.encoder.session.closed

    def gone(self) -> bool:
        for pid in self.encoder.pids:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                continue
        return False

    async def probe(self) -> None:
        await self.encoder.session.run_async(os.getpid, timeout=10.0)

    async def embed(self, texts: Sequence[str], tokens: Sequence[Sequence[int]]) -> np.ndarray:
        done = await self.encoder.encode_async(tokens=tokens, batch_size=max(1, len(tokens)))
        return done.embeddings

    def close(self) -> None:
        self.encoder.close()


class SentenceTransformersBackend:
    """The baseline: sentence-transformers' own encode in this process, one batch at a time on
    a thread (torch releases the GIL while it computes, so the loop keeps answering)."""

    name = "sentence-transformers"

    def __init__(self, device: str = "cpu") -> None:
        from unison.demo import reference
        from unison.demo.config import model_dir

        self._reference = reference
        self.model: Any = reference.load(model_dir(), device)
        self._reference.encode(self.model, ["warm up"], 1)

    @property
    def pids(self) -> list[int]:
        return [os.getpid()]

    @property
    def broken(self) -> bool:
        return False

    def gone(self) -> bool:
        return False

    async def probe(self) -> None:
        return None

    async def embed(self, texts: Sequence[str], tokens: Sequence[Sequence[int]]) -> np.ndarray:
        out = await asyncio.to_thread(self._reference.encode, self.model, list(texts),
                                      max(1, len(texts)))
        return np.asarray(out, dtype=np.float32)

    def close(self) -> None:
        self.model = None


def load(name: str, tp: int, dp: int, device: str = "cpu") -> Backend:
    """Make the backend ``name`` (blocking: run it on a thread)."""
    if name == "unison":
        return UnisonBackend(tp, dp, device)
    if name == "sentence-transformers":
        return SentenceTransformersBackend(device)
    raise ValueError(f"unknown backend {name!r}: use one of {', '.join(BACKENDS)}")
