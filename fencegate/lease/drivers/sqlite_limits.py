"""The claim's limits on SQLite: which candidates a claim may grant (the rule PostgreSQL's
``lease_claim`` applies in SQL; the differential test holds the two together).

A claim is one ``BEGIN IMMEDIATE`` transaction, so claims take turns and the counts read here
are exact. Kinds and keys already full are left out of the candidate scans; the candidates
found are ranked (priority first, then expired leases, then age) per kind, per key and per
provider, and each is granted only while its kind, its key and its provider's bucket have
room, counted over every candidate ranked before it, as PostgreSQL's window functions do.
"""

from __future__ import annotations

import math
import sqlite3
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from fencegate.store.queries import Queries

Q = Queries("sqlite")

# With limits in force each scan looks ahead this many times the batch, since some
# candidates may be cut.
LOOKAHEAD = 4


@dataclass(frozen=True, slots=True)
class Bucket:
    provider: str
    tokens: float  # now, after refilling
    at: float  # when that was computed

    @property
    def available(self) -> int:
        return math.floor(self.tokens)


@dataclass
class Limits:
    """The limits in force for one claim, and the room left under each."""

    max_running: dict[str, int]
    max_per_key: dict[str, int]
    provider: dict[str, str]
    buckets: dict[str, Bucket]
    live_kind: Counter[str]
    live_key: Counter[tuple[str, str]]

    @property
    def any(self) -> bool:
        return bool(self.max_running or self.max_per_key or self.provider)

    def full_kinds(self) -> list[str]:
        return [k for k, n in self.max_running.items() if self.live_kind[k] >= n]

    def full_keys(self) -> list[tuple[str, str]]:
        return [
            (kind, key)
            for (kind, key), n in self.live_key.items()
            if kind in self.max_per_key and n >= self.max_per_key[kind]
        ]

    def scan_arguments(self) -> dict[str, str]:
        return {
            "full_kinds": orjson.dumps(self.full_kinds()).decode(),
            "full_keys": orjson.dumps(self.full_keys()).decode(),
        }


def read_limits(conn: sqlite3.Connection, kinds: str | None, now: float) -> Limits:
    rows = conn.execute(Q.lease_limits, {"kinds": kinds}).fetchall()
    limits = Limits(
        max_running={r["kind"]: r["max_running"] for r in rows if r["max_running"]},
        max_per_key={r["kind"]: r["max_running_per_key"] for r in rows if r["max_running_per_key"]},
        provider={r["kind"]: r["provider"] for r in rows if r["provider"]},
        buckets={},
        live_kind=Counter(),
        live_key=Counter(),
    )
    if not rows:
        return limits
    limited = orjson.dumps([r["kind"] for r in rows]).decode()
    for row in conn.execute(Q.lease_live, {"now": now, "limited": limited}):
        limits.live_kind[row["kind"]] += row["n"]
        if row["concurrency_key"] is not None:
            limits.live_key[row["kind"], row["concurrency_key"]] += row["n"]
    providers = orjson.dumps(sorted(set(limits.provider.values()))).decode()
    for row in conn.execute(Q.lease_buckets, {"providers": providers}):
        rate = row["capacity"] / row["per_seconds"]
        elapsed = max(now - row["refilled_at"], 0.0)
        tokens = min(row["capacity"], row["tokens"] + rate * elapsed)
        at = max(now, row["refilled_at"])
        limits.buckets[row["provider"]] = Bucket(row["provider"], tokens, at)
    # A provider without a bucket limits nothing.
    limits.provider = {k: p for k, p in limits.provider.items() if p in limits.buckets}
    return limits


def _order(candidate: Any) -> tuple[int, int, float, int]:
    expired_at = candidate["expired_at"]
    return (
        -int(candidate["priority"]),
        int(candidate["pass"]),
        math.inf if expired_at is None else float(expired_at),
        int(candidate["id"]),
    )


def choose(candidates: Sequence[Any], limits: Limits, limit: int) -> list[Any]:
    """The candidates to grant, best first, at most ``limit``."""
    ranked = sorted(candidates, key=_order)
    in_kind: Counter[str] = Counter()
    in_key: Counter[tuple[str, Any]] = Counter()
    in_bucket: Counter[str] = Counter()
    chosen: list[Any] = []
    for candidate in ranked:
        kind, key = candidate["kind"], candidate["concurrency_key"]
        provider = limits.provider.get(kind)
        in_kind[kind] += 1
        in_key[kind, key] += 1
        if provider is not None:
            in_bucket[provider] += 1
        if kind in limits.max_running and (
            in_kind[kind] > limits.max_running[kind] - limits.live_kind[kind]
        ):
            continue
        if (
            kind in limits.max_per_key
            and key is not None
            and in_key[kind, key] > limits.max_per_key[kind] - limits.live_key[kind, key]
        ):
            continue
        if provider is not None and in_bucket[provider] > limits.buckets[provider].available:
            continue
        chosen.append(candidate)
    return chosen[:limit]


def spend_tokens(conn: sqlite3.Connection, limits: Limits, chosen: Sequence[Any]) -> None:
    """Every bucket read is written back: refilled up to now, less the tokens taken."""
    used = Counter(limits.provider[c["kind"]] for c in chosen if c["kind"] in limits.provider)
    for bucket in limits.buckets.values():
        conn.execute(
            Q.lease_spend_tokens,
            {
                "provider": bucket.provider,
                "tokens": bucket.tokens - used[bucket.provider],
                "at": bucket.at,
            },
        )
