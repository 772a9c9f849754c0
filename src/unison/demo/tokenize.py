"""The controller's tokenizer: the model's own tokenizer.json, through the tokenizers library.

sentence-transformers truncates at the model's ``max_seq_length`` (256 here, not the 128 that
tokenizer.json carries) and pads each batch to its longest sentence; this does the same, so
the workers see exactly the token ids sentence-transformers would feed its BERT. Sentences are
grouped by length before batching (as sentence-transformers sorts them), so little padding is
computed.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import string
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

_CHARS_PER_TOKEN = 32
"""Characters per token the first look at a long text's start takes (English runs 4-5)."""
_BOUNDARIES = " \t\n\r" + string.punctuation
"""Where a word of BERT's pre-tokenizer always ends: before a space, tab or line end, or an
ASCII punctuation mark (each a word of its own). Not any whitespace regex's: BERT's
normalizer drops control characters (vertical tab, form feed, U+001C), which then join the
words beside them. Less those inside an added token (the "]" of "[MASK]"), which is
matched in the raw text first: a cut there would split it. Beyond ASCII: ``_unicode_marks``."""
_CJK = ("\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002a6df\U0002a700-\U0002b73f"
        "\U0002b740-\U0002b81f\U0002b920-\U0002ceaf\U0002f800-\U0002fa1f")
"""The ranges BERT's normalizer sets apart with a space on each side (a word each), by code
point, assigned or not, as the tokenizers library's own table has them (its Extension E
starts at U+2B920: the 256 code points before it join the words beside them)."""
_RUN = 1024
_RUN_EDGE = 64
"""A run of this many characters that stay in their word (``_kind``, with those the
normalizer drops among them), or the ``2 * _RUN_EDGE`` of its two ends, makes
its word longer than any WordPiece word (``max_input_chars_per_word``, 100 here): that word
is one [UNK] token, however long. A run of this many characters that make no token (spaces,
and those the normalizer drops) gives the same tokens as its two ends with one space of its
middle between them, where it has one. An added token shorter than an edge cannot reach
a middle."""
_DROPPED, _IN_WORD, _SPACE, _APART = range(4)
"""What a character is to the tokenizer (``_kind``): dropped by its normalizer (a control,
a combining mark); kept inside the word around it (a letter, a digit, an emoji); a space,
which ends a word and makes no token; a word of its own (punctuation, a CJK ideograph)."""


class Tokenizer:
    """Token ids of sentences, truncated at ``max_length`` (special tokens included)."""

    def __init__(self, path: Path, max_length: int) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        self._tok.enable_truncation(max_length=max_length, strategy="longest_first")
        self._tok.no_padding()  # padding is per batch, to its longest sentence (pad_batch)
        self.max_length = max_length
        self._added = [t.content for t in self._tok.get_added_tokens_decoder().values()]
        self._cuts: re.Pattern[str] | None = None
        """Where a long text may be cut; made at the first long text (30 ms)."""
        self._shrinks: bool | None = None  # whether runs may be shrunk (_runs_in)
        self._kinds: dict[str, int] = {}
        """Each character met in a long text whose start gave too few tokens (``_kind``)."""

    def encode(self, sentences: Sequence[str]) -> list[list[int]]:
        """Each sentence's token ids, [CLS] ... [SEP]."""
        texts = [self._head(t) for t in check_sentences(sentences)]
        return [e.ids for e in self._tok.encode_batch(texts)]

    def _head(self, text: str) -> str:
        """``text``, or a start of it that gives the same ids: the library tokenizes a
        whole text before it cuts at ``max_length``, which for one input of 8 MB under
        ``unison serve``'s body limit took 1.2 GB (4 GB for "a." repeated). A start cut right
        before a space, a punctuation mark or a CJK ideograph (not inside an added token)
        ends on a whole word, so its tokens begin the text's; once they fill ``max_length``,
        the rest cannot change the result. Where the first look finds no such place, each
        run of over 1,024 characters that stay in one word (a hex dump, emoji, letters with
        combining marks) keeps its two ends alone: its word is one [UNK] either way; and each
        such run of characters that make no token (spaces, controls) keeps its ends and one
        space of its middle."""
        k = self.max_length * _CHARS_PER_TOKEN
        if len(text) <= k:
            return text
        boundary = self._cuts or self._make_cuts()
        shrunk = False
        while len(text) > k:
            cut = 0
            for m in boundary.finditer(text, k - k // 4, k):
                cut = m.start()
            if cut and len(self._tok.encode(text[:cut]).ids) >= self.max_length:
                return text[:cut]
            if not shrunk:  # one word of megabytes, say (a hex dump): its ends will do
                shrunk = True
                steps = self._runs_in(text)
                for run, shrink in steps:
                    text = run.sub(shrink, text)
                if steps:
                    continue
            k *= 4
        return text

    def _make_cuts(self) -> re.Pattern[str]:
        inside = {c for t in self._added for c in t[1:]}
        marks = "".join(c for c in _BOUNDARIES + _unicode_marks() if c not in inside)
        self._cuts = re.compile("[" + re.escape(marks) + _CJK + "]")
        return self._cuts

    def _runs_in(self, text: str) -> list[tuple[re.Pattern[str], Callable[[re.Match[str]], str]]]:
        """How the runs of ``text`` that may lose their middles (``_RUN`` or more) are
        found and shrunk, in order: those of characters that make no token (``_gap``),
        then those of characters that stay in one word (``_ends``). None (an empty list)
        where this tokenizer's runs may not be shrunk (no WordPiece model whose longest
        word is under two edges, or an added token as long as one, or one holding a space
        or a character the normalizer drops)."""
        kinds = self._kinds
        if self._shrinks is None:
            model = json.loads(self._tok.to_str())["model"]
            longest = (model.get("max_input_chars_per_word", 0) if model["type"] == "WordPiece"
                       else 0)
            self._shrinks = 0 < longest < 2 * _RUN_EDGE and all(len(t) < _RUN_EDGE
                                                                 for t in self._added)
            for c in set("".join(self._added)):
                kinds[c] = _kind(self._tok, c)
                self._shrinks &= kinds[c] not in (_DROPPED, _SPACE)
        if not self._shrinks:
            return []
        chars = set(text)
        for c in chars.difference(kinds):
            kinds[c] = _kind(self._tok, c)
        steps: list[tuple[re.Pattern[str], Callable[[re.Match[str]], str]]] = []
        gaps = "".join(sorted(c for c in chars if kinds[c] in (_DROPPED, _SPACE)))
        if gaps:
            spaces = "".join(c for c in gaps if kinds[c] == _SPACE)
            steps.append((_class_run(gaps), functools.partial(
                _gap, spaces=_class_run(spaces, 1) if spaces else None)))
        inside = "".join(sorted(c for c in chars if kinds[c] in (_DROPPED, _IN_WORD)))
        if inside:
            solid = frozenset(c for c in inside if kinds[c] == _IN_WORD)
            steps.append((_class_run(inside), functools.partial(_ends, solid=solid)))
        return steps


@functools.lru_cache(maxsize=64)
def _class_run(chars: str, least: int = _RUN) -> re.Pattern[str]:
    """``least`` or more of ``chars``, from the start of their run: one class repeated, not
    a group (whose every repeat the regular expression engine would stack: 300 MB for 8 MB),
    after a look behind that refuses to start inside a run (else a run a little shorter
    than ``least`` is scanned again from each of its characters: 8 MB of 1,023 letters and
    a space took 3-4.3 s, python benchmarks/long_input.py --kinds near; a review, issue 9,
    forty-eighth pass)."""
    one = "[" + "".join(map(re.escape, chars)) + "]"
    return re.compile(f"(?<!{one}){one}{{{least},}}")


def _kind(tok: object, c: str) -> int:
    """What ``c`` is to the tokenizer: ``_DROPPED``, ``_IN_WORD``, ``_SPACE`` or
    ``_APART``. Asked of the tokenizer's own normalizer and pre-tokenizer, so no table of
    another Unicode version can differ: the first version took letters and digits of the
    same category in Unicode 3.2 and now, and one word of 8 MB of emoji, of letters with
    combining marks, or of a script beyond the BMP was tokenized whole (650 MB, 2.8 s each:
    an audit, issue 9, forty-seventh pass)."""
    normal = tok.normalizer.normalize_str(c)  # type: ignore[attr-defined]
    if not normal:
        return _DROPPED
    words = [w for w, _ in tok.pre_tokenizer.pre_tokenize_str("a" + normal + "b")]  # type: ignore[attr-defined]
    return _IN_WORD if len(words) == 1 else _SPACE if words == ["a", "b"] else _APART


def _gap(match: re.Match[str], spaces: re.Pattern[str] | None) -> str:
    """A run of characters that make no token: its two ends, with one space of its middle
    between them where the middle has one (``spaces``), so the words beside it stay apart,
    or joined, as they were. Before (issue 9, forty-eighth pass), 8 MB of spaces or of
    controls were tokenized whole: 1.3-3.4 s and 347-498 MB for no token (python
    benchmarks/long_input.py --kinds spaces controls)."""
    run = match[0]
    space = None if spaces is None else spaces.search(run, _RUN_EDGE, len(run) - _RUN_EDGE)
    return run[:_RUN_EDGE] + ("" if space is None else space[0][0]) + run[-_RUN_EDGE:]


def _ends(match: re.Match[str], solid: frozenset[str]) -> str:
    """A run's two ends, each up to its ``_RUN_EDGE``-th character that stays (``solid``):
    the word keeps more than 100 characters, and stays one word. The whole run where it
    holds too few such characters (mostly combining marks)."""
    run = match[0]
    head, kept = 0, 0
    while kept < _RUN_EDGE and head < len(run):
        kept += run[head] in solid
        head += 1
    tail, kept = len(run), 0
    while kept < _RUN_EDGE and tail > head:
        tail -= 1
        kept += run[tail] in solid
    return run[:head] + run[tail:] if kept == _RUN_EDGE else run


def _unicode_marks() -> str:
    """The characters beyond ASCII in the Basic Multilingual Plane that BERT's
    pre-tokenizer makes words of their own (punctuation) or splits at (space separators).
    Only characters of the same category in Unicode 3.2 and in this Python's Unicode, so
    that the Rust library's older tables surely agree: one newly assigned there is "other",
    dropped by its normalizer (a cut before it might split a word)."""
    old = unicodedata.ucd_3_2_0
    marks = []
    for cp in range(0x80, 0x10000):
        c = chr(cp)
        kind = unicodedata.category(c)
        if old.category(c) == kind and (kind[0] == "P" or kind == "Zs"):
            marks.append(c)
    return "".join(marks)


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
