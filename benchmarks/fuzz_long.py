"""Long fuzzing of the shared-memory channel's decoders, outside CI (issue 14).

tests/test_ring_fuzz.py runs each target for a couple of hundred derandomized examples in
CI; this runs the same targets (the same properties, the same child processes, so that a
crash or a hang is reported with its input rather than taking this script down) for a
long budget, with fresh random seeds, and prints the run counts.

    nice -n 10 python benchmarks/fuzz_long.py --seconds 600
    python benchmarks/fuzz_long.py --seconds 60 --targets reply_ring --rings pure
    python benchmarks/fuzz_long.py --seconds 600 --atheris 120 --python /path/to/venv/python

The budget is split evenly between every (ring, target) pair; ``known_bad`` runs once per
ring. ``--atheris S`` adds S seconds per ring of coverage-guided fuzzing with atheris (the
Python decoders are instrumented; the C ring is not: it is reached, not guided), with a
Python that has atheris installed (``--python``; it is no dependency of unison). Exit
status 1 if any target failed; each failure's input and output is printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FUZZ = ROOT / "tests" / "test_ring_fuzz.py"


def _load() -> ModuleType:
    """The test module (it holds the properties and runs the child processes)."""
    spec = importlib.util.spec_from_file_location("test_ring_fuzz", FUZZ)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def run_hypothesis(fuzz: Any, rings: list[str], targets: list[str], seconds: float,
                   chunk: int, seed: int, out: Path) -> list[dict[str, Any]]:
    rows = []
    pairs = [(r, t) for r in rings for t in targets if t != "known_bad"]
    per = seconds / max(len(pairs), 1)
    runs = [(r, "known_bad", 0.0) for r in rings if "known_bad" in targets]
    runs += [(r, t, per) for r, t in pairs]
    for ring, target, budget in runs:
        where = out / f"{ring}-{target}"
        where.mkdir(parents=True, exist_ok=True)
        extra = [target, "--examples", str(chunk), "--seconds", str(budget), "--seed", str(seed)]
        if target == "known_bad":
            extra = [target]
        start = time.monotonic()
        got = fuzz.run_child(ring, where, budget + fuzz.HANG + 300, extra)
        result = got["results"].get(target)
        row: dict[str, Any] = {"ring": ring, "target": target, "seed": seed,
                               "seconds": round(time.monotonic() - start, 1)}
        if result is None:
            row.update(examples=None, status="CRASHED OR HUNG",
                       detail=fuzz.describe_missing(got, target))
        else:
            row.update(examples=result["examples"], outcomes=result.get("outcomes", {}),
                       status="FAILED" if result["error"] else "ok", detail=result["error"])
        rows.append(row)
        _print_row(row)
    return rows


def _print_row(row: dict[str, Any]) -> None:
    count = "-" if row["examples"] is None else f"{row['examples']:>8}"
    print(f"{row['ring']:>6} {row['target']:<18} {count} examples {row['seconds']:>7.1f} s  "
          f"{row['status']}  {row.get('outcomes', '')}", flush=True)
    if row["status"] != "ok":
        print(row["detail"], flush=True)


# -- atheris (optional): coverage-guided, over the same properties -----------------------------

_ATHERIS_CHILD = "--atheris-child"


def atheris_child(seconds: float, corpus: str) -> None:
    """Runs in the child: libFuzzer drives bytes into the properties' arguments."""
    import atheris  # type: ignore[import-not-found,import-untyped,unused-ignore]

    with atheris.instrument_imports(include=["unison", "test_ring_fuzz"]):
        sys.path.insert(0, str(FUZZ.parent))
        fuzz: Any = importlib.import_module("test_ring_fuzz")

    import resource

    resource.setrlimit(resource.RLIMIT_DATA, (fuzz.DATA_LIMIT, resource.RLIM_INFINITY))
    u64 = (1 << 64) - 1

    def one_input(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        side = fdp.ConsumeIntInRange(0, 2)
        start = fdp.ConsumeIntInRange(0, 1 << 24) * 8
        if side == 0:
            ops: list[tuple[Any, ...]] = []
            for _ in range(fdp.ConsumeIntInRange(0, 3)):
                kind = fdp.ConsumeIntInRange(0, 2)
                if kind == 0:
                    ops.append(("reply", fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))))
                elif kind == 1:
                    ops.append(("part", fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))))
                else:
                    ops.append(("buffers", b"", [fdp.ConsumeBytes(16)]))
            fuzz.reply_ring(start=start, ops=ops, bad=(
                "head", fdp.ConsumeIntInRange(0, u64),
                fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 96)),
                fdp.ConsumeIntInRange(-(1 << 21), 1 << 22)))
        elif side == 1:
            ops = [("send", fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64)), [b""], (0, 1))]
            fuzz.command_ring(start=start, ops=ops, bad=(
                "head", fdp.ConsumeIntInRange(0, u64), fdp.ConsumeIntInRange(0, u64),
                fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 96)),
                fdp.ConsumeIntInRange(-(1 << 21), 1 << 22)))
        else:
            desc = (fdp.ConsumeIntInRange(0, u64), fdp.ConsumeIntInRange(0, u64),
                    fdp.ConsumeIntInRange(0, u64))
            fuzz.arena_descriptors(which="reply" if fdp.ConsumeBool() else "command",
                                   valid=fdp.ConsumeBool(), desc=desc,
                                   jitter=(fdp.ConsumeIntInRange(-4096, 4096),
                                           fdp.ConsumeIntInRange(-4096, 4096)))

    artifacts = Path(tempfile.gettempdir()) / "unison-fuzz-artifacts"
    artifacts.mkdir(exist_ok=True)  # libFuzzer writes a crashing input here (and prints it)
    atheris.Setup([sys.argv[0], f"-max_total_time={int(seconds)}", "-timeout=20",
                   "-rss_limit_mb=4096", "-print_final_stats=1",
                   f"-artifact_prefix={artifacts}/", corpus], one_input)
    atheris.Fuzz()


def run_atheris(python: str, rings: list[str], seconds: float,
                out: Path) -> list[dict[str, Any]]:
    rows = []
    for ring in rings:
        corpus = out / f"atheris-corpus-{ring}"
        corpus.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "UNISON_PURE": "1" if ring == "pure" else ""}
        start = time.monotonic()
        try:
            proc = subprocess.run(
                [python, __file__, _ATHERIS_CHILD, str(seconds), str(corpus)], env=env,
                cwd=out, capture_output=True, text=True, timeout=seconds + 600)
            rc: int | None = proc.returncode
            text = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired:
            rc, text = None, "(killed: a hang?)"
        runs = re.search(r"Done (\d+) runs in", text) or re.search(r"#(\d+)\s+DONE", text)
        row: dict[str, Any] = {"ring": ring, "target": "atheris", "seed": None,
                               "seconds": round(time.monotonic() - start, 1),
                               "examples": int(runs.group(1)) if runs else None}
        ok = rc == 0 and runs is not None
        row.update(status="ok" if ok else f"FAILED (exit {rc})",
                   detail="" if ok else text[-6000:])
        rows.append(row)
        _print_row(row)
    return rows


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == _ATHERIS_CHILD:
        atheris_child(float(sys.argv[2]), sys.argv[3])
        return 0
    fuzz = _load()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=600.0,
                    help="hypothesis budget, split between every (ring, target) pair")
    ap.add_argument("--rings", nargs="+", default=["native", "pure"],
                    choices=["native", "pure"])
    ap.add_argument("--targets", nargs="+", default=list(fuzz.TARGETS),
                    choices=list(fuzz.TARGETS))
    ap.add_argument("--chunk", type=int, default=500,
                    help="examples per hypothesis round (each round has a seed of its own)")
    ap.add_argument("--seed", type=int, default=None, help="first seed (default: random)")
    ap.add_argument("--atheris", type=float, default=0.0, metavar="SECONDS",
                    help="also run atheris this long per ring (needs --python with atheris)")
    ap.add_argument("--python", default=sys.executable, help="the Python to run atheris with")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    seed = _seed() if args.seed is None else args.seed
    print(f"fuzzing {args.targets} on {args.rings} for {args.seconds:.0f} s, seed {seed}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="unison-fuzz-long-") as tmp:
        rows = run_hypothesis(fuzz, args.rings, args.targets, args.seconds, args.chunk, seed,
                              Path(tmp))
        if args.atheris > 0:
            rows += run_atheris(args.python, args.rings, args.atheris, Path(tmp))
    total = sum(r["examples"] or 0 for r in rows)
    failed = [r for r in rows if r["status"] != "ok"]
    print(f"total: {total} examples, {len(failed)} failed target(s)", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
