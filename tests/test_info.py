"""``unison info``: whether the C fast paths run here, and why not. Where they did not build,
unison fell back to pure Python with no word (issue 9, forty-eighth pass)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from unison import _native


def info(*, pure: str = "", code: str = "from unison.cli import main; main(['info'])"
         ) -> list[str]:
    env = {**os.environ, "UNISON_PURE": pure}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stdout.splitlines()


def test_info_names_the_version_the_machine_and_each_fast_path() -> None:
    if not (_native.built("_ring") and _native.built("_coll")):
        pytest.skip("the C fast paths are not built here")
    out = info()
    assert out[0].startswith("unison 0.1.0 (") and out[1].startswith("python 3.")
    assert out[2].startswith("machine: ") and "CPU(s) for this process" in out[2]
    assert "the command ring (_ring): C" in out and "small allreduces (_coll): C" in out
    assert {line.partition(":")[0] for line in out if line.startswith("extra ")} == {
        "extra torch", "extra demo", "extra serve", "extra ray"}


def test_info_says_why_a_fast_path_runs_in_pure_python() -> None:
    pure = info(pure="1")
    assert "the command ring (_ring): pure Python, as UNISON_PURE asks" in pure
    if not _native.built("_ring"):
        pytest.skip("no build of _ring here to break")
    broken = info(code="import sys; sys.modules['unison._ring'] = None\n"
                       "from unison.cli import main; main(['info'])")
    ring = next(line for line in broken if line.startswith("the command ring"))
    assert ring.startswith("the command ring (_ring): pure Python, unison._ring does not "
                           "import"), broken
    assert "Rebuild it" in ring
