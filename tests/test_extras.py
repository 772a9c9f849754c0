"""CI installs every extra that README's test command names, so the tests that skip where
one is missing (support.skip_without) never skip there in silence."""

from __future__ import annotations

import os

import pytest

from support import EXTRAS, missing


@pytest.mark.skipif(os.environ.get("CI", "").lower() not in ("1", "true"),
                    reason="CI only: elsewhere a missing extra skips the tests that need it")
def test_ci_has_every_test_extra() -> None:
    assert missing(*EXTRAS) == [], "README's test command installs them: pip install -e '.[test]'"
