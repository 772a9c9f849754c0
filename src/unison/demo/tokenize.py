"""The controller's tokenizer: the model's own tokenizer.json, through the tokenizers library.

sentence-transformers truncates at the model's ``max_seq_length`` (256 here, not the 128 that
tokenizer.json carries) and pads each batch to its longest sentence; this does the same, so
the workers see exactly the token ids sentence-transformers would feed its BERT. Sentences are
grouped by length before batching (as sentence-transformers sorts them), so little padding is
computed.
"""

from __future__ import annotations

import itertools
import re
import string
from collections.abc import Sequence
from pathlib import Path

import numpy as np

_CHARS_PER_TOKEN = 32
"""Characters per token the first look at a long text's start takes (English runs 4-5)."""
_BOUNDARIES = " \t\n\r" + string.punctuation
"""Where a word of BERT's pre-tokenizer always ends: before a space, tab or line end, or an
ASCII punctuation mark (each a word of its own). Not any whitespace regex's: BERT's
normalizer drops control characters (vertical tab, form feed, U+001C), which then join the
words beside them. Less those inside an added token (the "]" of "[MASK]"), which is
matched in the raw text first: a cut there would split it."""


class Tokenizer:
    """Token ids of sentences, truncated at ``max_length`` (special tokens included)."""

    def __init__(self, path: Path, max_length: int) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        self._tok.enable_truncation(max_length=max_length, strategy="longest_first")
        self._tok.no_padding()  # padding is per batch, to its longest sentence (pad_batch)
        self.max_length = max_length
        inside = {c for t in self._tok.get_added_tokens_decoder().values() for c in t.content[1:]}
        self._boundary = re.compile(
            "[" + re.escape("".join(c for c in _BOUNDARIES if c not in inside)) + "]")

    def encode(self, sentences: Sequence[str]) -> list[list[int]]:
        """Each sentence's token ids, [CLS] ... [SEP]."""
        texts = [self._head(t) for t in check_sentences(sentences)]
        return [e.ids for e in self._tok.encode_batch(texts)]

    def _head(self, text: str) -> str:
        """``text``, or a start of it that gives the same ids: the library tokenizes a
        whole text before it cuts at ``max_length``, which for one input of 8 MB under
        ``unison serve``'s body limit took 1.2 GB (4 GB for "a." repeated). A start cut right
        before a space or an ASCII punctuation mark (not inside an added token) ends on a
        whole word, so its tokens begin the text's; once they fill ``max_length``, the rest
        cannot change the result."""
        k = self.max_length * _CHARS_PER_TOKEN
        while len(text) > k:
            cut = 0
            for m in self._boundary.finditer(text, k - k // 4, k):
                cut = m.start()
            if cut and len(self._tok.encode(text[:cut]).ids) >= self.max_length:
                return text[:cut]
            k *= 4
        return text


def check_sentences(sentences: Sequence[str]) -> list[str]:
    """``sentences`` as a list, refused where it is one str or bytes: those are sequences
    too, so each character (or byte) was embedded as a sentence of its own, where
    sentence-transformers gives one embedding for a str. Each item must be a str that
    encodes to UTF-8: tokenizers' own error for another (None, bytes, a lone surrogate)
    names neither the item nor the fault, and a pair of str is tokenized as two segments."""
    if isinstance(sentences, (str, bytes, bytearray)):
        raise TypeError(f"sentences must be a list of str, not one {type(sentences).__name__}: "
                        "to embed one sentence, pass [sentence]")
    out = list(sentences)
    for i, text in enumerate(out):
        if not isinstance(text, str):
            raise TypeError(f"sentences[{i}] is {type(text).__name__}, not str: pass text "
                            "(decode bytes first)")
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # "\ud800", or undecodable bytes kept as
                # "\udcXX" (surrogateescape: argv, os.listdir)
                raise ValueError(f"sentences[{i}] is not valid Unicode: it holds a lone "
                                 f"surrogate, {text[exc.start]!r} at {exc.start}; decode "
                                 "its text from UTF-8 (or its own encoding) with "
                                 "errors='strict' or 'replace'") from None
    return out


def pad_batch(tokens: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)``, int64 arrays of shape (batch, longest): right-padded with ``pad_id``,
    the mask 1 on real tokens. An empty batch gives (0, 0) arrays."""
    longest = max((len(t) for t in tokens), default=0)
    ids = np.full((len(tokens), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(tokens), longest), dtype=np.int64)
    for row, t in enumerate(tokens):
        ids[row, : len(t)] = t
        mask[row, : len(t)] = 1
    return ids, mask


def length_batches(tokens: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
    """Sentence indices in batches of ``batch_size``, longest sentences first, so that each
    batch holds sentences of similar length."""
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    order = sorted(range(len(tokens)), key=lambda i: -len(tokens[i]))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def token_shares(lengths: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Split a batch (longest sentences first) into ``parts`` contiguous ``(start, end)``
    shares with about equal numbers of tokens, one per data-parallel replica. The model skips
    padding (model.Tokens), so a replica's work grows with its tokens; an even split by
    sentences would hand the replica of the longest sentences the most. A share is empty only
    when there are fewer sentences than parts."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    n = len(lengths)
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    total = int(ends[-1]) if n else 0
    bounds = [0]
    for k in range(1, parts):
        target = total * k / parts
        i = int(np.searchsorted(ends, target))  # sentence i's end reaches the target
        before = int(ends[i - 1]) if i else 0
        cut = i + 1 if i < n and int(ends[i]) - target <= target - before else i
        lo = min(bounds[-1] + 1, n)  # a sentence for this share, while there are any
        hi = max(n - (parts - k), lo)  # and one for each later share, while enough
        bounds.append(min(max(cut, lo), hi))
    bounds.append(n)
    return list(itertools.pairwise(bounds))
