"""The lease queue on SQLite (standard library), for one host.

Each write is one ``BEGIN IMMEDIATE`` transaction, which takes the database's write lock up
front, so the read and the write of a claim cannot interleave with another process. Times
are the database clock (`SQLITE_NOW`, epoch seconds), read once per transaction so that every
comparison in it agrees.

A call never runs after its caller gave up: the deadline is checked when the call reaches
the connection's thread, and SQLite's busy timeout is set to the time that remains.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import orjson

from fencegate.lease.drivers.base import JOB_COLUMNS, LEASE_COLUMNS
from fencegate.lease.errors import StoreUnavailable
from fencegate.lease.models import Attempt, Job, JobState, Lease, NewJob, StageRecord
from fencegate.migrations import migrate_sqlite_sync
from fencegate.sqlite_db import SQLITE_NOW, SQLiteDatabase, write_transaction

T = TypeVar("T")

POLL_SECONDS = 0.05

_NOW = f"SELECT {SQLITE_NOW}"

# Rows that still belong to the presenter of a lease: id, owner, token, now.
_HELD = """id = ? AND state = 'running' AND owner_id = ? AND fencing_token = ?
    AND lease_until > ?"""


class _Expired(Exception):
    """The caller's deadline passed before the call reached the connection."""


def _now(conn: sqlite3.Connection) -> float:
    return float(conn.execute(_NOW).fetchone()[0])


def _dumps(value: Any) -> str | None:
    return orjson.dumps(value).decode()


def _loads(text: str | None) -> Any:
    return None if text is None else orjson.loads(text)


def _time(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, UTC)


def _time_required(value: float) -> datetime:
    return datetime.fromtimestamp(value, UTC)


def _expiry_error(attempt: int, max_attempts: int) -> str:
    return f"lease expired on attempt {attempt} of {max_attempts}"


def _lease(row: sqlite3.Row) -> Lease:
    return Lease(
        job_id=row["id"],
        kind=row["kind"],
        owner_id=row["owner_id"],
        fencing_token=row["fencing_token"],
        lease_until=_time_required(row["lease_until"]),
        lease_seconds=float(row["lease_seconds"]),
        heartbeat_seconds=float(row["heartbeat_seconds"]),
        attempt=row["attempt"],
        max_attempts=row["max_attempts"],
        payload=_loads(row["payload"]),
        idempotency_key=row["idempotency_key"],
        stage_timeout_seconds=_float(row["stage_timeout_seconds"]),
        tool_timeout_seconds=_float(row["tool_timeout_seconds"]),
    )


def _float(value: float | None) -> float | None:
    return None if value is None else float(value)


def _job(row: sqlite3.Row) -> Job:
    return Job(
        id=row["id"],
        kind=row["kind"],
        state=row["state"],
        owner_id=row["owner_id"],
        lease_until=_time(row["lease_until"]),
        fencing_token=row["fencing_token"],
        heartbeat_at=_time(row["heartbeat_at"]),
        attempt=row["attempt"],
        max_attempts=row["max_attempts"],
        run_after=_time_required(row["run_after"]),
        idempotency_key=row["idempotency_key"],
        payload=_loads(row["payload"]),
        result=_loads(row["result"]),
        error=_loads(row["error"]),
        lease_seconds=float(row["lease_seconds"]),
        heartbeat_seconds=float(row["heartbeat_seconds"]),
        jitter_seconds=float(row["jitter_seconds"]),
        stage_timeout_seconds=_float(row["stage_timeout_seconds"]),
        created_at=_time_required(row["created_at"]),
        updated_at=_time_required(row["updated_at"]),
        tool_timeout_seconds=_float(row["tool_timeout_seconds"]),
    )


def _kinds_filter(kinds: Sequence[str] | None) -> tuple[str, list[str]]:
    if kinds is None:
        return "", []
    return f"AND kind IN ({', '.join('?' for _ in kinds)})", list(kinds)


def _end_attempt(
    conn: sqlite3.Connection, token: int, now: float, outcome: str, error: str | None
) -> None:
    conn.execute(
        "UPDATE fencegate_job_attempts SET ended_at = ?, outcome = ?, error = ?"
        " WHERE fencing_token = ? AND ended_at IS NULL",
        (now, outcome, error, token),
    )


def _fail_one(
    conn: sqlite3.Connection,
    now: float,
    lease: Lease,
    encoded: str | None,
    retry_in: float | None,
) -> JobState | None:
    final = "? IS NULL OR attempt >= max_attempts"
    row = conn.execute(
        f"""UPDATE fencegate_jobs
               SET state = CASE WHEN {final} THEN 'failed' ELSE 'queued' END,
                   run_after = CASE WHEN {final} THEN run_after ELSE ? + ? END,
                   owner_id = CASE WHEN {final} THEN owner_id END,
                   error = ?, lease_until = NULL, updated_at = ?
             WHERE {_HELD}
            RETURNING fencing_token, state""",
        (
            retry_in,
            retry_in,
            now,
            retry_in,
            retry_in,
            encoded,
            now,
            lease.job_id,
            lease.owner_id,
            lease.fencing_token,
            now,
        ),
    ).fetchone()
    if row is None:
        return None
    outcome = "failed" if row["state"] == "failed" else "retry_scheduled"
    _end_attempt(conn, row["fencing_token"], now, outcome, encoded)
    state: JobState = row["state"]
    return state


def _commit_stage_one(
    conn: sqlite3.Connection,
    now: float,
    lease: Lease,
    name: str,
    idempotency_key: str,
    encoded: str | None,
) -> bool:
    held = conn.execute(
        f"SELECT 1 FROM fencegate_jobs WHERE {_HELD}",
        (lease.job_id, lease.owner_id, lease.fencing_token, now),
    ).fetchone()
    if held is None:
        return False
    inserted = conn.execute(
        """INSERT INTO fencegate_job_stages
               (job_id, name, idempotency_key, result, fencing_token, committed_at)
           VALUES (?, ?, ?, ?, ?, ?)
           ON CONFLICT (job_id, name) DO NOTHING
           RETURNING 1""",
        (lease.job_id, name, idempotency_key, encoded, lease.fencing_token, now),
    ).fetchone()
    if inserted is not None:
        return True
    mine = conn.execute(
        "SELECT 1 FROM fencegate_job_stages WHERE job_id = ? AND name = ? AND fencing_token = ?",
        (lease.job_id, name, lease.fencing_token),
    ).fetchone()
    return mine is not None


class SQLiteDriver:
    def __init__(self, path: Path) -> None:
        self._db = SQLiteDatabase(path)
        # Transactions sent, so that batching can be observed (tests, benchmarks).
        self.round_trips = 0

    @classmethod
    async def connect(cls, path: Path, *, timeout: float) -> SQLiteDriver:
        driver = cls(path)
        try:
            await driver._run(lambda conn: conn.execute("SELECT 1").fetchone(), timeout=timeout)
        except BaseException:
            await driver.close()
            raise
        return driver

    async def close(self) -> None:
        await self._db.close()

    async def _run(
        self, fn: Callable[[sqlite3.Connection], T], *, timeout: float, write: bool = False
    ) -> T:
        # The connection's thread gives up a little before the caller does, and checks again
        # once it holds the write lock: work that waited for the lock past the caller's
        # patience is rolled back instead of done behind the caller's back.
        deadline = time.monotonic() + timeout - min(0.2, timeout * 0.2)
        self.round_trips += 1

        def bounded(conn: sqlite3.Connection) -> T:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Expired
            conn.execute(f"PRAGMA busy_timeout={max(int(remaining * 1000), 1)}")
            if not write:
                return fn(conn)
            with write_transaction(conn):
                if time.monotonic() > deadline:
                    raise _Expired
                return fn(conn)

        try:
            return await self._db.run(bounded, timeout=timeout)
        except (TimeoutError, _Expired) as exc:
            raise StoreUnavailable(f"SQLite did not answer within {timeout:g}s") from exc
        except sqlite3.OperationalError as exc:
            # "database is locked" past the busy timeout, disk and file errors: the store
            # could not say yes or no.
            raise StoreUnavailable(f"SQLite is unavailable: {exc}") from exc

    async def migrate(self, *, timeout: float) -> list[str]:
        return await self._run(migrate_sqlite_sync, timeout=timeout)

    async def now(self, *, timeout: float) -> datetime:
        value = await self._run(_now, timeout=timeout)
        return _time_required(value)

    async def enqueue(self, jobs: Sequence[NewJob], *, timeout: float) -> list[int]:
        def run(conn: sqlite3.Connection) -> list[int]:
            ids: list[int] = []
            now = _now(conn)
            for job in jobs:
                row = conn.execute(
                    """INSERT INTO fencegate_jobs (kind, payload, idempotency_key,
                           max_attempts, lease_seconds, heartbeat_seconds, jitter_seconds,
                           stage_timeout_seconds, tool_timeout_seconds, run_after,
                           created_at, updated_at)
                       VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                       ON CONFLICT (idempotency_key) DO NOTHING
                       RETURNING id""",
                    (
                        job.kind,
                        _dumps(job.payload),
                        job.idempotency_key,
                        job.max_attempts,
                        job.lease_seconds,
                        job.heartbeat_seconds,
                        job.jitter_seconds,
                        job.stage_timeout_seconds,
                        job.tool_timeout_seconds,
                        now + job.run_after_seconds,
                        now,
                        now,
                    ),
                ).fetchone()
                if row is None:
                    row = conn.execute(
                        "SELECT id FROM fencegate_jobs WHERE idempotency_key = ?",
                        (job.idempotency_key,),
                    ).fetchone()
                ids.append(int(row[0]))
            return ids

        return await self._run(run, timeout=timeout, write=True)

    async def claim(
        self, owner_id: str, kinds: Sequence[str] | None, limit: int, *, timeout: float
    ) -> list[Lease]:
        kind_sql, kind_args = _kinds_filter(kinds)

        def run(conn: sqlite3.Connection) -> list[Lease]:
            now = _now(conn)
            exhausted = conn.execute(
                f"""UPDATE fencegate_jobs
                       SET state = 'failed', lease_until = NULL, updated_at = ?,
                           error = json_quote('lease expired on attempt ' || attempt
                                              || ' of ' || max_attempts)
                     WHERE state = 'running' AND lease_until < ?
                       AND attempt >= max_attempts {kind_sql}
                    RETURNING fencing_token, error""",
                (now, now, *kind_args),
            ).fetchall()
            for token, error in exhausted:
                _end_attempt(conn, token, now, "lease_expired", error)
            # Expired leases first (they have waited longest), then queued work in id order,
            # each from its own partial index.
            candidates = conn.execute(
                f"""SELECT id, state, fencing_token, attempt, max_attempts
                      FROM fencegate_jobs
                     WHERE state = 'running' AND lease_until < ? AND attempt < max_attempts
                           {kind_sql}
                     ORDER BY lease_until
                     LIMIT ?""",
                (now, *kind_args, limit),
            ).fetchall()
            if len(candidates) < limit:
                candidates += conn.execute(
                    f"""SELECT id, state, fencing_token, attempt, max_attempts
                          FROM fencegate_jobs
                         WHERE state = 'queued' AND run_after <= ? {kind_sql}
                         ORDER BY id
                         LIMIT ?""",
                    (now, *kind_args, limit - len(candidates)),
                ).fetchall()
            if not candidates:
                return []
            last = conn.execute(
                "UPDATE fencegate_sequences SET value = value + ?"
                " WHERE name = 'fencing_token' RETURNING value",
                (len(candidates),),
            ).fetchone()[0]
            first = last - len(candidates) + 1
            leases: list[Lease] = []
            for offset, candidate in enumerate(candidates):
                token = first + offset
                expiry: str | None = None
                if candidate["state"] == "running":
                    expiry = _dumps(_expiry_error(candidate["attempt"], candidate["max_attempts"]))
                    _end_attempt(conn, candidate["fencing_token"], now, "lease_expired", expiry)
                row = conn.execute(
                    f"""UPDATE fencegate_jobs
                           SET state = 'running', owner_id = ?, fencing_token = ?,
                               lease_until = ? + lease_seconds, heartbeat_at = ?,
                               attempt = attempt + 1, updated_at = ?,
                               error = COALESCE(?, error)
                         WHERE id = ?
                        RETURNING {LEASE_COLUMNS}""",
                    (owner_id, token, now, now, now, expiry, candidate["id"]),
                ).fetchone()
                conn.execute(
                    "INSERT INTO fencegate_job_attempts"
                    " (fencing_token, job_id, attempt, owner_id, claimed_at)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (token, row["id"], row["attempt"], owner_id, now),
                )
                leases.append(_lease(row))
            return leases

        return await self._run(run, timeout=timeout, write=True)

    async def extend(self, lease: Lease, *, timeout: float) -> datetime | None:
        [renewed] = await self.extend_many([lease], timeout=timeout)
        return renewed

    async def extend_many(
        self, leases: Sequence[Lease], *, timeout: float
    ) -> list[datetime | None]:
        def run(conn: sqlite3.Connection) -> list[float | None]:
            now = _now(conn)
            renewed: list[float | None] = []
            for lease in leases:
                row = conn.execute(
                    f"""UPDATE fencegate_jobs
                           SET lease_until = ? + lease_seconds, heartbeat_at = ?, updated_at = ?
                         WHERE {_HELD}
                        RETURNING lease_until""",
                    (now, now, now, lease.job_id, lease.owner_id, lease.fencing_token, now),
                ).fetchone()
                renewed.append(None if row is None else float(row[0]))
            return renewed

        return [_time(value) for value in await self._run(run, timeout=timeout, write=True)]

    async def complete_many(
        self, items: Sequence[tuple[Lease, Any]], *, timeout: float
    ) -> list[bool]:
        encoded = [(lease, _dumps(result)) for lease, result in items]

        def run(conn: sqlite3.Connection) -> list[bool]:
            done: list[bool] = []
            now = _now(conn)
            for lease, result in encoded:
                row = conn.execute(
                    f"""UPDATE fencegate_jobs
                           SET state = 'succeeded', result = ?, error = NULL,
                               lease_until = NULL, updated_at = ?
                         WHERE {_HELD}
                        RETURNING fencing_token""",
                    (result, now, lease.job_id, lease.owner_id, lease.fencing_token, now),
                ).fetchone()
                if row is not None:
                    _end_attempt(conn, row[0], now, "succeeded", None)
                done.append(row is not None)
            return done

        return await self._run(run, timeout=timeout, write=True)

    async def fail(
        self, lease: Lease, error: Any, *, retry_in: float | None, timeout: float
    ) -> JobState | None:
        [state] = await self.fail_many([(lease, error, retry_in)], timeout=timeout)
        return state

    async def fail_many(
        self, items: Sequence[tuple[Lease, Any, float | None]], *, timeout: float
    ) -> list[JobState | None]:
        encoded = [(lease, _dumps(error), retry_in) for lease, error, retry_in in items]

        def run(conn: sqlite3.Connection) -> list[JobState | None]:
            now = _now(conn)
            return [_fail_one(conn, now, *item) for item in encoded]

        return await self._run(run, timeout=timeout, write=True)

    async def release(self, lease: Lease, *, timeout: float) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            now = _now(conn)
            row = conn.execute(
                f"""UPDATE fencegate_jobs
                       SET state = 'queued', owner_id = NULL, lease_until = NULL,
                           attempt = attempt - 1, run_after = ?, updated_at = ?
                     WHERE {_HELD}
                    RETURNING fencing_token""",
                (now, now, lease.job_id, lease.owner_id, lease.fencing_token, now),
            ).fetchone()
            if row is None:
                return False
            _end_attempt(conn, row[0], now, "released", None)
            return True

        return await self._run(run, timeout=timeout, write=True)

    async def cancel(self, job_id: int, reason: Any, *, timeout: float) -> bool | None:
        encoded = _dumps(reason)

        def run(conn: sqlite3.Connection) -> bool | None:
            now = _now(conn)
            target = conn.execute(
                "SELECT state, fencing_token FROM fencegate_jobs WHERE id = ?", (job_id,)
            ).fetchone()
            if target is None:
                return None
            if target["state"] not in ("queued", "running"):
                return False
            conn.execute(
                "UPDATE fencegate_jobs SET state = 'cancelled', lease_until = NULL,"
                " error = ?, updated_at = ? WHERE id = ?",
                (encoded, now, job_id),
            )
            if target["state"] == "running":
                _end_attempt(conn, target["fencing_token"], now, "cancelled", encoded)
            return True

        return await self._run(run, timeout=timeout, write=True)

    async def get(self, job_id: int, *, timeout: float) -> Job | None:
        row = await self._run(
            lambda conn: conn.execute(
                f"SELECT {JOB_COLUMNS} FROM fencegate_jobs WHERE id = ?", (job_id,)
            ).fetchone(),
            timeout=timeout,
        )
        return None if row is None else _job(row)

    async def list_jobs(
        self, *, state: JobState | None, kind: str | None, limit: int, timeout: float
    ) -> list[Job]:
        rows = await self._run(
            lambda conn: conn.execute(
                f"""SELECT {JOB_COLUMNS} FROM fencegate_jobs
                     WHERE (? IS NULL OR state = ?) AND (? IS NULL OR kind = ?)
                     ORDER BY id DESC LIMIT ?""",
                (state, state, kind, kind, limit),
            ).fetchall(),
            timeout=timeout,
        )
        return [_job(row) for row in rows]

    async def attempts(self, job_id: int, *, timeout: float) -> list[Attempt]:
        rows = await self._run(
            lambda conn: conn.execute(
                """SELECT job_id, attempt, fencing_token, owner_id, claimed_at, ended_at,
                          outcome, error
                     FROM fencegate_job_attempts WHERE job_id = ? ORDER BY fencing_token""",
                (job_id,),
            ).fetchall(),
            timeout=timeout,
        )
        return [
            Attempt(
                job_id=row["job_id"],
                attempt=row["attempt"],
                fencing_token=row["fencing_token"],
                owner_id=row["owner_id"],
                claimed_at=_time_required(row["claimed_at"]),
                ended_at=_time(row["ended_at"]),
                outcome=row["outcome"],
                error=_loads(row["error"]),
            )
            for row in rows
        ]

    async def stage_result(self, job_id: int, name: str, *, timeout: float) -> StageRecord | None:
        row = await self._run(
            lambda conn: conn.execute(
                """SELECT job_id, name, idempotency_key, result, fencing_token, committed_at
                     FROM fencegate_job_stages WHERE job_id = ? AND name = ?""",
                (job_id, name),
            ).fetchone(),
            timeout=timeout,
        )
        if row is None:
            return None
        return StageRecord(
            job_id=row["job_id"],
            name=row["name"],
            idempotency_key=row["idempotency_key"],
            result=_loads(row["result"]),
            fencing_token=row["fencing_token"],
            committed_at=_time_required(row["committed_at"]),
        )

    async def commit_stage(
        self, lease: Lease, name: str, idempotency_key: str, result: Any, *, timeout: float
    ) -> bool:
        [committed] = await self.commit_stage_many(
            [(lease, name, idempotency_key, result)], timeout=timeout
        )
        return committed

    async def commit_stage_many(
        self, items: Sequence[tuple[Lease, str, str, Any]], *, timeout: float
    ) -> list[bool]:
        encoded = [(lease, name, key, _dumps(result)) for lease, name, key, result in items]

        def run(conn: sqlite3.Connection) -> list[bool]:
            now = _now(conn)
            return [_commit_stage_one(conn, now, *item) for item in encoded]

        return await self._run(run, timeout=timeout, write=True)

    async def wait_for_work(self, kinds: Sequence[str] | None, *, timeout: float) -> bool:
        """Poll for claimable work every `POLL_SECONDS` (SQLite has no notifications)."""
        kind_sql, kind_args = _kinds_filter(kinds)
        query = f"""SELECT 1 FROM fencegate_jobs
                     WHERE ((state = 'queued' AND run_after <= ?)
                            OR (state = 'running' AND lease_until < ?)) {kind_sql}
                     LIMIT 1"""

        def ready(conn: sqlite3.Connection) -> bool:
            now = _now(conn)
            return conn.execute(query, (now, now, *kind_args)).fetchone() is not None

        deadline = time.monotonic() + timeout
        for _ in range(max(int(timeout / POLL_SECONDS) + 2, 1)):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                if await self._run(ready, timeout=remaining):
                    return True
            except StoreUnavailable:
                return False
            await asyncio.sleep(min(POLL_SECONDS, max(deadline - time.monotonic(), 0)))
        return False
