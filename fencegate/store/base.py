"""The gateway store's base class and the records it returns.

A store runs steps 3 and 4 of the decision order as one transaction (`decide`), and later
records what the upstream did with the reservation it granted (`complete`, `release`,
`mark_unknown`), each conditional on still owning it. The decision logic around these calls
lives in `fencegate.gateway.engine`; a store only runs SQL. `GatewayStore` holds what both
backends do alike (reads and deletes by named query through the connection layer); each
subclass holds its backend's `Database` and the statements that differ.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, ClassVar, Literal

from fencegate.errors import StoreUnavailable
from fencegate.store.audit import AuditEntry
from fencegate.store.queries import Queries
from fencegate.store.release_rule import DEFAULT_RELEASE_MARGIN

if TYPE_CHECKING:
    from fencegate.store.backends import NamedQueries

__all__ = ["StoreUnavailable"]  # one class for every store, defined with the error root

DEFAULT_FENCE_TTL_SECONDS = 30 * 24 * 3600.0  # fences outlive keys: a late worker may wake up


class Outcome(StrEnum):
    STALE = "stale"  # fence below last_accepted: nothing stored
    FENCE_ONLY = "fence_only"  # fence accepted, no key to reserve
    RESERVED = "reserved"  # new key, reserved for this gateway
    TAKEN_OVER = "taken_over"  # in-flight key whose lease had expired
    RETRY_UNKNOWN = "retry_unknown"  # outcome_unknown key, route says retry
    REPLAY = "replay"  # completed, same fingerprint
    MISMATCH = "mismatch"  # same key, other request
    IN_FLIGHT = "in_flight"  # another holder's lease is live
    UNKNOWN = "unknown"  # outcome_unknown key, route says reject
    # In flight, lease over, but its gateway is alive: it still owes the key a write (an
    # answer, a release), so the client is told to retry rather than that an operator must act.
    PENDING = "pending"

    @property
    def forwards(self) -> bool:
        return self in _FORWARDING


_FORWARDING = frozenset(
    {Outcome.FENCE_ONLY, Outcome.RESERVED, Outcome.TAKEN_OVER, Outcome.RETRY_UNKNOWN}
)


@dataclass(frozen=True, slots=True)
class DecideRequest:
    tenant: str
    key: str | None
    fingerprint: str
    entity: str | None
    fence: int | None
    owner: str
    lease_seconds: float
    ttl_seconds: float
    retry_unknown: bool
    # For the decision history (written in the decision's own transaction); never payloads.
    request_id: str = ""
    method: str = ""
    target: str = ""  # the path as sent, never the query (it may carry secrets)
    # The route reconciles unknown outcomes: the key keeps its request's body for the probe
    # and is scheduled for the reconciler.
    reconcile: bool = False
    request_body: bytes | None = None


@dataclass(frozen=True, slots=True)
class StoredResponse:
    status: int
    headers: list[tuple[str, str]]
    body: bytes | None  # None when it was too large to store
    sha256: str


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: Outcome
    last_accepted: int | None = None
    attempt: int | None = None
    reserved_age: float | None = None  # for IN_FLIGHT: seconds since the holder reserved it
    key_state: str | None = None  # for UNKNOWN: outcome_unknown, or in_flight (lease expired)
    unknown_since: float | None = None  # for UNKNOWN: epoch seconds (marked, or lease end)
    response: StoredResponse | None = None  # for REPLAY
    # For UNKNOWN on a reconciling route: when the reconciler asks the upstream next.
    reconcile_after: float | None = None


@dataclass(frozen=True, slots=True)
class Reservation:
    """What identifies one holder of one key: the conditional writes check all of it."""

    tenant: str
    key: str
    owner: str
    attempt: int
    request_id: str = ""  # the request behind it, for the decision history


@dataclass(frozen=True, slots=True)
class DeferredDecision:
    """A decision the gateway answered without the store (a replay, or a key reused, from
    its copy of a completed answer): its history row, written later in a batch. ``age`` is
    how many seconds before the write the decision was made (the row's time is the
    database's clock less that); ``ttl_seconds`` how long the row is kept from then."""

    tenant: str
    key: str
    decision: str
    entity: str | None
    attempt: int | None
    owner: str
    request_id: str
    method: str
    target: str
    ttl_seconds: float
    age: float = 0.0


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One idempotency key as an operator sees it (times in epoch seconds, database clock)."""

    tenant: str
    key: str
    state: str  # in_flight | completed | outcome_unknown
    unknown: bool  # outcome_unknown, or in_flight with an expired lease
    owner: str | None
    attempt: int
    entity: str | None
    fence: int | None
    fingerprint: str
    locked_until: float | None
    reserved_at: float | None
    created_at: float
    completed_at: float | None
    expires_at: float
    response_status: int | None
    now: float
    # The request as routed (never its query or body), and how an unknown outcome ended.
    method: str | None = None
    target: str | None = None
    unknown_reason: str | None = None  # the limit that fired
    resolution: str | None = None  # reconciled | operator | forced
    reconcile_after: float | None = None  # when the reconciler looks next (None: it does not)
    reconcile_tries: int = 0
    reconcile_note: str | None = None
    # Its gateway process's registry row (None: none, the process stopped or never ran).
    gateway_heartbeat_at: float | None = None
    gateway_alive_until: float | None = None
    # What the release rule says of it at ``now`` with ``release_margin`` (None: releasing,
    # or recording an answer for it, is safe now); `fencegate.store.release` explains it.
    release_blocker: str | None = None
    release_margin: float = DEFAULT_RELEASE_MARGIN


class ResolveResult(StrEnum):
    COMPLETED = "completed"  # the operator's answer is stored and will be replayed
    RELEASED = "released"  # the key is gone: the next request runs again
    NOT_FOUND = "not_found"
    NOT_UNKNOWN = "not_unknown"  # completed: nothing to release, left alone
    BLOCKED = "blocked"  # the release rule refused: a copy may still reach the upstream


@dataclass(frozen=True, slots=True)
class Resolution:
    """What an operator's resolve did. ``before`` is the key as the resolve's transaction
    read it (for BLOCKED, with the release blocker that refused it), ``after`` as it left it
    (None once released)."""

    result: ResolveResult
    before: KeyRecord | None = None
    after: KeyRecord | None = None
    forced: bool = False


# What a resolve's caller audits, given what it did: written in the resolve's transaction.
ResolveAudit = Callable[[Resolution], AuditEntry]


@dataclass(frozen=True, slots=True)
class PurgeCounts:
    keys: int
    fences: int
    nonces: int
    decisions: int = 0


@dataclass(frozen=True, slots=True)
class GatewayRow:
    """One gateway process in the registry (times in epoch seconds, database clock)."""

    instance: str  # Engine.owner: host:pid:uuid8
    host: str
    pid: int
    started_at: float
    heartbeat_at: float
    alive_until: float
    now: float

    @property
    def alive(self) -> bool:
        return self.alive_until > self.now


class GatewayStore(abc.ABC):
    """The gateway's store on one backend (`PostgresGatewayStore`, `SQLiteGatewayStore`),
    built on the connection layer `fencegate.store.backends` opened for it."""

    kind: ClassVar[Literal["postgresql", "sqlite"]]
    queries: ClassVar[Queries]

    def __init__(self, db: NamedQueries, *, history: bool = True) -> None:
        self._db = db
        # Whether decisions are kept in the history (one row each, in their transaction).
        self.history = history

    @property
    def database(self) -> NamedQueries:
        """The connection layer this store runs on (the reconciler's statements share it)."""
        return self._db

    @abc.abstractmethod
    async def decide(self, request: DecideRequest, *, timeout: float) -> Decision: ...

    @abc.abstractmethod
    async def complete(
        self,
        reservation: Reservation,
        response: StoredResponse,
        *,
        timeout: float,
    ) -> bool:
        """Store the response; False when the reservation is no longer ours. The key keeps
        the expiry it was given at reservation."""

    @abc.abstractmethod
    async def release(
        self, reservation: Reservation, *, upstream_status: int | None = None, timeout: float
    ) -> bool:
        """Delete the reservation (nothing was sent, or a 5xx the route does not store)."""

    @abc.abstractmethod
    async def release_abandoned(self, reservation: Reservation, *, timeout: float) -> bool:
        """Delete an in-flight reservation held by ``reservation.owner``, whatever its
        attempt: what a decision the gateway gave up on (503) may have left behind, since
        its statement can still commit after the caller stopped waiting. False when there
        is none."""

    @abc.abstractmethod
    async def mark_unknown(
        self, reservation: Reservation, *, reason: str = "", timeout: float
    ) -> bool:
        """The request was sent and no answer came back; ``reason`` is the limit that fired
        ("no answer within 2.0s"), kept for the operator."""

    @abc.abstractmethod
    async def renew(
        self, reservation: Reservation, lease_seconds: float, *, timeout: float
    ) -> bool:
        """Extend the in-flight lease; False when it already expired or was taken over."""

    @abc.abstractmethod
    async def record_decisions(self, rows: list[DeferredDecision], *, timeout: float) -> None:
        """Write history rows of decisions made without the store, in one transaction."""

    @abc.abstractmethod
    async def remember_nonce(
        self, key_id: str, nonce: str, ttl_seconds: float, *, tenant: str, timeout: float
    ) -> bool: ...

    @abc.abstractmethod
    async def get_key(
        self, tenant: str, key: str, *, margin: float = DEFAULT_RELEASE_MARGIN, timeout: float
    ) -> KeyRecord | None:
        """One key as an operator sees it, with what the release rule says of it now given
        the release ``margin`` (seconds)."""

    @abc.abstractmethod
    async def resolve_key(
        self,
        tenant: str,
        key: str,
        response: StoredResponse | None,
        *,
        resolved_by: str,
        margin: float = DEFAULT_RELEASE_MARGIN,
        force: bool = False,
        audit: ResolveAudit | None = None,
        timeout: float,
    ) -> Resolution:
        """Someone other than its gateway settles a key that is in flight or of unknown
        outcome: store ``response`` as its result, or with None release it (the next request
        runs again). Only when the release rule allows it now (no copy of its request can
        still reach the upstream, given the release ``margin`` in seconds), checked in the
        statement or transaction that makes the change; else BLOCKED, and the key is left
        alone. ``force`` skips the rule (never for a completed key) and marks the key's
        resolution ``forced`` (else ``operator``). ``audit`` gives the audit row, written in
        the same transaction: the change and its record land together or not at all."""

    async def purge(
        self,
        *,
        fence_ttl_seconds: float = DEFAULT_FENCE_TTL_SECONDS,
        batch_size: int = 1000,
        timeout: float,
    ) -> PurgeCounts:
        """Delete in batches, so that no statement holds many row locks (PostgreSQL) or the
        write lock (SQLite) for long; ``timeout`` bounds each batch."""
        q = self.queries
        return PurgeCounts(
            keys=await self._purge(q.purge_keys, (batch_size,), timeout=timeout),
            fences=await self._purge(
                q.purge_fences, (batch_size, float(fence_ttl_seconds)), timeout=timeout
            ),
            nonces=await self._purge(q.purge_nonces, (batch_size,), timeout=timeout),
            decisions=await self._purge(q.purge_decisions, (batch_size,), timeout=timeout),
        )

    async def _purge(self, sql: str, args: tuple[int | float, ...], *, timeout: float) -> int:
        """One purge statement (its batch size first), repeated until a batch comes short."""
        total = 0
        while True:
            deleted = await self._db.execute(sql, args, timeout=timeout)
            total += deleted
            if deleted < args[0]:
                return total

    # -- the gateway registry (fencegate.gateway.registry) --------------------------------

    async def heartbeat_gateway(
        self, instance: str, *, host: str, pid: int, alive_seconds: float, timeout: float
    ) -> None:
        """Register the gateway process ``instance``, or keep it registered: alive for
        ``alive_seconds`` from now (database clock)."""
        args = (instance, host, int(pid), float(alive_seconds))
        await self._db.execute(self.queries.gateway_heartbeat, args, timeout=timeout)

    async def deregister_gateway(self, instance: str, *, timeout: float) -> bool:
        """A clean stop: the process owes no write any more."""
        return (
            await self._db.execute(self.queries.gateway_deregister, (instance,), timeout=timeout)
            > 0
        )

    async def purge_gateways(self, *, dead_for_seconds: float, timeout: float) -> int:
        """Forget processes whose registration ran out that long ago (killed, not stopped)."""
        args = (float(dead_for_seconds),)
        return await self._db.execute(self.queries.gateway_purge, args, timeout=timeout)

    async def gateways(self, *, timeout: float) -> list[GatewayRow]:
        rows = await self._db.fetch(self.queries.gateways, (), timeout=timeout)
        return [GatewayRow(**row) for row in rows]

    async def ping(self, *, timeout: float) -> None:
        await self._db.fetch(self.queries.ping, (), timeout=timeout)

    async def applied_migrations(self, *, timeout: float) -> list[str] | None:
        """Names in `fencegate_migrations`; None when the table does not exist."""
        found = await self._db.fetch(self.queries.migrations_table, (), timeout=timeout)
        if not found or not next(iter(found[0].values())):
            return None
        rows = await self._db.fetch(self.queries.applied_migrations, (), timeout=timeout)
        return [str(row["name"]) for row in rows]

    async def close(self) -> None:
        await self._db.close()
