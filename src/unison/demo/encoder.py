"""The controller side: a session of ``tp * dp`` workers that holds the model and embeds text.

    Session(tp * dp, num_groups=dp)        group g = one replica = ranks g*tp .. g*tp + tp-1
      call(open_shard) -> Ref to each worker's Shard
      call(load_part, shard, p) for every part, progress bar as each completes
    encode(sentences):
      tokenize (controller) -> batches by length -> each batch split over the dp replicas,
      about equal tokens each
      group(g).call(encode, shard, ids, mask)   one message per replica, its sentences only
      ref.get(worker=g*tp)                       the embeddings, from the replica's first worker

One worker per GPU with ``device="cuda"`` (CUDA_VISIBLE_DEVICES per rank, NCCL through
``Session(collectives="torch")``); on CPU the allreduces go through unison's shared memory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import unison
from unison.demo import tasks
from unison.demo.config import ModelConfig, SetupError, load_config, model_dir
from unison.demo.plan import ShardPlan, check_tp, plan
from unison.demo.tokenize import Tokenizer, length_batches, pad_batch, token_shares


@dataclass
class Encoded:
    """Embeddings in the order of the input sentences, and how long each batch took."""

    embeddings: np.ndarray
    batch_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0
    """The whole call: tokenizing, every batch, and putting the rows in order."""


def shard_bytes(cfg: ModelConfig, shard: ShardPlan, part: int) -> int:
    """How many bytes a rank reads for ``part`` (0 the embeddings, 1.. the layers): what the
    progress bar counts towards."""
    h = cfg.hidden
    if part == 0:
        floats = (cfg.vocab + cfg.max_positions + 1 + 2) * h
    else:
        heads = shard.num_heads * shard.head_dim
        cols = shard.columns[1] - shard.columns[0]
        floats = (3 * heads * h + 3 * heads  # Q, K, V rows and biases
                  + h * heads + h + 2 * h  # attention output columns, its bias, layer norm
                  + cols * h + cols  # MLP first dense rows and bias
                  + h * cols + h + 2 * h)  # MLP second dense columns, its bias, layer norm
    return 4 * floats


class ShardedEncoder:
    """all-MiniLM-L6-v2 split over ``tp`` workers per replica, ``dp`` replicas.

    ``threads`` sets torch's threads per worker; by default each worker keeps unison's share
    of the cores (cores / workers), which measured best on 2 cores: tp=2 with 2 threads per
    worker was several times slower. A context manager: closing it stops the workers. Errors
    of the runtime pass through unchanged (``unison.WorkerDied`` names the worker that died)."""

    def __init__(self, tp: int = 2, dp: int = 1, *, device: str = "cpu",
                 path: Path | None = None, progress: bool = True,
                 threads: int | None = None) -> None:
        if dp < 1:
            raise ValueError(f"dp must be at least 1, got {dp}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.path = path if path is not None else model_dir()
        self.cfg = load_config(self.path)
        check_tp(tp, self.cfg)  # before any worker starts
        self.tp, self.dp, self.device = tp, dp, device
        self.tokenizer = Tokenizer(self.path, self.cfg.max_seq_length)
        kw: dict[str, Any] = {}
        if device == "cuda":
            kw = {"collectives": "torch", "env": _one_gpu_each(tp * dp)}
        self.session = unison.Session(tp * dp, num_groups=dp, **kw)
        try:
            self.pids: list[int] = self.session.run(os.getpid)
            self.load_seconds = self._load(progress, threads)
        except BaseException:
            self.session.close()
            raise

    @property
    def num_workers(self) -> int:
        return self.tp * self.dp

    def _load(self, progress: bool, threads: int | None) -> float:
        """Every worker reads its own shard, part by part; the bar counts the bytes read."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        sess = self.session
        shard = sess.call(tasks.open_shard, str(self.path), self.tp, self.device, threads)
        parts = range(1 + self.cfg.layers)
        plans = [plan(r, self.tp, self.cfg) for r in range(self.tp)]
        total = self.dp * sum(shard_bytes(self.cfg, p, part) for p in plans for part in parts)
        refs = [sess.call(tasks.load_part, shard, part) for part in parts]  # all sent at once
        if not progress:  # no bar at all: even a disabled tqdm leaves its monitor thread
            for ref in refs:
                ref.gather()
        else:
            with tqdm(total=total, unit="B", unit_scale=True,
                      desc=f"loading shards into {self.num_workers} workers") as bar:
                for part, ref in zip(parts, refs):
                    bar.update(sum(ref.gather()))
                    bar.set_postfix_str("embeddings" if part == 0
                                        else f"layer {part}/{len(parts) - 1}")
        self._shard = shard
        return time.perf_counter() - t0

    def encode(self, sentences: Sequence[str], batch_size: int = 32) -> Encoded:
        """Unit-length embeddings (as sentence-transformers' encode returns them), one row per
        sentence. A batch is split over the replicas by tokens (tokenize.token_shares)."""
        t0 = time.perf_counter()
        tokens = self.tokenizer.encode(sentences)
        out = np.zeros((len(tokens), self.cfg.hidden), dtype=np.float32)  # (a generator: read)
        result = Encoded(out)
        for batch in length_batches(tokens, batch_size):
            t = time.perf_counter()
            self._step(tokens, batch, out)
            result.batch_seconds.append(time.perf_counter() - t)
        result.seconds = time.perf_counter() - t0
        return result

    async def encode_async(self, sentences: Sequence[str] = (), batch_size: int = 32, *,
                           tokens: Sequence[Sequence[int]] | None = None) -> Encoded:
        """``encode`` for asyncio (``unison serve`` batches requests with it): the event loop
        goes on while the workers compute. ``tokens`` gives token ids tokenized already (the
        server tokenizes each request as it comes, to count usage) instead of ``sentences``.
        Cancelling the awaiting task abandons only the wait; a death raises
        ``unison.WorkerDied`` here as in ``encode``."""
        t0 = time.perf_counter()
        ids_of = (check_tokens(tokens, self.cfg) if tokens is not None
                  else self.tokenizer.encode(sentences))
        out = np.zeros((len(ids_of), self.cfg.hidden), dtype=np.float32)
        result = Encoded(out)
        for batch in length_batches(ids_of, batch_size):
            t = time.perf_counter()
            for share, ref, first in self._send_step(ids_of, batch):
                out[share] = await ref.get_async(worker=first)
            result.batch_seconds.append(time.perf_counter() - t)
        result.seconds = time.perf_counter() - t0
        return result

    def _step(self, tokens: list[list[int]], batch: list[int], out: np.ndarray) -> None:
        for share, ref, first in self._send_step(tokens, batch):
            out[share] = ref.get(worker=first)

    def _send_step(self, tokens: Sequence[Sequence[int]],
                   batch: list[int]) -> list[tuple[list[int], unison.Ref, int]]:
        """Split ``batch`` over the replicas and send each its share before any wait: (its
        sentences, the Ref of their embeddings, the replica's first rank), for the replicas
        that got sentences."""
        cuts = token_shares([len(tokens[i]) for i in batch], self.dp)
        shares = [batch[lo:hi] for lo, hi in cuts]
        out = []
        for g, share in enumerate(shares):
            ids, mask = pad_batch([tokens[i] for i in share])
            ref = self.session.group(g).call(tasks.encode, self._shard, ids, mask)
            if share:
                out.append((share, ref, g * self.tp))
        return out

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> ShardedEncoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_tokens(tokens: Sequence[Sequence[int]], cfg: ModelConfig) -> list[list[int]]:
    """Token ids given by a caller who tokenized already, as lists, checked the way the
    model needs them: the tokenizer's own cut (``max_seq_length``) is not applied here, so a
    longer list would embed past it where sentence-transformers stops; an empty one, or an
    id outside the vocabulary, failed deep in the workers' forward pass. Each raises here."""
    out = []
    for i, ids in enumerate(tokens):  # (in the event loop: min and max, not a loop per id)
        row = list(ids)
        if not 0 < len(row) <= cfg.max_seq_length:
            raise ValueError(
                f"tokens[{i}] holds {len(row)} ids; each needs 1 to {cfg.max_seq_length} (the "
                "model's max_seq_length): tokenize with the encoder's tokenizer, which cuts "
                "there and adds [CLS] and [SEP]")
        if min(row) < 0 or max(row) >= cfg.vocab:
            bad = [t for t in row if not 0 <= t < cfg.vocab]
            raise ValueError(f"tokens[{i}] holds ids outside the vocabulary (0 to "
                             f"{cfg.vocab - 1}): {bad[:5]}; tokenize with this model's own "
                             "tokenizer (the encoder's): another model's ids do not fit")
        out.append(row)
    return out


def _one_gpu_each(n: int) -> dict[int, dict[str, str]]:
    """CUDA_VISIBLE_DEVICES per rank: worker r sees GPU r only (NCCL wants one GPU a rank)."""
    import torch

    if not torch.cuda.is_available():
        raise SetupError("--device cuda: torch sees no CUDA device on this machine")
    gpus = torch.cuda.device_count()
    if gpus < n:
        raise SetupError(f"--device cuda runs one worker per GPU: {n} workers need {n} GPUs, "
                           f"this machine has {gpus}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [v.strip() for v in visible.split(",")] if visible else [str(i) for i in range(gpus)]
    return {r: {"CUDA_VISIBLE_DEVICES": names[r]} for r in range(n)}
