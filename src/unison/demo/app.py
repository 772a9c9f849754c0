"""``unison demo``: what the user runs and sees.

    load      the sharded model into tp * dp workers, with a progress bar
    embed     the queries (also the warm-up), then the corpus, ``--repeat`` timed passes
    search    each query's best matches in the corpus, by cosine similarity
    baseline  sentence-transformers in this one process, on the same batches (after the
              workers are gone, so it has the machine to itself)
    check     (--check) the worst cosine and largest difference against it

A worker that dies ends the demo with exit status 1 and unison's message naming the worker.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import unison
from unison.demo.config import SetupError
from unison.demo.sentences import CORPUS, QUERIES
from unison.info import cpu_model

CHECK_COSINE = 0.99999
"""--check passes when every sentence's cosine with sentence-transformers is at least this."""

EXIT_FAILED = 1
EXIT_USAGE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's flags (cli.py's ``demo`` subcommand)."""
    parser.add_argument("--workers", type=int, default=None,
                        help="worker processes in all, tp * dp (default 2)")
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor-parallel workers per replica (default: workers / dp)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    parser.add_argument("--file", type=Path, default=None,
                        help="embed these sentences (one a line) instead of the built-in ones")
    parser.add_argument("--query", action="append", default=None,
                        help="a search query (repeatable; default: the built-in ones)")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="sentences per step, split over the replicas (default 32)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed passes over the sentences (default 3)")
    parser.add_argument("--top", type=int, default=3, help="matches shown per query")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one worker per GPU, allreduce over NCCL")
    parser.add_argument("--check", action="store_true",
                        help="compare every embedding with sentence-transformers' own encode")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the sentence-transformers run (unless --check needs it)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def layout(workers: int | None, tp: int | None, dp: int) -> tuple[int, int]:
    """``(tp, dp)`` from the flags: any two of them fix the third; a contradiction is an
    error that says which."""
    if dp < 1:
        raise ValueError(f"--dp must be at least 1, got {dp}")
    if workers is not None and workers < 1:  # (said as a split into replicas before)
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if tp is None:
        total = 2 if workers is None else workers
        if total < dp or total % dp:
            given = (f"--workers {total}" if workers is not None else
                     f"the default of {total} workers (--workers not given)")
            raise ValueError(f"{given} cannot be split into --dp {dp} equal replicas: give "
                             f"--workers as a multiple of {dp}, or --tp")
        tp = total // dp
    elif workers is not None and workers != tp * dp:
        raise ValueError(f"--workers {workers} but --tp {tp} x --dp {dp} = {tp * dp}")
    if tp < 1:
        raise ValueError(f"--tp must be at least 1, got {tp}")
    return tp, dp


@dataclass
class Speed:
    """Timed passes of one system over the same sentences and batches."""

    name: str
    sentences: int = 0
    seconds: float = 0.0
    batch_seconds: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        b = sorted(self.batch_seconds)
        return {
            "system": self.name,
            "sentences": self.sentences,
            "seconds": self.seconds,
            "sentences_per_s": self.sentences / self.seconds if self.seconds else None,
            "batches": len(b),
            "batch_ms_median": statistics.median(b) * 1e3 if b else None,
            "batch_ms_max": b[-1] * 1e3 if b else None,
        }


def read_sentences(path: Path) -> list[str]:
    """One sentence a line; blank lines skipped. Lines end at "\\n" only (the reading
    turns "\\r\\n" and "\\r" into it): str.splitlines() also cut a sentence at \\v, \\f,
    \\x1c-\\x1e, \\x85, \\u2028 and \\u2029."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--file {path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} "
                         f"at offset {exc.start}): save it as UTF-8") from None
    lines = [line.strip() for line in text.split("\n")]
    sentences = [line for line in lines if line]
    if not sentences:
        raise ValueError(f"{path} holds no sentences (one a line)")
    return sentences


def check_queries(queries: list[str]) -> list[str]:
    """The ``--query`` values, refused before the model loads where one is not UTF-8: argv
    keeps such bytes as lone surrogates (\\udcXX), which the tokenizer refuses."""
    for text in queries:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"--query {text!r} is not UTF-8 text (each \\udcXX is a byte "
                             "that does not decode): give the query in UTF-8") from None
    return list(queries)


def search(queries: np.ndarray, corpus: np.ndarray, top: int) -> list[list[tuple[int, float]]]:
    """For each query, the ``top`` corpus rows by cosine similarity (rows are unit length,
    so the dot product), best first."""
    scores = queries @ corpus.T
    out = []
    for row in scores:
        best = np.argsort(-row, kind="stable")[:top]
        out.append([(int(i), float(row[i])) for i in best])
    return out


def main(args: argparse.Namespace) -> int:
    """Run the demo; the exit status."""
    try:
        tp, dp = layout(args.workers, args.tp, args.dp)
        if args.batch_size < 1 or args.repeat < 1 or args.top < 1:
            raise ValueError("--batch-size, --repeat and --top must be at least 1")
        corpus = read_sentences(args.file) if args.file else list(CORPUS)
        queries = check_queries(args.query) if args.query else list(QUERIES)
        return _run(args, tp, dp, corpus, queries)
    except unison.UnisonError as exc:  # WorkerDied names the worker; the session is closed
        print(f"unison demo: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (ValueError, SetupError, OSError) as exc:
        print(f"unison demo: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ValueError) else EXIT_FAILED


def _first_batch(sentences: list[str], tokens: list[list[int]], batch_size: int) -> list[int]:
    """The indices of a pass's first batch (its longest sentences): what both systems warm
    up on, so that neither pays for first-time allocations inside the timed passes."""
    from unison.demo.tokenize import length_batches

    return length_batches(tokens, batch_size)[0]


def _say(args: argparse.Namespace, text: str = "") -> None:
    if not args.json:
        print(text, flush=True)


@dataclass
class _Embedded:
    queries: np.ndarray
    corpus: np.ndarray
    speed: Speed


def _with_unison(args: argparse.Namespace, tp: int, dp: int, corpus: list[str],
                 queries: list[str], tokens: list[list[int]]) -> tuple[_Embedded, list[int]]:
    """Load the shards, embed the queries, warm up, then the timed passes over the corpus;
    the embeddings and the workers' pids (the session is closed on return)."""
    from unison.demo.encoder import ShardedEncoder

    speed = Speed(f"unison tp={tp} x dp={dp}")
    with ShardedEncoder(tp, dp, device=args.device) as enc:
        _say(args, f"all-MiniLM-L6-v2 on {enc.num_workers} workers (tp={tp} x dp={dp}, "
                   f"{args.device}): shards loaded in {enc.load_seconds:.1f} s; worker pids "
                   + " ".join(map(str, enc.pids)))
        q_emb = enc.encode(queries, args.batch_size).embeddings
        warm = _first_batch(corpus, tokens, args.batch_size)
        enc.encode([corpus[i] for i in warm], args.batch_size)
        passes = []
        for _ in range(args.repeat):
            done = enc.encode(corpus, args.batch_size)
            passes.append(done.embeddings)
            speed.sentences += len(corpus)
            speed.seconds += done.seconds
            speed.batch_seconds += done.batch_seconds
        return _Embedded(q_emb, passes[0], speed), enc.pids


def _with_sentence_transformers(args: argparse.Namespace, corpus: list[str],
                                queries: list[str], tokens: list[list[int]]) -> _Embedded:
    """The same queries, warm-up and timed passes (the same batches) in this one process."""
    from unison.demo import reference
    from unison.demo.config import model_dir
    from unison.demo.tokenize import length_batches

    _say(args, "\nloading sentence-transformers for the comparison (one process) ...")
    st_model = reference.load(model_dir(), args.device)
    q_emb = reference.encode(st_model, queries, args.batch_size)
    reference.encode(st_model, [corpus[i] for i in _first_batch(corpus, tokens,
                                                                  args.batch_size)])
    batches = length_batches(tokens, args.batch_size)
    speed = Speed("sentence-transformers, 1 process")
    passes = []
    for _ in range(args.repeat):
        emb, secs = reference.timed_batches(st_model, corpus, batches)
        passes.append(emb)
        speed.sentences += len(corpus)
        speed.seconds += sum(secs)
        speed.batch_seconds += secs
    return _Embedded(q_emb, passes[0], speed)


def _run(args: argparse.Namespace, tp: int, dp: int, corpus: list[str],
         queries: list[str]) -> int:
    from unison.demo.config import load_config, model_dir
    from unison.demo.tokenize import Tokenizer

    folder = model_dir()
    tokens = Tokenizer(folder, load_config(folder).max_seq_length).encode(corpus)
    ours, pids = _with_unison(args, tp, dp, corpus, queries, tokens)
    hits = search(ours.queries, ours.corpus, args.top)
    theirs: _Embedded | None = None
    check: dict[str, Any] | None = None
    if not args.no_baseline or args.check:
        theirs = _with_sentence_transformers(args, corpus, queries, tokens)
    if args.check and theirs is not None:
        from unison.demo import reference

        worst, diff = reference.compare(np.concatenate([ours.queries, ours.corpus]),
                                        np.concatenate([theirs.queries, theirs.corpus]))
        check = {"sentences": len(queries) + len(corpus), "worst_cosine": worst,
                 "max_abs_diff": diff, "ok": worst >= CHECK_COSINE}
    report = {
        "model": "all-MiniLM-L6-v2", "tp": tp, "dp": dp, "workers": tp * dp,
        "device": args.device, "pids": pids, "cpu": cpu_model(), "cores": os.cpu_count(),
        "batch_size": args.batch_size, "repeat": args.repeat,
        "search": [{"query": q, "matches": [{"sentence": corpus[i], "score": s} for i, s in m]}
                   for q, m in zip(queries, hits)],
        "speed": [e.speed.summary() for e in (ours, theirs) if e is not None],
        "check": check,
    }
    if args.json:
        print(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        _print_report(report, len(corpus))
    return EXIT_FAILED if check is not None and not check["ok"] else 0


def _print_report(report: dict[str, Any], n: int) -> None:
    print(f"\nsemantic search over {n} sentences (cosine similarity):")
    for item in report["search"]:
        print(f"  {item['query']!r}")
        for m in item["matches"]:
            print(f"     {m['score']:.3f}  {m['sentence']}")
    print(f"\nspeed: {n} sentences x {report['repeat']} passes, batch size "
          f"{report['batch_size']}, on {report['cpu']} ({report['cores']} cores)")
    print(f"  {'':34} {'sentences/s':>12} {'batch ms median':>16} {'batch ms max':>13}")
    for s in report["speed"]:
        print(f"  {s['system']:34} {s['sentences_per_s']:12.1f} {s['batch_ms_median']:16.1f} "
              f"{s['batch_ms_max']:13.1f}")
    if len(report["speed"]) == 2:
        a, b = report["speed"]
        ratio = a["sentences_per_s"] / b["sentences_per_s"]
        print(f"  unison / sentence-transformers: {ratio:.2f}x the throughput")
    check = report["check"]
    if check is not None:
        verdict = "ok" if check["ok"] else f"FAILED (needs >= {CHECK_COSINE})"
        print(f"\ncheck against sentence-transformers' encode, {check['sentences']} sentences: "
              f"worst cosine {check['worst_cosine']:.8f}, max |difference| "
              f"{check['max_abs_diff']:.2e}: {verdict}")
