"""The release rule (DESIGN §8), SQLite's home of it: whether a key whose outcome is unknown
may be made runnable again, because no copy of its request can still reach the upstream.

PostgreSQL asks ``fencegate_release_blocker`` (sql/postgres/015_release_rule.sql); a
differential test holds the two together. Times are epoch seconds from the database clock.
"""

from __future__ import annotations

from typing import Final

NOT_UNKNOWN: Final = "not_unknown"
LEASE_LIVE: Final = "lease_live"
OWNER_ALIVE: Final = "owner_alive"
RELEASE_MARGIN: Final = "release_margin"

# Seconds a request may still be on its way after its gateway stopped being allowed to send.
DEFAULT_RELEASE_MARGIN: Final = 30.0
# How often a gateway heartbeats its row; it counts as alive for three of these.
DEFAULT_GATEWAY_HEARTBEAT: Final = 2.0


def gateway_instance(owner: str | None) -> str:
    """The gateway process that holds a reservation: its owner is ``"{instance}/{n}"``."""
    return (owner or "").split("/", 1)[0]


def release_blocker(
    *,
    state: str | None,
    locked_until: float | None,
    owner_alive: bool,
    margin: float,
    now: float,
) -> str | None:
    """None when releasing is safe now, else why not (first match wins)."""
    if state not in ("in_flight", "outcome_unknown"):
        return NOT_UNKNOWN
    if state == "in_flight" and locked_until is not None and locked_until > now:
        return LEASE_LIVE
    if state == "in_flight" and owner_alive:
        return OWNER_ALIVE
    if (locked_until if locked_until is not None else now) + margin > now:
        return RELEASE_MARGIN
    return None
