"""The benchmark harness runs and produces numbers (never a judgement of speed)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from unison.bench import END_MARK, START_MARK, percentile, update_section

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_produces_numbers(tmp_path: Path) -> None:
    out_json, out_md = tmp_path / "bench.json", tmp_path / "benchmarks.md"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--workers", "1,2",
        "--only", "dispatch,gather_small", "--systems", "unison,pipe",
        "--json", str(out_json), "--out", str(out_md),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    data = json.loads(out_json.read_text())
    cells = {(c["system"], c["metric"], c["n"]): c for c in data["results"]}
    assert set(cells) == {
        (s, m, n) for s in ("unison", "pipe") for m in ("dispatch", "gather_small")
        for n in (1, 2)
    }
    for key, cell in cells.items():
        assert cell["error"] is None, key
        assert cell["unit"] == "us"
        assert cell["samples"] > 0
        assert math.isfinite(cell["value"]) and cell["value"] > 0, key
        assert cell["p99"] >= cell["value"], key

    text = out_md.read_text()
    assert START_MARK in text and END_MARK in text
    assert "| dispatch (µs, median / p99) | 2 |" in text
    assert "Speed-up over the pipe baseline" in text
    assert "| dispatch (µs, median / p99) | 1 |" in proc.stdout


def test_update_section_keeps_the_rest(tmp_path: Path) -> None:
    doc = tmp_path / "b.md"
    update_section(doc, "first\n")
    intro = doc.read_text().split(START_MARK)[0]
    assert intro.startswith("# Benchmarks")
    doc.write_text(doc.read_text() + "\nafterwards\n")
    update_section(doc, "second\n")
    text = doc.read_text()
    assert text == f"{intro}{START_MARK}\nsecond\n{END_MARK}\n\nafterwards\n"

    plain = tmp_path / "plain.md"
    plain.write_text("# Notes\n")
    update_section(plain, "third")
    assert plain.read_text() == f"# Notes\n\n{START_MARK}\nthird\n{END_MARK}\n"


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100
    assert percentile([7.0], 99) == 7.0
