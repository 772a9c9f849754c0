"""The chaos loop of tests/chaos.py in CI: a fixed seed, at least 200 rounds of random
operations and faults on both channels, every one right or the right error in its bound, and
nothing left behind after any round. ``python tests/chaos.py --rounds N --seed S`` runs it
longer (docs/reliability.md has a 5,000-round figure)."""

from __future__ import annotations

import time

import pytest

from chaos import Chaos

ROUNDS = 220
TIME_LIMIT = 240.0
"""Seconds the rounds may take on a loaded 2-core machine (about 30 s when quiet)."""


@pytest.mark.timeout(TIME_LIMIT + 120)
@pytest.mark.parametrize("seed", [20261130])
def test_chaos_rounds_are_right_or_fail_in_bound_and_leave_nothing(seed: int) -> None:
    started = time.monotonic()
    tally = Chaos(seed).run(ROUNDS)
    took = time.monotonic() - started
    assert sum(tally.steps.values()) == ROUNDS
    assert took < TIME_LIMIT, f"{ROUNDS} rounds took {took:.0f} s"
    faults = {"SIGKILL a worker", "SIGKILL in a call", "SIGSTOP a worker", "worker exits",
              "exception in a worker", "exception pickling a result",
              "Ctrl-C in the controller", "SIGKILL the controller"}
    assert faults <= set(tally.steps), f"a fault was never drawn: {faults - set(tally.steps)}"
