"""The release rule's answer for one key, in words: why it may not be released (or have an
answer recorded by anyone but its gateway) yet, and from when it may.

The rule itself is ``fencegate_release_blocker`` on PostgreSQL and `release_rule` on SQLite;
a store reads a key with its blocker (`KeyRecord.release_blocker`), and this module only
explains it: to the operator refused by ``fencegate keys resolve`` or the console, in
``fencegate keys show``, and in the 424's body.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime

from fencegate.store.base import KeyRecord
from fencegate.store.release_rule import (
    LEASE_LIVE,
    NOT_UNKNOWN,
    OWNER_ALIVE,
    RELEASE_MARGIN,
    gateway_instance,
)

__all__ = ["LEASE_LIVE", "NOT_UNKNOWN", "OWNER_ALIVE", "RELEASE_MARGIN", "ReleaseBlocker"]


def utc(epoch: float) -> str:
    """``2026-12-04T20:51:13Z``, rounded up to the second: never earlier than the time."""
    return datetime.fromtimestamp(math.ceil(epoch), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class ReleaseBlocker:
    """What the release rule said of a key at ``now`` (epoch seconds, database clock)."""

    reason: str  # lease_live | owner_alive | release_margin | not_unknown
    state: str  # as stored: in_flight | outcome_unknown | completed
    gateway: str  # the gateway process holding it ("" when none is named)
    locked_until: float | None  # lease end; for outcome_unknown, when it became unknown
    gateway_heartbeat_at: float | None
    gateway_alive_until: float | None
    margin: float
    now: float

    @classmethod
    def of(cls, record: KeyRecord) -> ReleaseBlocker | None:
        """The blocker a store read with the key; None when releasing it is safe now."""
        if record.release_blocker is None:
            return None
        return cls(
            reason=record.release_blocker,
            state=record.state,
            gateway=gateway_instance(record.owner),
            locked_until=record.locked_until,
            gateway_heartbeat_at=record.gateway_heartbeat_at,
            gateway_alive_until=record.gateway_alive_until,
            margin=record.release_margin,
            now=record.now,
        )

    @property
    def safe_from(self) -> float | None:
        """When releasing becomes safe: exactly, for the margin; at the earliest, while a
        gateway may still record the key itself (if it stops, the margin runs from its lease
        end, and its heartbeats must have run out). None for a key with nothing to
        release."""
        if self.reason == NOT_UNKNOWN:
            return None
        margin_end = (self.locked_until if self.locked_until is not None else self.now) + (
            self.margin
        )
        if self.reason == OWNER_ALIVE and self.gateway_alive_until is not None:
            return max(margin_end, self.gateway_alive_until)
        return margin_end

    def explain(self, *, force_hint: str = "use --force") -> str:
        """Why not, and when: one sentence for the operator."""
        gateway = self.gateway or "(unnamed)"
        safe = self.safe_from
        if self.reason == NOT_UNKNOWN:
            return (
                f"it is {self.state}, not in flight or of unknown outcome: there is nothing to "
                "release or record"
            )
        assert safe is not None
        if self.reason == LEASE_LIVE:
            left = (self.locked_until or self.now) - self.now
            return (
                f"its gateway {gateway} holds it under a live lease ({left:.1f} s left) and may "
                f"be sending it now; it will record or release the key itself (should it stop, "
                f"releasing is safe from {utc(safe)} at the earliest)"
            )
        if self.reason == OWNER_ALIVE:
            beat = self.gateway_heartbeat_at
            ago = f"last heartbeat {self.now - beat:.1f} s ago" if beat is not None else "alive"
            return (
                f"its gateway {gateway} is alive ({ago}); it will record or release the key "
                f"itself (should it stop, releasing is safe from {utc(safe)} at the earliest)"
            )
        ended = self.now - (self.locked_until if self.locked_until is not None else self.now)
        what = (
            f"its outcome became unknown {ended:.1f} s ago"
            if self.state == "outcome_unknown"
            else f"its lease ended {ended:.1f} s ago"
        )
        return (
            f"{what}; a request sent before then may still be on its way: safe to release "
            f"from {utc(safe)} (release margin {self.margin:g} s), or {force_hint}; read the "
            f"upstream's records again after that time before deciding"
        )
