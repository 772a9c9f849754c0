"""The examples a newcomer copies first, run as written: README's first one, and the hung job
of docs/debugging.md. What they print must stay what the docs say they print."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _python_blocks(doc: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", (ROOT / doc).read_text(), flags=re.M | re.S)


def _run(script: Path) -> list[str]:
    done = subprocess.run([sys.executable, script.name], cwd=script.parent,
                          capture_output=True, text=True, timeout=110, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout.splitlines()


@pytest.mark.timeout(120)
def test_readmes_first_example_prints_what_its_comments_say(tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(_python_blocks("README.md")[0])
    lines = _run(script)
    relayed = [line for line in lines if line.startswith("[worker ")]  # their place may vary
    assert relayed == ["[worker 0] only on worker 0"], lines
    assert [line for line in lines if line not in relayed] == [  # the comments' values
        "(1024, 64)",
        "[0, 1, 2, 3]",
        "[" + ", ".join(["array([6., 6., 6.])"] * 4) + "]",
        "0 <class 'ZeroDivisionError'>",
    ], lines


@pytest.mark.timeout(120)
def test_the_hung_job_of_the_debugging_guide_reports_what_the_guide_shows(
        tmp_path: Path) -> None:
    blocks = _python_blocks("docs/debugging.md")
    shards = next(b for b in blocks if b.startswith("# shards.py"))
    job = next(b for b in blocks if b.startswith("# hung_job.py"))
    (tmp_path / "shards.py").write_text(shards)
    (tmp_path / "hung_job.py").write_text(job)
    text = (ROOT / "docs" / "debugging.md").read_text()
    shown = text[text.index("$ python hung_job.py\n"):].split("\n```")[0].splitlines()[1:]
    lines = _run(tmp_path / "hung_job.py")
    head = shown.index("")  # the report, then a blank line, then the stacks
    assert lines[:head + 1] == shown[:head + 1]  # the rank list and the whole report
    # the stacks: pids, thread ids and unison's own lines differ, the job's frames may not
    ours = [line.strip() for line in shown if "shards.py:" in line and " is " not in line]
    got = [line.strip() for line in lines[head:] if "shards.py:" in line]
    assert ours and set(ours) <= set(got), (ours, got)
    assert got.count("shards.py:17 in refresh_cache()") == 1  # rank 1 alone holds the lock
