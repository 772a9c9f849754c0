"""sentence-transformers in one process: the library people already trust, as the yardstick
for both the answers (parity) and the speed (the baseline beside unison's numbers).

It loads the same model folder, from the installed package, with the Hugging Face hub
switched off (HF_HUB_OFFLINE=1), so it never touches the network either.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def load(path: Path, device: str = "cpu") -> Any:
    """sentence-transformers' own SentenceTransformer over the package's model folder."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # read before the hub library is first imported
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no second bar after ours
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device=device)


def encode(st_model: Any, sentences: Sequence[str], batch_size: int = 32) -> np.ndarray:
    """What sentence-transformers' encode returns: float32 rows, unit length for this model."""
    out = st_model.encode(list(sentences), batch_size=batch_size, convert_to_numpy=True,
                          show_progress_bar=False)
    return np.asarray(out, dtype=np.float32)


def timed_batches(st_model: Any, sentences: Sequence[str],
                  batches: Sequence[Sequence[int]]) -> tuple[np.ndarray, list[float]]:
    """Encode the same batches unison runs, one ``encode`` call each; embeddings in input
    order and each batch's seconds (its tokenization included, as on unison's side)."""
    rows: list[int] = []
    parts, seconds = [], []
    for batch in batches:
        t = time.perf_counter()
        parts.append(encode(st_model, [sentences[i] for i in batch], len(batch)))
        seconds.append(time.perf_counter() - t)
        rows.extend(batch)
    out = np.zeros((len(sentences), parts[0].shape[1] if parts else 0), dtype=np.float32)
    if parts:
        out[rows] = np.concatenate(parts)
    return out, seconds


def compare(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    """``(worst cosine similarity, max absolute difference)`` between matching rows."""
    if ours.shape != theirs.shape:
        raise ValueError(f"shapes differ: {ours.shape} and {theirs.shape}")
    if ours.size == 0:
        return 1.0, 0.0
    dot = (ours.astype(np.float64) * theirs).sum(1)
    norms = np.linalg.norm(ours.astype(np.float64), axis=1) * np.linalg.norm(theirs, axis=1)
    cos = dot / np.maximum(norms, 1e-30)
    return float(cos.min()), float(np.abs(ours - theirs).max())
