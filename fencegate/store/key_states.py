"""The states of an idempotency key as operators read them: one vocabulary for the 424
problem body, ``fencegate keys``, and the console.

The table stores ``in_flight``, ``completed`` and ``outcome_unknown``. An ``in_flight`` key
whose lease has run out is, for everyone but the gateway's own bookkeeping, a key whose
outcome is unknown: its gateway stopped (or could not record the answer) after forwarding.
So the operator sees ``outcome_unknown`` for both, with the reason apart.
"""

from __future__ import annotations

KEY_STATES = ("in_flight", "completed", "outcome_unknown")

# Why a key's outcome is unknown.
UPSTREAM_TIMEOUT = "upstream_timeout"  # no answer in time, or the connection lost after sending
LEASE_EXPIRED = "lease_expired"  # its gateway stopped before recording, and its lease ran out


def operator_state(stored_state: str, *, lease_expired: bool) -> tuple[str, str | None]:
    """(state, reason) of a key as stored: reason is None unless the outcome is unknown."""
    if stored_state == "outcome_unknown":
        return "outcome_unknown", UPSTREAM_TIMEOUT
    if stored_state == "in_flight" and lease_expired:
        return "outcome_unknown", LEASE_EXPIRED
    return stored_state, None
