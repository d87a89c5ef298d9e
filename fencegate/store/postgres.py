"""The gateway store on PostgreSQL.

Decisions and recorded answers that queue up while a round trip runs go together in the
next one: one ``step`` query (one round trip, one transaction), which also writes their
rows in the decision history. Releasing, marking unknown and renewing are one conditional
statement each. The SQL is in ``sql/postgres/queries/gateway.sql``; connections, deadlines
and the error rule are `PgDatabase`'s.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import asyncpg
import orjson

from fencegate.errors import StoreUnavailable
from fencegate.store.base import (
    DecideRequest,
    Decision,
    DeferredDecision,
    GatewayStore,
    KeyRecord,
    Outcome,
    Reservation,
    Resolution,
    ResolveAudit,
    ResolveResult,
    StoredResponse,
)
from fencegate.store.batching import Batcher
from fencegate.store.pg import PgDatabase
from fencegate.store.queries import Queries
from fencegate.store.release_rule import DEFAULT_RELEASE_MARGIN

# A decision to make, or an answer to record for a reservation.
_Step = DecideRequest | tuple[Reservation, StoredResponse]

Q = Queries("postgresql")


# A dictionary look-up costs less than calling the enum class for every row.
_OUTCOMES = {outcome.value: outcome for outcome in Outcome}


def _decision(row: asyncpg.Record) -> Decision:
    outcome = _OUTCOMES[row["d_outcome"]]
    response = None
    if outcome is Outcome.REPLAY:
        headers = [(str(k), str(v)) for k, v in orjson.loads(row["d_response_headers"])]
        response = StoredResponse(
            status=row["d_response_status"],
            headers=headers,
            body=None if row["d_body_too_large"] else bytes(row["d_response_body"] or b""),
            sha256=row["d_response_sha256"],
        )
    since = row["d_since"]
    reconcile_after = row["d_reconcile_after"]
    return Decision(
        outcome=outcome,
        last_accepted=row["d_last_accepted"],
        attempt=row["d_attempt"],
        reserved_age=row["d_reserved_age"],
        key_state=row["d_key_state"],
        unknown_since=since.timestamp() if since is not None else None,
        response=response,
        reconcile_after=reconcile_after.timestamp() if reconcile_after is not None else None,
    )


def split_steps(
    items: Sequence[_Step],
) -> tuple[list[DecideRequest], list[tuple[Reservation, StoredResponse]]]:
    """A batch's decisions, and its answers to record, each in arrival order."""
    decides = [item for item in items if isinstance(item, DecideRequest)]
    records = [item for item in items if not isinstance(item, DecideRequest)]
    return decides, records


def step_arguments(
    decides: Sequence[DecideRequest],
    records: Sequence[tuple[Reservation, StoredResponse]],
    *,
    history: bool,
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], bool]:
    """The ``step`` query's parameters for a batch: one typed record per decision
    (``fencegate_decide_step``) and per answer to record (``fencegate_record_step``), each
    field in the order of its type."""
    return (
        [
            (
                r.tenant,
                r.key,
                r.fingerprint,
                r.entity,
                r.fence,
                r.owner,
                float(r.lease_seconds),
                float(r.ttl_seconds),
                r.retry_unknown,
                r.request_id,
                r.method,
                r.target,
                r.request_body if r.reconcile else None,
                r.reconcile,
            )
            for r in decides
        ],
        [
            (
                r.tenant,
                r.key,
                r.owner,
                r.attempt,
                a.status,
                orjson.dumps(a.headers).decode(),
                a.body,
                a.sha256,
                a.body is None,
                r.request_id,
            )
            for r, a in records
        ],
        history,
    )


# Batches of different tenants in flight at once on Citus (each holds a pooled connection).
PER_TENANT_IN_FLIGHT = 8


def step_tenant(item: _Step) -> str:
    """The tenant a decision or an answer to record is for."""
    return item.tenant if isinstance(item, DecideRequest) else item[0].tenant


def batch_tenant(items: Sequence[_Step]) -> str | None:
    """The one tenant of a batch, or None when it mixes tenants (the step's first argument:
    on Citus, the distribution argument that sends the call to the tenant's worker)."""
    tenants = {step_tenant(item) for item in items}
    return tenants.pop() if len(tenants) == 1 else None


def server_budget_ms(remaining: float) -> float:
    """The part of a caller's remaining time the server may use, in milliseconds: it stops a
    little before the caller does (as the SQLite store's thread does)."""
    return max(remaining - min(0.2, remaining * 0.2), 0.001) * 1000.0


class PostgresGatewayStore(GatewayStore):
    kind = "postgresql"
    queries = Q
    _db: PgDatabase

    def __init__(self, db: PgDatabase, *, history: bool = True) -> None:
        super().__init__(db, history=history)
        # One round trip at a time: what arrives meanwhile waits for it and goes in the next,
        # so each commit (and its WAL flush) carries more requests. A second concurrent round
        # trip would mostly wait for the same flush, and costs its own commit.
        # On Citus each batch is one tenant's, so that the step runs on the worker holding
        # the tenant's shard as one local transaction (no two-phase commit): the batches of
        # several tenants go at once, each on a connection of the pool.
        self.per_tenant = db.citus
        self._steps: Batcher[_Step, Decision | bool] = (
            Batcher(self._step, max_in_flight=PER_TENANT_IN_FLIGHT, group=step_tenant)
            if self.per_tenant
            else Batcher(self._step, max_in_flight=1)
        )

    async def decide(self, request: DecideRequest, *, timeout: float) -> Decision:
        result = await self._steps.submit(request, timeout=timeout)
        assert isinstance(result, Decision)
        return result

    async def complete(
        self,
        reservation: Reservation,
        response: StoredResponse,
        *,
        timeout: float,
    ) -> bool:
        result = await self._steps.submit((reservation, response), timeout=timeout)
        assert isinstance(result, bool)
        return result

    async def _step(self, items: list[_Step], timeout: float) -> list[Decision | bool]:
        """One round trip for every decision and recorded answer that queued up."""
        decides, records = split_steps(items)
        args = step_arguments(decides, records, history=self.history)
        tenant = batch_tenant(items)
        deadline = time.monotonic() + timeout

        def fetch(conn: asyncpg.Connection) -> Any:
            # Measured once a connection is in hand: the server gets what is left of the
            # caller's time, less a margin for the answer's way back, and rolls the step back
            # rather than commit after the caller gave up.
            budget = server_budget_ms(deadline - time.monotonic())
            return conn.fetch(Q.step, tenant, *args, budget)

        if self.per_tenant:
            rows = await self._db.run(fetch, timeout=timeout)
        else:
            # Steps run one at a time (see `__init__`), so on a connection kept between them.
            rows = await self._db.run_held(fetch, timeout=timeout)
        decisions: dict[int, Decision] = {}
        recorded: dict[int, bool] = {}
        for row in rows:
            index = row["d_index"]
            if index > 0:
                decisions[index - 1] = _decision(row)
            else:
                recorded[-index - 1] = row["d_outcome"] == "completed"
        if len(decisions) != len(decides) or len(recorded) != len(records):
            raise StoreUnavailable("the store answered a batch incompletely")
        results: list[Decision | bool] = []
        next_decide = next_record = 0
        for item in items:
            if isinstance(item, DecideRequest):
                results.append(decisions[next_decide])
                next_decide += 1
            else:
                results.append(recorded[next_record])
                next_record += 1
        return results

    async def _count(self, sql: str, *args: Any, timeout: float) -> int:
        count = await self._db.run(lambda conn: conn.fetchval(sql, *args), timeout=timeout)
        return int(count or 0)

    async def release(
        self, reservation: Reservation, *, upstream_status: int | None = None, timeout: float
    ) -> bool:
        r = reservation
        args = (r.tenant, r.key, r.owner, r.attempt, r.request_id, upstream_status, self.history)
        return await self._count(Q.release, *args, timeout=timeout) > 0

    async def release_abandoned(self, reservation: Reservation, *, timeout: float) -> bool:
        r = reservation
        args = (r.tenant, r.key, r.owner, r.request_id, self.history)
        return await self._count(Q.release_abandoned, *args, timeout=timeout) > 0

    async def mark_unknown(
        self, reservation: Reservation, *, reason: str = "", timeout: float
    ) -> bool:
        r = reservation
        args = (r.tenant, r.key, r.owner, r.attempt, r.request_id, self.history, reason or None)
        return await self._count(Q.mark_unknown, *args, timeout=timeout) > 0

    async def renew(
        self, reservation: Reservation, lease_seconds: float, *, timeout: float
    ) -> bool:
        r = reservation
        args = (r.tenant, r.key, r.owner, r.attempt, float(lease_seconds))
        renewed = await self._db.run(lambda conn: conn.fetchval(Q.renew, *args), timeout=timeout)
        return bool(renewed)

    async def record_decisions(self, rows: list[DeferredDecision], *, timeout: float) -> None:
        args = (
            [r.tenant for r in rows],
            [r.entity for r in rows],
            [r.key for r in rows],
            [r.decision for r in rows],
            [r.attempt for r in rows],
            [r.owner for r in rows],
            [r.request_id for r in rows],
            [r.method for r in rows],
            [r.target for r in rows],
            [float(r.age) for r in rows],
            [float(r.ttl_seconds) for r in rows],
        )
        await self._db.run(lambda conn: conn.execute(Q.record_decisions, *args), timeout=timeout)

    async def remember_nonce(
        self, key_id: str, nonce: str, ttl_seconds: float, *, tenant: str, timeout: float
    ) -> bool:
        args = (tenant, key_id, nonce, float(ttl_seconds))
        fresh = await self._db.run(
            lambda conn: conn.fetchval(Q.remember_nonce, *args), timeout=timeout
        )
        return bool(fresh)

    async def get_key(
        self, tenant: str, key: str, *, margin: float = DEFAULT_RELEASE_MARGIN, timeout: float
    ) -> KeyRecord | None:
        args = (tenant, key, float(margin))
        row = await self._db.run(lambda conn: conn.fetchrow(Q.get_key, *args), timeout=timeout)
        return None if row is None else KeyRecord(**dict(row.items()))

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
        """One transaction on one connection: the key read under its row lock, the change
        (whose statement asks the release rule of the row it changes), the key after, and
        the audit row."""
        change: tuple[Any, ...] = (tenant, key, resolved_by, float(margin), force)
        if response is None:
            sql, done = Q.resolve_released, ResolveResult.RELEASED
        else:
            sql, done = Q.resolve_completed, ResolveResult.COMPLETED
            headers = orjson.dumps(response.headers).decode()
            change += (response.status, headers, response.body, response.sha256)

        async def read(conn: asyncpg.Connection, query: str) -> KeyRecord | None:
            row = await conn.fetchrow(query, tenant, key, float(margin))
            return None if row is None else KeyRecord(**dict(row.items()))

        async def run(conn: asyncpg.Connection) -> Resolution:
            async with conn.transaction():
                before = await read(conn, Q.get_key_for_update)
                if before is None:
                    return Resolution(ResolveResult.NOT_FOUND)
                if not await conn.fetchval(sql, *change):
                    return await refused(conn, before)
                resolution = Resolution(done, before, await read(conn, Q.get_key), forced=force)
                if audit is not None:
                    await conn.execute(Q.audit, *audit(resolution).arguments())
                return resolution

        async def refused(conn: asyncpg.Connection, before: KeyRecord) -> Resolution:
            if before.state not in ("in_flight", "outcome_unknown"):
                return Resolution(ResolveResult.NOT_UNKNOWN, before)
            if before.release_blocker is None:
                # The row is locked, so only its gateway's registry row changed between
                # the read and the change (a heartbeat): ask again for the words.
                before = await read(conn, Q.get_key) or before
            return Resolution(ResolveResult.BLOCKED, before)

        return await self._db.run(run, timeout=timeout)
