"""README's first example, run as written: a newcomer copies it before anything else, so what
it prints must stay what its comments say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.M | re.S)


@pytest.mark.timeout(120)
def test_readmes_first_example_prints_what_its_comments_say(tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(_python_blocks()[0])
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=110, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    relayed = [line for line in lines if line.startswith("[worker ")]  # their place may vary
    assert relayed == ["[worker 0] only on worker 0"], done.stdout
    assert [line for line in lines if line not in relayed] == [  # the comments' values
        "(1024, 64)",
        "[0, 1, 2, 3]",
        "[" + ", ".join(["array([6., 6., 6.])"] * 4) + "]",
        "0 <class 'ZeroDivisionError'>",
    ], done.stdout
