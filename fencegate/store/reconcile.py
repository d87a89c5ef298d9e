"""The reconciler's statements (DESIGN §8): claim keys whose outcome is unknown once releasing
them is safe, then settle each by what the upstream said, conditional on the key being as
claimed. The SQL is in ``sql/<store>/queries/reconcile.sql``; the loop that runs these is
`fencegate.gateway.reconciler`.

A claim pushes the key's next look (``reconcile_after``) past the probe and a backoff and
counts the try, in the statement that finds it due, so two gateways never probe one key at
once; the try count it returns is the claim's token: every settling statement requires the
same owner, attempt, state and tries, so a key that changed meanwhile (answered by its
gateway, taken over, resolved by an operator, claimed again after this probe overran) is left
alone.
"""

from __future__ import annotations

import abc
import sqlite3
from dataclasses import dataclass
from typing import Any, ClassVar

import asyncpg
import orjson

from fencegate.store.base import GatewayStore, StoredResponse
from fencegate.store.pg import PgDatabase
from fencegate.store.queries import Queries
from fencegate.store.release_rule import gateway_instance, release_blocker
from fencegate.store.sqlite import History, clock
from fencegate.store.sqlite_db import SQLiteDatabase

# The longest wait between two looks at a key the upstream could not settle.
MAX_BACKOFF_SECONDS = 300.0

PG = Queries("postgresql")
LITE = Queries("sqlite")


def backoff(tries: int) -> float:
    """The wait after the ``tries``-th probe said nothing: 1 s, 2 s, 4 s … at most 5 min."""
    return min(2.0 ** min(max(tries - 1, 0), 20), MAX_BACKOFF_SECONDS)


@dataclass(frozen=True, slots=True)
class ClaimedKey:
    """A key this reconciler may probe, as the claim found it; ``tries`` counts this one."""

    tenant: str
    key: str
    owner: str | None
    attempt: int
    state: str  # in_flight (lease expired) | outcome_unknown
    method: str | None
    target: str | None
    body: bytes | None
    entity: str | None
    fence: int | None
    tries: int


def _claimed(row: Any) -> ClaimedKey:
    body = row["request_body"]
    return ClaimedKey(
        tenant=str(row["tenant"]),
        key=str(row["key"]),
        owner=row["owner"],
        attempt=int(row["attempt"]),
        state=str(row["state"]),
        method=row["method"],
        target=row["target"],
        body=bytes(body) if body is not None else None,
        entity=row["entity"],
        fence=row["fence"],
        tries=int(row["reconcile_tries"]),
    )


class ReconcileStore(abc.ABC):
    """The reconciler's view of a gateway store (it shares the store's connections)."""

    kind: ClassVar[str]

    @abc.abstractmethod
    async def claim(
        self, *, margin: float, hold: float, limit: int, timeout: float
    ) -> list[ClaimedKey]:
        """Up to ``limit`` due keys whose release is safe (``margin``: the release margin),
        each pushed ``hold`` seconds (the longest probe) and a backoff into the future."""

    @abc.abstractmethod
    async def complete(
        self, claimed: ClaimedKey, response: StoredResponse, *, note: str, by: str, timeout: float
    ) -> bool:
        """Store the upstream's answer (resolution ``reconciled``, history
        ``reconciled_completed``); False when the key is no longer as claimed."""

    @abc.abstractmethod
    async def release(self, claimed: ClaimedKey, *, margin: float, by: str, timeout: float) -> bool:
        """Delete the key (history ``reconciled_released``); False when it is no longer as
        claimed or the release rule now forbids it."""

    @abc.abstractmethod
    async def later(
        self, claimed: ClaimedKey, *, note: str, after: float, timeout: float
    ) -> float | None:
        """Note why the probe said nothing and look again ``after`` seconds from now; the
        time of that look (epoch seconds), None when the key is no longer as claimed."""


def _identity(c: ClaimedKey) -> tuple[Any, ...]:
    return (c.tenant, c.key, c.owner, c.attempt, c.state, c.tries)


class PostgresReconcileStore(ReconcileStore):
    kind = "postgresql"

    def __init__(self, db: PgDatabase) -> None:
        self._db = db

    async def claim(
        self, *, margin: float, hold: float, limit: int, timeout: float
    ) -> list[ClaimedKey]:
        """One claim across tenants; on a Citus coordinator, which locks no rows across
        shards, the tenants with due keys first (a read on every worker, no locks), then the
        same claim for each of them in turn (on its worker), up to ``limit`` keys in all."""
        margin, hold = float(margin), float(hold)

        async def across(conn: asyncpg.Connection) -> list[asyncpg.Record]:
            return await conn.fetch(
                PG.reconcile_claim, margin, int(limit), hold, MAX_BACKOFF_SECONDS, None
            )

        async def per_tenant(conn: asyncpg.Connection) -> list[asyncpg.Record]:
            tenants = await conn.fetch(PG.reconcile_due_tenants, margin, int(limit))
            rows: list[asyncpg.Record] = []
            for found in tenants:
                left = int(limit) - len(rows)
                if left <= 0:
                    break
                rows += await conn.fetch(
                    PG.reconcile_claim, margin, left, hold, MAX_BACKOFF_SECONDS, found["tenant"]
                )
            return rows

        rows = await self._db.run(per_tenant if self._db.citus else across, timeout=timeout)
        return [_claimed(row) for row in rows]

    async def complete(
        self, claimed: ClaimedKey, response: StoredResponse, *, note: str, by: str, timeout: float
    ) -> bool:
        args = (
            *_identity(claimed),
            response.status,
            orjson.dumps(response.headers).decode(),
            response.body,
            response.sha256,
            response.body is None,
            note,
            by,
        )
        count = await self._db.run(
            lambda conn: conn.fetchval(PG.reconcile_complete, *args), timeout=timeout
        )
        return bool(count)

    async def release(self, claimed: ClaimedKey, *, margin: float, by: str, timeout: float) -> bool:
        args = (*_identity(claimed), float(margin), by)
        count = await self._db.run(
            lambda conn: conn.fetchval(PG.reconcile_release, *args), timeout=timeout
        )
        return bool(count)

    async def later(
        self, claimed: ClaimedKey, *, note: str, after: float, timeout: float
    ) -> float | None:
        args = (*_identity(claimed), float(after), note)
        found = await self._db.run(
            lambda conn: conn.fetchval(PG.reconcile_later, *args), timeout=timeout
        )
        return None if found is None else float(found.timestamp())


def _which(c: ClaimedKey, now: float) -> dict[str, Any]:
    return {
        "tenant": c.tenant,
        "key": c.key,
        "owner": c.owner,
        "attempt": c.attempt,
        "state": c.state,
        "tries": c.tries,
        "now": now,
    }


def _history(log: History, decision: str, c: ClaimedKey, row: sqlite3.Row, **extra: Any) -> None:
    log.add(
        decision,
        tenant=c.tenant,
        entity=row["entity"],
        key=c.key,
        fence=row["fence"],
        attempt=row["attempt"],
        method=row["method"],
        target=row["target"],
        expires_at=row["expires_at"],
        **extra,
    )


class SQLiteReconcileStore(ReconcileStore):
    kind = "sqlite"

    def __init__(self, db: SQLiteDatabase) -> None:
        self._db = db

    async def claim(
        self, *, margin: float, hold: float, limit: int, timeout: float
    ) -> list[ClaimedKey]:
        def run(conn: sqlite3.Connection) -> list[ClaimedKey]:
            now = clock(conn)
            due = conn.execute(LITE.reconcile_due, {"now": now, "margin": margin}).fetchall()
            if not due:
                return []
            alive = {r[0] for r in conn.execute(LITE.gateways_alive, {"now": now})}
            claimed: list[ClaimedKey] = []
            for row in due:
                blocker = release_blocker(
                    state=row["state"],
                    locked_until=row["locked_until"],
                    owner_alive=gateway_instance(row["owner"]) in alive,
                    margin=margin,
                    now=now,
                )
                if blocker is not None:
                    continue
                found = conn.execute(
                    LITE.reconcile_claim,
                    {
                        "tenant": row["tenant"],
                        "key": row["key"],
                        "now": now,
                        "hold": hold,
                        "most": MAX_BACKOFF_SECONDS,
                    },
                ).fetchone()
                claimed.append(_claimed(found))
                if len(claimed) >= limit:
                    break
            return claimed

        return await self._db.run(run, timeout=timeout, write=True)

    async def complete(
        self, claimed: ClaimedKey, response: StoredResponse, *, note: str, by: str, timeout: float
    ) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            log = History(conn, clock(conn), keep=True)
            answer = {
                "status": response.status,
                "headers": orjson.dumps(response.headers).decode(),
                "body": response.body,
                "sha256": response.sha256,
                "too_large": int(response.body is None),
                "note": note,
            }
            row = conn.execute(
                LITE.reconcile_complete, _which(claimed, log.now) | answer
            ).fetchone()
            if row is None:
                return False
            _history(
                log, "reconciled_completed", claimed, row, owner=by, upstream_status=response.status
            )
            log.write()
            return True

        return await self._db.run(run, timeout=timeout, write=True)

    async def release(self, claimed: ClaimedKey, *, margin: float, by: str, timeout: float) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            log = History(conn, clock(conn), keep=True)
            which = _which(claimed, log.now)
            now_row = conn.execute(LITE.reconcile_get, which).fetchone()
            if now_row is None:
                return False
            alive = {r[0] for r in conn.execute(LITE.gateways_alive, which)}
            blocker = release_blocker(
                state=now_row["state"],
                locked_until=now_row["locked_until"],
                owner_alive=gateway_instance(now_row["owner"]) in alive,
                margin=margin,
                now=log.now,
            )
            if blocker is not None:
                return False
            row = conn.execute(LITE.reconcile_release, which).fetchone()
            if row is None:
                return False
            _history(log, "reconciled_released", claimed, row, owner=by)
            log.write()
            return True

        return await self._db.run(run, timeout=timeout, write=True)

    async def later(
        self, claimed: ClaimedKey, *, note: str, after: float, timeout: float
    ) -> float | None:
        def run(conn: sqlite3.Connection) -> float | None:
            which = _which(claimed, clock(conn)) | {"note": note, "after": after}
            row = conn.execute(LITE.reconcile_later, which).fetchone()
            return None if row is None else float(row[0])

        return await self._db.run(run, timeout=timeout, write=True)


def reconcile_store(store: GatewayStore) -> ReconcileStore:
    """The reconciler's statements on the connections of a gateway store."""
    db = store.database
    if isinstance(db, PgDatabase):
        return PostgresReconcileStore(db)
    if isinstance(db, SQLiteDatabase):
        return SQLiteReconcileStore(db)
    raise TypeError(f"no reconciler statements for {type(db).__name__}")
