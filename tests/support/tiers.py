"""Whether a tier of tests that needs tools beyond Python can run here.

Without its tools a tier skips, saying why (a laptop without Patroni still runs the rest).
Where the run's set-up says it installed them (``FENCEGATE_TEST_TIERS``, comma-separated tier
names, which `.ci/run` sets for what it installed), a missing tool fails the tier instead: a
skip there would hide a whole tier that is meant to run.
"""

from __future__ import annotations

import os

import pytest

REQUIRED = "FENCEGATE_TEST_TIERS"


def needs(reason: str | None, tier: str) -> None:
    """Go on when ``reason`` is None; otherwise skip the test, or fail it if ``tier`` is
    required here."""
    if reason is None:
        return
    required = {name.strip() for name in os.environ.get(REQUIRED, "").split(",")}
    if tier in required:
        pytest.fail(f"the {tier} tier cannot run although {REQUIRED} requires it: {reason}")
    pytest.skip(reason)
