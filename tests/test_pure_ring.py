"""The pure-Python fallback (UNISON_PURE=1) under the tests that lean hardest on the worker's
loop, the shm channel and the tools that look inside a worker, in a child pytest.

The suite takes the C ring wherever it was built, so the fallback, which a machine without
a compiler runs, is not exercised elsewhere by default. Run by hand under UNISON_PURE=1, the
whole suite once found two failures nothing else had shown (an idle worker's stacks read as
"in unison's own code": docs/benchmarks.md, "Issue 9, twenty-ninth pass"). This keeps a
subset of it in every run; ``UNISON_PURE=1 python -m pytest`` runs all of it.
"""

from __future__ import annotations

import faulthandler
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from support import MARKER
from unison import _native

ROOT = Path(__file__).resolve().parent.parent

FILES = ("test_shm.py", "test_stacks.py", "test_hang.py", "test_cancel.py", "test_death.py",
         "test_sync_progress.py", "test_inline.py", "test_api.py", "test_free.py",
         "test_interrupt.py")
"""The worker's loop, the ring, progress and sync, cancellation, deaths, inline worker 0,
and the stacks and hang reports, on the shm channel (the pipe channel has no C code to
fall back from): about 140 s on 2 vCPUs."""


SKIP = ("not (spares_a_long_numpy_call or fires_for_one_thread_while_others or "
        "does_not_judge_a_worker_whose_pid)")
"""The hang policy's slowest tests (20 s together under the pure ring), which try its
threads, a numpy call and a pid namespace, not the ring: the suite keeps under 20 minutes."""


@pytest.mark.timeout(900)
def test_the_pure_ring_passes_the_loop_and_channel_tests() -> None:
    if _native.pure_asked():
        pytest.skip("this run takes the pure-Python ring already")
    # the child's own faulthandler watches its tests; ours (faulthandler_timeout, 100 s)
    # would dump this wait's stack on a slow machine: wait as long as the timeout instead
    faulthandler.dump_traceback_later(880)
    env = {**os.environ, "UNISON_PURE": "1", "UNISON_TEST_CHANNELS": "shm",  # (see conftest)
           MARKER: secrets.token_hex(8)}  # its own hygiene check counts its own workers
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", SKIP,
         *(str(ROOT / "tests" / f) for f in FILES)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=840, check=False)
    assert proc.returncode == 0, (
        "the pure-Python ring failed tests that the C ring passes (rerun: UNISON_PURE=1 "
        f"python -m pytest {' '.join('tests/' + f for f in FILES)}):\n"
        + proc.stdout[-8000:] + proc.stderr[-2000:])
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
