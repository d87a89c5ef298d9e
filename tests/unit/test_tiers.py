"""A tier that cannot run skips, unless the run requires it: then it fails."""

from __future__ import annotations

import pytest

from tests.support.tiers import REQUIRED, needs


def test_a_tier_that_can_run_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRED, "topology,citus")
    needs(None, "citus")


def test_a_tier_without_its_tools_skips_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRED, "citus")
    with pytest.raises(pytest.skip.Exception, match="patroni is not installed"):
        needs("patroni is not installed", "topology")


def test_a_required_tier_without_its_tools_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRED, "topology, citus")
    with pytest.raises(pytest.fail.Exception, match=r"citus tier cannot run.*no citus\.so"):
        needs("no citus.so", "citus")
