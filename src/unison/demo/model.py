"""The worker side: one tensor-parallel rank of all-MiniLM-L6-v2, in torch.

    open_shard(path, tp, device)   -> Shard (kept on the worker, behind a Ref)
    load_part(shard, part)         -> bytes read: part 0 the embeddings, 1..6 the layers
    encode(shard, ids, mask)       -> unit-length embeddings on the group's rank 0, else None

Per layer (post-LN BERT), with ``reduce`` the group's allreduce:

    x --> QKV of my heads --> attention --> my columns of W_o --> reduce --> + b_o + x --> LN
      --> my columns of W_1 --> GELU --> my rows of W_2 --------> reduce --> + b_2 + x --> LN

Embeddings, layer norms and the two output biases are replicated; everything else is read as
this rank's slice of the safetensors file (``get_slice``), so a worker reads only its shard.

A padded batch is packed: x holds only the real tokens' rows (``Tokens``), so the matrix
products, layer norms and allreduces skip the padding; attention alone spreads Q, K and V back
to (batch, seq) for scaled_dot_product_attention. sentence-transformers computes the padding
too; the real tokens' values are the same either way (padded keys are masked out).
The controller reaches these functions through tasks.py (so that it never imports torch).

``forward`` takes the reduction as an argument: the workers pass unison's allreduce, while
``local_forward`` (every rank one after another) and ``ThreadedShards`` (every rank on its own
thread) run all the shards in one process with in-memory sums: tests of the split without any
runtime, and the benchmark's references for the runtime's own overhead.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import unison
from unison.demo.config import ModelConfig, load_config
from unison.demo.plan import ShardPlan, plan

Tensor = torch.Tensor
Reduce = Callable[[Tensor], Tensor]


@dataclass
class Embeddings:
    word: Tensor
    position: Tensor
    token_type: Tensor
    """Row 0 of the token type table: the model sees token_type_ids of zeros."""
    ln_weight: Tensor
    ln_bias: Tensor


@dataclass
class Layer:
    qkv_weight: Tensor
    """This rank's heads' rows of Q, K and V, stacked: (3 * heads * head_dim, hidden)."""
    qkv_bias: Tensor
    attn_out_weight: Tensor
    """The columns of the attention output dense that this rank's heads feed."""
    attn_out_bias: Tensor
    attn_ln_weight: Tensor
    attn_ln_bias: Tensor
    up_weight: Tensor
    """This rank's rows of the MLP's first dense (its output columns)."""
    up_bias: Tensor
    down_weight: Tensor
    """The matching columns of the MLP's second dense (its input rows)."""
    down_bias: Tensor
    out_ln_weight: Tensor
    out_ln_bias: Tensor


class Shard:
    """One tensor-parallel rank's weights and the math over them."""

    def __init__(self, path: Path, cfg: ModelConfig, shard_plan: ShardPlan,
                 device: torch.device) -> None:
        self.path = path
        self.cfg = cfg
        self.plan = shard_plan
        self.device = device
        self.embeddings: Embeddings | None = None
        self.layers: list[Layer | None] = [None] * cfg.layers

    # -- loading -------------------------------------------------------------------------------

    @property
    def num_parts(self) -> int:
        """What ``load`` takes: 0 the embeddings, then one per layer."""
        return 1 + self.cfg.layers

    def load(self, part: int) -> int:
        """Read part ``part`` of this rank's shard from the file; return the bytes read."""
        from safetensors import safe_open

        if not 0 <= part < self.num_parts:
            raise ValueError(f"part {part} is outside 0..{self.num_parts - 1}")
        read = _Reader()
        with safe_open(str(self.path / "model.safetensors"), framework="pt") as f:
            read.file = f
            if part == 0:
                self.embeddings = self._read_embeddings(read)
            else:
                self.layers[part - 1] = self._read_layer(read, part - 1)
        return read.nbytes

    def _to(self, t: Tensor) -> Tensor:
        return t.to(self.device, dtype=torch.float32).contiguous()

    def _read_embeddings(self, read: _Reader) -> Embeddings:
        e = "embeddings."
        return Embeddings(
            word=self._to(read(e + "word_embeddings.weight")),
            position=self._to(read(e + "position_embeddings.weight")),
            token_type=self._to(read(e + "token_type_embeddings.weight", rows=(0, 1))[0]),
            ln_weight=self._to(read(e + "LayerNorm.weight")),
            ln_bias=self._to(read(e + "LayerNorm.bias")),
        )

    def _read_layer(self, read: _Reader, i: int) -> Layer:
        p = f"encoder.layer.{i}."
        heads = self.plan.attn_cols
        cols = self.plan.columns
        qkv = [f"{p}attention.self.{name}" for name in ("query", "key", "value")]
        return Layer(
            qkv_weight=self._to(torch.cat([read(n + ".weight", rows=heads) for n in qkv])),
            qkv_bias=self._to(torch.cat([read(n + ".bias", rows=heads) for n in qkv])),
            attn_out_weight=self._to(read(p + "attention.output.dense.weight", cols=heads)),
            attn_out_bias=self._to(read(p + "attention.output.dense.bias")),
            attn_ln_weight=self._to(read(p + "attention.output.LayerNorm.weight")),
            attn_ln_bias=self._to(read(p + "attention.output.LayerNorm.bias")),
            up_weight=self._to(read(p + "intermediate.dense.weight", rows=cols)),
            up_bias=self._to(read(p + "intermediate.dense.bias", rows=cols)),
            down_weight=self._to(read(p + "output.dense.weight", cols=cols)),
            down_bias=self._to(read(p + "output.dense.bias")),
            out_ln_weight=self._to(read(p + "output.LayerNorm.weight")),
            out_ln_bias=self._to(read(p + "output.LayerNorm.bias")),
        )

    def _layer(self, i: int) -> Layer:
        layer = self.layers[i]
        if layer is None:
            raise RuntimeError(f"layer {i} of the shard is not loaded yet")
        return layer

    # -- the math ------------------------------------------------------------------------------

    def embed(self, ids: Tensor, tokens: Tokens) -> Tensor:
        """Token + position + token-type embeddings, layer-normed, of the real tokens:
        (tokens, hidden)."""
        e = self.embeddings
        if e is None:
            raise RuntimeError("the shard's embeddings are not loaded yet")
        seq = ids.shape[1]
        x = F.embedding(ids, e.word) + e.token_type + e.position[:seq]  # BERT's order of sums
        x = tokens.pack(x.reshape(-1, self.cfg.hidden))
        return F.layer_norm(x, (self.cfg.hidden,), e.ln_weight, e.ln_bias,
                            self.cfg.layer_norm_eps)

    def attention_partial(self, i: int, x: Tensor, tokens: Tokens) -> Tensor:
        """This rank's heads' share of the attention output (before the bias): a partial sum
        over heads that the group's reduction completes."""
        layer = self._layer(i)
        heads, dim = self.plan.num_heads, self.plan.head_dim
        qkv = tokens.unpack(F.linear(x, layer.qkv_weight, layer.qkv_bias))
        qkv = qkv.view(tokens.batch, tokens.seq, 3, heads, dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=tokens.keep)
        ctx = tokens.pack(ctx.transpose(1, 2).reshape(-1, heads * dim))
        return F.linear(ctx, layer.attn_out_weight)

    def attention_finish(self, i: int, x: Tensor, total: Tensor) -> Tensor:
        layer = self._layer(i)
        y = total + layer.attn_out_bias + x
        return F.layer_norm(y, (self.cfg.hidden,), layer.attn_ln_weight, layer.attn_ln_bias,
                            self.cfg.layer_norm_eps)

    def mlp_partial(self, i: int, x: Tensor) -> Tensor:
        """This rank's columns of the MLP: a partial sum over them (before the bias)."""
        layer = self._layer(i)
        h = F.gelu(F.linear(x, layer.up_weight, layer.up_bias))  # exact (erf) GELU, as BERT
        return F.linear(h, layer.down_weight)

    def mlp_finish(self, i: int, x: Tensor, total: Tensor) -> Tensor:
        layer = self._layer(i)
        y = total + layer.down_bias + x
        return F.layer_norm(y, (self.cfg.hidden,), layer.out_ln_weight, layer.out_ln_bias,
                            self.cfg.layer_norm_eps)

    def pool(self, x: Tensor, tokens: Tokens, mask: Tensor) -> Tensor:
        """Mean over the real tokens, then unit length when the pipeline normalises (as
        sentence-transformers' Pooling and Normalize modules do)."""
        m = mask.to(x.dtype).unsqueeze(-1)
        summed = (tokens.unpack(x).view(tokens.batch, tokens.seq, -1) * m).sum(1)
        out = summed / m.sum(1).clamp(min=1e-9)
        return F.normalize(out, p=2.0, dim=1) if self.cfg.normalize else out

    def forward(self, ids: Tensor, mask: Tensor, reduce: Reduce) -> Tensor:
        """The sentence embeddings of a padded batch; ``reduce`` completes the partial sums."""
        tokens = Tokens.of(mask)
        x = self.embed(ids, tokens)
        for i in range(self.cfg.layers):
            x = self.attention_finish(i, x, reduce(self.attention_partial(i, x, tokens)))
            x = self.mlp_finish(i, x, reduce(self.mlp_partial(i, x)))
        return self.pool(x, tokens, mask)


class Tokens:
    """Where a padded batch's real tokens are. ``pack`` keeps their rows of a
    (batch * seq, ...) tensor, ``unpack`` puts them back with zeros at the padding; with no
    padding at all (batch 1 always) both return their argument."""

    __slots__ = ("batch", "index", "keep", "seq")

    def __init__(self, batch: int, seq: int, index: Tensor | None, keep: Tensor | None) -> None:
        self.batch, self.seq = batch, seq
        self.index = index
        """The real tokens' rows in (batch * seq), in order; None when nothing is padded."""
        self.keep = keep
        """scaled_dot_product_attention's mask: True where a key is a real token."""

    @classmethod
    def of(cls, mask: Tensor) -> Tokens:
        batch, seq = mask.shape
        if bool(mask.all()):
            return cls(batch, seq, None, None)
        index = mask.reshape(-1).nonzero().squeeze(1)
        return cls(batch, seq, index, mask.bool()[:, None, None, :])

    def pack(self, x: Tensor) -> Tensor:
        return x if self.index is None else x.index_select(0, self.index)

    def unpack(self, x: Tensor) -> Tensor:
        if self.index is None:
            return x
        out = x.new_zeros(self.batch * self.seq, x.shape[1])
        return out.index_copy_(0, self.index, x)


class _Reader:
    """Reads (slices of) tensors from an open safetensors file and counts the bytes."""

    def __init__(self) -> None:
        self.file: Any = None
        self.nbytes = 0

    def __call__(self, name: str, rows: tuple[int, int] | None = None,
                 cols: tuple[int, int] | None = None) -> Tensor:
        view = self.file.get_slice(name)
        if rows is not None:
            t = view[rows[0] : rows[1]]
        elif cols is not None:
            t = view[:, cols[0] : cols[1]]
        else:
            t = view[:]
        self.nbytes += t.numel() * t.element_size()
        return t  # type: ignore[no-any-return]


# -- what the workers run (through sess.call) ------------------------------------------------


def open_shard(path: str, tp: int, device: str = "cpu", threads: int | None = None) -> Shard:
    """Make this worker's (empty) shard: its rank in the group is its tensor-parallel rank."""
    if unison.group_size() != tp:
        raise ValueError(f"tp={tp} but this worker's group has {unison.group_size()} workers")
    if threads is not None:
        torch.set_num_threads(threads)
    folder = Path(path)
    cfg = load_config(folder)
    shard = Shard(folder, cfg, plan(unison.group_rank(), tp, cfg), torch.device(device))
    if tp > 1 and shard.device.type == "cuda":
        # torch.distributed makes its process groups (NCCL here) on first use, by every
        # worker of the session together: do it now, while every worker runs this call, and
        # not in a batch that gives some replica no sentence (it would skip its collectives).
        _group_allreduce(torch.zeros(1, device=shard.device))
    return shard


def load_part(shard: Shard, part: int) -> int:
    """Read one part of the worker's shard (so the controller can show progress per part)."""
    return shard.load(part)


def _group_allreduce(t: Tensor) -> Tensor:
    out: Tensor = unison.allreduce(t, group=True)
    return out


def encode(shard: Shard, ids: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
    """Embed one padded batch with the group; the group's rank 0 returns the embeddings."""
    reduce: Reduce = _group_allreduce if shard.plan.tp > 1 else _identity
    if ids.shape[0] == 0:  # a replica with no sentences in this step: no collective either
        out = np.zeros((0, shard.cfg.hidden), dtype=np.float32)
    else:
        with torch.inference_mode():
            t_ids = torch.from_numpy(ids).to(shard.device)
            t_mask = torch.from_numpy(mask).to(shard.device)
            out = shard.forward(t_ids, t_mask, reduce).cpu().numpy()
    return out if unison.group_rank() == 0 else None


def _identity(t: Tensor) -> Tensor:
    return t


# -- every rank in one process: the reference without a runtime ------------------------------


def open_local(path: Path, tp: int, threads: int | None = None) -> list[Shard]:
    """All ``tp`` shards in this process, fully loaded (for tests and the benchmark)."""
    if threads is not None:
        torch.set_num_threads(threads)
    cfg = load_config(path)
    shards = [Shard(path, cfg, plan(r, tp, cfg), torch.device("cpu")) for r in range(tp)]
    for shard in shards:
        for part in range(shard.num_parts):
            shard.load(part)
    return shards


@dataclass
class LocalTiming:
    """Seconds of one ``local_forward``."""

    total: float = 0.0
    """Everything, the shards one after another."""
    critical: float = 0.0
    """The replicated work plus, for each partial sum, the slowest rank's share: the step
    time of the same shards on ideal parallel workers with free communication."""


def local_forward(shards: Sequence[Shard], ids: np.ndarray, mask: np.ndarray,
                  timing: LocalTiming | None = None) -> np.ndarray:
    """The sharded model in one process: every rank's partial sum, added in rank order (as
    unison's allreduce does). Replicated work is done once, by shard 0."""
    clock = time.perf_counter
    t_all = clock()
    crit = 0.0
    lead = shards[0]
    with torch.inference_mode():
        t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)
        t = clock()
        tokens = Tokens.of(t_mask)
        x = lead.embed(t_ids, tokens)
        crit += clock() - t

        def reduce(parts: Callable[[Shard], Tensor]) -> Tensor:
            nonlocal crit
            slowest, outs = 0.0, []
            for shard in shards:
                t = clock()
                outs.append(parts(shard))
                slowest = max(slowest, clock() - t)
            crit += slowest
            total = outs[0]
            for o in outs[1:]:
                total = total + o
            return total

        for i in range(lead.cfg.layers):
            total = reduce(lambda s: s.attention_partial(i, x, tokens))
            t = clock()
            x = lead.attention_finish(i, x, total)
            crit += clock() - t
            total = reduce(lambda s: s.mlp_partial(i, x))
            t = clock()
            x = lead.mlp_finish(i, x, total)
            crit += clock() - t
        t = clock()
        out = lead.pool(x, tokens, t_mask).numpy()
        crit += clock() - t
    if timing is not None:
        timing.total += clock() - t_all
        timing.critical += crit
    return out


class ThreadedShards:
    """Every rank's shard on its own thread of this process, the partial sums exchanged in
    memory: tensor parallelism in parallel, with no runtime at all.

    It is the reference for unison's own overhead on the same machine: the ranks compute at
    the same time on their own cores (torch releases the GIL in its kernels), so they meet the
    same contention for the cores and memory as unison's workers, and only unison's part
    (processes, dispatch, shared-memory allreduce, waits, fetching) is missing. A reduction
    is, as in unison, a reduce-scatter into one buffer (each rank sums its share of the rows
    in rank order) and a barrier."""

    def __init__(self, shards: Sequence[Shard]) -> None:
        self.shards = list(shards)
        n = len(self.shards)
        self._barrier = threading.Barrier(n)
        self._parts: list[Tensor | None] = [None] * n
        self._out: Tensor | None = None
        self._jobs: list[queue.SimpleQueue[tuple[np.ndarray, np.ndarray] | None]] = [
            queue.SimpleQueue() for _ in range(n)]
        self._done: queue.SimpleQueue[tuple[int, np.ndarray | None, BaseException | None]] = (
            queue.SimpleQueue())
        self._threads = [threading.Thread(target=self._serve, args=(r,), name=f"shard-{r}",
                                          daemon=True) for r in range(n)]
        for t in self._threads:
            t.start()

    def _reduce(self, rank: int, part: Tensor) -> Tensor:
        self._parts[rank] = part
        if rank == 0:
            self._out = torch.empty_like(part)
        self._barrier.wait()  # every part is in, and the output buffer exists
        out, parts = self._out, self._parts
        assert out is not None
        rows = out.shape[0]
        lo, hi = rows * rank // len(parts), rows * (rank + 1) // len(parts)
        share = out[lo:hi]
        torch.add(parts[0][lo:hi], parts[1][lo:hi], out=share)  # type: ignore[index]
        for p in parts[2:]:
            share += p[lo:hi]  # type: ignore[index]
        self._barrier.wait()  # every share is summed (and the parts are read)
        return out

    def _serve(self, rank: int) -> None:
        shard = self.shards[rank]
        while True:
            job = self._jobs[rank].get()
            if job is None:
                return
            try:
                with torch.inference_mode():
                    ids, mask = (torch.from_numpy(a) for a in job)
                    out = shard.forward(ids, mask, lambda t: self._reduce(rank, t))
                self._done.put((rank, out.numpy(), None))
            except BaseException as exc:  # let the caller raise it, and free the others
                self._barrier.abort()
                self._done.put((rank, None, exc))

    def forward(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The embeddings of one padded batch (rank 0's result)."""
        if len(self.shards) == 1:
            with torch.inference_mode():
                return self.shards[0].forward(torch.from_numpy(ids), torch.from_numpy(mask),
                                              _identity).numpy()
        for q in self._jobs:
            q.put((ids, mask))
        results: dict[int, np.ndarray | None] = {}
        error: BaseException | None = None
        for _ in self.shards:
            rank, out, exc = self._done.get()
            results[rank] = out
            error = error or exc
        if error is not None:
            self._barrier.reset()
            raise error
        out0 = results[0]
        assert out0 is not None
        return out0

    def close(self) -> None:
        for q in self._jobs:
            q.put(None)
        for t in self._threads:
            t.join()

    def __enter__(self) -> ThreadedShards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
