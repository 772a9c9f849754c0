"""Which part of each weight a tensor-parallel rank holds (Megatron-style).

    attention  heads [h0, h1) of 12: rows of Q, K, V; the same columns of the output dense
    MLP        columns [c0, c1) of 1536: rows of the first dense; the same columns of the second
    the rest   embeddings, layer norms, the two output biases: replicated

Each rank's attention and MLP outputs are partial sums; one allreduce after each completes
them. Splits need not be even: ``tp=5`` gives heads 3,3,2,2,2 and MLP columns
308,307,307,307,307 (the first ranks take the remainder), which is still exact, since a sum
over any partition of the heads or columns is the same sum.
"""

from __future__ import annotations

from dataclasses import dataclass

from unison.demo.config import ModelConfig


def split(total: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges that cover ``range(total)`` in ``parts`` near-equal runs, the
    larger ones first (``split(12, 5)`` -> sizes 3,3,2,2,2)."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    base, extra = divmod(total, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


@dataclass(frozen=True)
class ShardPlan:
    """What tensor-parallel rank ``rank`` of ``tp`` holds."""

    rank: int
    tp: int
    heads: tuple[int, int]
    """Attention heads [lo, hi)."""
    columns: tuple[int, int]
    """MLP intermediate columns [lo, hi)."""
    head_dim: int

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def attn_cols(self) -> tuple[int, int]:
        """The rank's columns of the hidden dimension that its heads produce."""
        return self.heads[0] * self.head_dim, self.heads[1] * self.head_dim


def check_tp(tp: int, cfg: ModelConfig) -> None:
    """Refuse a tensor-parallel degree that would leave a rank without a head: a ValueError
    that says what works, before any worker starts."""
    if tp < 1:
        raise ValueError(f"tp must be at least 1, got {tp}")
    if tp > cfg.heads:
        raise ValueError(
            f"tp={tp} is more than the model's {cfg.heads} attention heads: some workers would "
            f"hold no head; use tp <= {cfg.heads} (and --dp for more workers)"
        )


def plan(rank: int, tp: int, cfg: ModelConfig) -> ShardPlan:
    """The shard of tensor-parallel ``rank`` among ``tp``, uneven splits included."""
    check_tp(tp, cfg)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside a group of {tp}")
    return ShardPlan(
        rank=rank,
        tp=tp,
        heads=split(cfg.heads, tp)[rank],
        columns=split(cfg.intermediate, tp)[rank],
        head_dim=cfg.head_dim,
    )
