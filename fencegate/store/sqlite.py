"""The gateway store on SQLite: the embedded default.

Each decision runs in one BEGIN IMMEDIATE transaction on the store's single connection, so
the read and the write it decides on cannot interleave with another process's write (WAL
lets several gateway processes share the file). Times come from the database clock.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypeVar

import orjson

from fencegate.sqlite_db import SQLITE_NOW, SQLiteDatabase, write_transaction
from fencegate.store.base import (
    DEFAULT_FENCE_TTL_SECONDS,
    DecideRequest,
    Decision,
    KeyRecord,
    Outcome,
    PurgeCounts,
    Reservation,
    ResolveResult,
    StoredResponse,
    StoreUnavailable,
)
from fencegate.store.batching import Batcher

T = TypeVar("T")

NOW = SQLITE_NOW

_OWNED = "tenant = ? AND key = ? AND owner = ? AND attempt = ? AND state = 'in_flight'"
# A late answer from the holder of a key marked unknown still completes it.
_HELD = (
    "tenant = ? AND key = ? AND owner = ? AND attempt = ? "
    "AND state IN ('in_flight', 'outcome_unknown')"
)


class _CallerGaveUp(Exception):
    """The caller's timeout passed while this call waited for the write lock."""


def _check_deadline(deadline: float) -> None:
    # The caller has already answered 503; committing now would leave a reservation (or a
    # nonce) behind that no one acts on, and a retry would find it in the way.
    if time.monotonic() > deadline:
        raise _CallerGaveUp


def _decide_many(
    conn: sqlite3.Connection, requests: list[DecideRequest], deadline: float
) -> list[Decision | BaseException]:
    """Decisions in arrival order, in one write transaction: one lock and one commit for
    everything that queued up while the previous batch ran."""
    with write_transaction(conn):
        _check_deadline(deadline)
        now = float(conn.execute(f"SELECT {NOW}").fetchone()[0])
        return [_decide(conn, r, now) for r in requests]


def _decide(conn: sqlite3.Connection, r: DecideRequest, now: float) -> Decision:
    last: int | None = None
    if r.fence is not None:
        row = conn.execute(
            "SELECT last_accepted FROM fences WHERE tenant = ? AND entity = ?",
            (r.tenant, r.entity),
        ).fetchone()
        if row is not None and r.fence < row[0]:
            return Decision(Outcome.STALE, last_accepted=int(row[0]))
        conn.execute(
            "INSERT INTO fences (tenant, entity, last_accepted, updated_at) "
            "VALUES (?, ?, ?, ?) ON CONFLICT (tenant, entity) DO UPDATE "
            "SET last_accepted = excluded.last_accepted, updated_at = excluded.updated_at",
            (r.tenant, r.entity, r.fence, now),
        )
        last = r.fence
    if r.key is None:
        return Decision(Outcome.FENCE_ONLY, last_accepted=last)

    row = conn.execute(
        "SELECT * FROM idempotency_keys WHERE tenant = ? AND key = ?", (r.tenant, r.key)
    ).fetchone()
    if row is None or row["expires_at"] <= now:
        conn.execute(
            "INSERT OR REPLACE INTO idempotency_keys (tenant, key, fingerprint, state, "
            "owner, locked_until, attempt, entity, fence, created_at, reserved_at, expires_at) "
            "VALUES (?, ?, ?, 'in_flight', ?, ?, 1, ?, ?, ?, ?, ?)",
            (
                r.tenant,
                r.key,
                r.fingerprint,
                r.owner,
                now + r.lease_seconds,
                r.entity,
                r.fence,
                now,
                now,
                now + r.ttl_seconds,
            ),
        )
        return Decision(Outcome.RESERVED, last_accepted=last, attempt=1)
    if row["fingerprint"] != r.fingerprint:
        return Decision(Outcome.MISMATCH, last_accepted=last, attempt=row["attempt"])
    state = row["state"]
    if state == "completed":
        response = StoredResponse(
            status=int(row["response_status"]),
            headers=[(str(k), str(v)) for k, v in orjson.loads(row["response_headers"])],
            body=None if row["body_too_large"] else bytes(row["response_body"] or b""),
            sha256=str(row["response_sha256"]),
        )
        return Decision(
            Outcome.REPLAY, last_accepted=last, attempt=row["attempt"], response=response
        )
    if state == "in_flight" and row["locked_until"] > now:
        reserved_at = row["reserved_at"] if row["reserved_at"] is not None else row["created_at"]
        return Decision(
            Outcome.IN_FLIGHT,
            last_accepted=last,
            attempt=row["attempt"],
            reserved_age=now - float(reserved_at),
        )
    if not r.retry_unknown:
        # Marked unknown, or in flight with an expired lease (its gateway died or could not
        # record): the upstream may have acted. Not forwarded again.
        return Decision(
            Outcome.UNKNOWN,
            last_accepted=last,
            attempt=row["attempt"],
            key_state=state,
            unknown_since=float(row["locked_until"]) if row["locked_until"] is not None else None,
        )
    attempt = int(row["attempt"]) + 1
    conn.execute(
        "UPDATE idempotency_keys SET state = 'in_flight', owner = ?, locked_until = ?, "
        "reserved_at = ?, attempt = ?, entity = ?, fence = ? WHERE tenant = ? AND key = ?",
        (r.owner, now + r.lease_seconds, now, attempt, r.entity, r.fence, r.tenant, r.key),
    )
    outcome = Outcome.TAKEN_OVER if state == "in_flight" else Outcome.RETRY_UNKNOWN
    return Decision(outcome, last_accepted=last, attempt=attempt)


def _execute(sql: str, params: tuple[object, ...]) -> Callable[[sqlite3.Connection], int]:
    def run(conn: sqlite3.Connection) -> int:
        with write_transaction(conn):
            return conn.execute(sql, params).rowcount

    return run


def _key(r: Reservation) -> tuple[object, ...]:
    return (r.tenant, r.key, r.owner, r.attempt)


def _remember_nonce(
    key_id: str, nonce: str, ttl: float, deadline: float
) -> Callable[[sqlite3.Connection], bool]:
    def run(conn: sqlite3.Connection) -> bool:
        with write_transaction(conn):
            _check_deadline(deadline)
            cur = conn.execute(
                f"INSERT INTO signature_nonces (key_id, nonce, expires_at) "
                f"VALUES (?, ?, {NOW} + ?) ON CONFLICT (key_id, nonce) DO UPDATE "
                f"SET expires_at = excluded.expires_at "
                f"WHERE signature_nonces.expires_at <= {NOW}",
                (key_id, nonce, ttl),
            )
            return cur.rowcount > 0

    return run


# An unknown outcome: marked so, or in flight with an expired lease.
_UNKNOWN_ROW = f"(state = 'outcome_unknown' OR (state = 'in_flight' AND locked_until <= {NOW}))"

_GET_KEY = (
    "SELECT tenant, key, state, owner, attempt, entity, fence, fingerprint, locked_until, "
    "reserved_at, created_at, completed_at, expires_at, response_status, "
    f"{NOW} AS now, {_UNKNOWN_ROW} AS unknown "
    "FROM idempotency_keys WHERE tenant = ? AND key = ?"
)


def _key_record(row: sqlite3.Row | None) -> KeyRecord | None:
    if row is None:
        return None
    values = dict(zip(row.keys(), tuple(row), strict=True))
    values["unknown"] = bool(values["unknown"])
    return KeyRecord(**values)


def _resolve(
    tenant: str, key: str, response: StoredResponse | None, resolved_by: str
) -> Callable[[sqlite3.Connection], ResolveResult]:
    def run(conn: sqlite3.Connection) -> ResolveResult:
        with write_transaction(conn):
            if response is None:
                cur = conn.execute(
                    f"DELETE FROM idempotency_keys WHERE tenant = ? AND key = ? AND {_UNKNOWN_ROW}",
                    (tenant, key),
                )
                done = ResolveResult.RELEASED
            else:
                cur = conn.execute(
                    "UPDATE idempotency_keys SET state = 'completed', owner = ?, "
                    "response_status = ?, response_headers = ?, response_body = ?, "
                    f"response_sha256 = ?, body_too_large = 0, completed_at = {NOW}, "
                    f"locked_until = NULL WHERE tenant = ? AND key = ? AND {_UNKNOWN_ROW}",
                    (
                        resolved_by,
                        response.status,
                        orjson.dumps(response.headers).decode(),
                        response.body,
                        response.sha256,
                        tenant,
                        key,
                    ),
                )
                done = ResolveResult.COMPLETED
            if cur.rowcount > 0:
                return done
            found = conn.execute(_GET_KEY, (tenant, key)).fetchone()
            return ResolveResult.NOT_FOUND if found is None else ResolveResult.NOT_UNKNOWN

    return run


class SQLiteGatewayStore:
    kind: Literal["postgresql", "sqlite"] = "sqlite"

    def __init__(self, db: SQLiteDatabase) -> None:
        self._db = db
        # One connection on one thread: a single batch at a time, and each batch is one
        # thread hand-off and one transaction however many calls it carries.
        self._decider: Batcher[DecideRequest, Decision] = Batcher(
            self._decide_many, max_in_flight=1
        )
        self._completer: Batcher[tuple[Reservation, StoredResponse], bool] = Batcher(
            self._complete_many, max_in_flight=1
        )

    @classmethod
    def open(cls, path: Path | str, *, busy_timeout: float = 5.0) -> SQLiteGatewayStore:
        return cls(SQLiteDatabase(path, busy_timeout=busy_timeout))

    async def _run(self, fn: Callable[[sqlite3.Connection], T], *, timeout: float) -> T:
        try:
            return await self._db.run(fn, timeout=timeout)
        except (TimeoutError, _CallerGaveUp) as exc:
            raise StoreUnavailable(f"no answer within {timeout}s") from exc
        except Exception as exc:
            # Any failure at the store boundary (a locked or missing file, a missing table, a
            # closed executor) means the store could not decide: the gateway fails closed.
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc

    async def decide(self, request: DecideRequest, *, timeout: float) -> Decision:
        return await self._decider.submit(request, timeout=timeout)

    async def _decide_many(
        self, requests: list[DecideRequest], timeout: float
    ) -> list[Decision | BaseException]:
        deadline = time.monotonic() + timeout
        return await self._run(lambda conn: _decide_many(conn, requests, deadline), timeout=timeout)

    async def complete(
        self,
        reservation: Reservation,
        response: StoredResponse,
        *,
        timeout: float,
    ) -> bool:
        return await self._completer.submit((reservation, response), timeout=timeout)

    async def _complete_many(
        self, items: list[tuple[Reservation, StoredResponse]], timeout: float
    ) -> list[bool | BaseException]:
        sql = (
            "UPDATE idempotency_keys SET state = 'completed', response_status = ?, "
            "response_headers = ?, response_body = ?, response_sha256 = ?, "
            f"body_too_large = ?, completed_at = {NOW}, locked_until = NULL WHERE {_HELD}"
        )
        rows = [
            (
                answer.status,
                orjson.dumps(answer.headers).decode(),
                answer.body,
                answer.sha256,
                int(answer.body is None),
                *_key(reservation),
            )
            for reservation, answer in items
        ]

        def run(conn: sqlite3.Connection) -> list[bool | BaseException]:
            with write_transaction(conn):
                return [conn.execute(sql, row).rowcount > 0 for row in rows]

        return await self._run(run, timeout=timeout)

    async def release(self, reservation: Reservation, *, timeout: float) -> bool:
        sql = f"DELETE FROM idempotency_keys WHERE {_OWNED}"
        return await self._run(_execute(sql, _key(reservation)), timeout=timeout) > 0

    async def mark_unknown(self, reservation: Reservation, *, timeout: float) -> bool:
        sql = (
            # locked_until keeps the moment the outcome became unknown (shown to the caller).
            f"UPDATE idempotency_keys SET state = 'outcome_unknown', locked_until = {NOW} "
            f"WHERE {_OWNED}"
        )
        return await self._run(_execute(sql, _key(reservation)), timeout=timeout) > 0

    async def renew(
        self, reservation: Reservation, lease_seconds: float, *, timeout: float
    ) -> bool:
        sql = (
            f"UPDATE idempotency_keys SET locked_until = {NOW} + ? "
            f"WHERE {_OWNED} AND locked_until > {NOW}"
        )
        params = (float(lease_seconds), *_key(reservation))
        return await self._run(_execute(sql, params), timeout=timeout) > 0

    async def remember_nonce(
        self, key_id: str, nonce: str, ttl_seconds: float, *, timeout: float
    ) -> bool:
        deadline = time.monotonic() + timeout
        return await self._run(
            _remember_nonce(key_id, nonce, float(ttl_seconds), deadline), timeout=timeout
        )

    async def purge(
        self,
        *,
        fence_ttl_seconds: float = DEFAULT_FENCE_TTL_SECONDS,
        batch_size: int = 1000,
        timeout: float,
    ) -> PurgeCounts:
        """Delete in batches so that other processes get the write lock in between;
        `timeout` bounds each batch."""
        keys = await self._purge_table(
            "idempotency_keys", "tenant, key", f"expires_at <= {NOW}", (), batch_size, timeout
        )
        fences = await self._purge_table(
            "fences",
            "tenant, entity",
            f"updated_at <= {NOW} - ?",
            (float(fence_ttl_seconds),),
            batch_size,
            timeout,
        )
        nonces = await self._purge_table(
            "signature_nonces", "key_id, nonce", f"expires_at <= {NOW}", (), batch_size, timeout
        )
        return PurgeCounts(keys=keys, fences=fences, nonces=nonces)

    async def _purge_table(
        self,
        table: str,
        pk: str,
        where: str,
        params: tuple[object, ...],
        batch_size: int,
        timeout: float,
    ) -> int:
        sql = (
            f"DELETE FROM {table} WHERE ({pk}) IN (SELECT {pk} FROM {table} WHERE {where} LIMIT ?)"
        )
        total = 0
        while True:
            deleted = await self._run(_execute(sql, (*params, batch_size)), timeout=timeout)
            total += deleted
            if deleted < batch_size:
                return total

    async def ping(self, *, timeout: float) -> None:
        await self._run(lambda conn: conn.execute("SELECT 1").fetchone(), timeout=timeout)

    async def applied_migrations(self, *, timeout: float) -> list[str] | None:
        def read(conn: sqlite3.Connection) -> list[str] | None:
            table = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'fencegate_migrations'"
            ).fetchone()
            if table is None:
                return None
            rows = conn.execute("SELECT name FROM fencegate_migrations ORDER BY name")
            return [str(r[0]) for r in rows]

        return await self._run(read, timeout=timeout)

    async def get_key(self, tenant: str, key: str, *, timeout: float) -> KeyRecord | None:
        return await self._run(
            lambda conn: _key_record(conn.execute(_GET_KEY, (tenant, key)).fetchone()),
            timeout=timeout,
        )

    async def resolve_key(
        self,
        tenant: str,
        key: str,
        response: StoredResponse | None,
        *,
        resolved_by: str,
        timeout: float,
    ) -> ResolveResult:
        return await self._run(_resolve(tenant, key, response, resolved_by), timeout=timeout)

    async def close(self) -> None:
        await self._db.close()
