"""The gateway's 424 for a key of unknown outcome says from when settling it by hand is safe
(the moment it became unknown plus the release margin, rounded up to the second) and, for a
route that reconciles, that fencegate is asking the upstream itself."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

from fencegate.gateway.engine import outcome_unknown
from fencegate.store import Decision, Outcome
from fencegate.store.release import utc


def test_the_424_says_when_releasing_becomes_safe_and_whether_fencegate_asks_itself() -> None:
    since = 1_796_000_000.4  # safe-from rounds up: never earlier than the time
    decision = Decision(
        Outcome.UNKNOWN, attempt=1, key_state="outcome_unknown", unknown_since=since
    )
    plain = outcome_unknown(decision, "acme", "k", release_margin=30)
    body = plain.to_dict()
    assert body["release_safe_from"] == utc(since + 30) == "2026-11-30T00:53:51Z"
    assert body["release_margin"] == 30
    assert f"Settling it by hand is safe from {utc(since + 30)}" in body["detail"]
    assert "reconcile_after" not in body and "asking the upstream" not in body["detail"]

    reconciling = cast(
        Decision,
        SimpleNamespace(
            outcome=Outcome.UNKNOWN, attempt=1, key_state="outcome_unknown",
            unknown_since=since, reconcile_after=since + 60,
        ),
    )  # fmt: skip
    body = outcome_unknown(reconciling, "acme", "k", release_margin=30).to_dict()
    assert "fencegate is asking the upstream whether it ran" in body["detail"]
    assert body["reconcile_after"] == utc(since + 60)
