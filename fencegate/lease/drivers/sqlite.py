"""The lease queue on SQLite (standard library), for one host.

Each write is one ``BEGIN IMMEDIATE`` transaction, which takes the database's write lock up
front, so the read and the write of a claim cannot interleave with another process. Times
are the database clock (epoch seconds), read once per transaction so that every comparison
in it agrees. The statements are in ``sql/sqlite/queries/lease.sql``; the connection, the
bound on each call and the error rule are `SQLiteDatabase.run`'s.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import orjson

from fencegate.errors import StoreUnavailable
from fencegate.lease.drivers.base import Decoding, Driver, lease_from
from fencegate.lease.drivers.sqlite_limits import LOOKAHEAD, choose, read_limits, spend_tokens
from fencegate.lease.models import JobState, Lease, NewJob, Scheduling
from fencegate.store.audit import JobAudit
from fencegate.store.migrations import migrate_sqlite_sync
from fencegate.store.queries import Queries
from fencegate.store.sqlite_db import SQLiteDatabase

T = TypeVar("T")

POLL_SECONDS = 0.05

Q = Queries("sqlite")


def _now(conn: sqlite3.Connection) -> float:
    return float(conn.execute(Q.lease_now).fetchone()[0])


def _dumps(value: Any) -> str | None:
    return orjson.dumps(value).decode()


def _loads(text: str | None) -> Any:
    return None if text is None else orjson.loads(text)


def _time(value: float) -> datetime:
    return datetime.fromtimestamp(value, UTC)


# Times are kept as epoch seconds of the database clock, JSON values as text.
DECODING = Decoding(time=_time, json=_loads)


def _kinds(kinds: Sequence[str] | None) -> str | None:
    # The kinds go in as a JSON array (json_each), or NULL for any kind.
    return None if kinds is None else orjson.dumps(list(kinds)).decode()


@dataclass(frozen=True, slots=True)
class _ClaimStatements:
    """The claim's statements for one shape of kind filter (one, several, any)."""

    fail_exhausted: str
    expired: str
    queued: str
    ready: str


_ONE_KIND = _ClaimStatements(
    Q.lease_fail_exhausted_one_kind,
    Q.lease_claimable_expired_one_kind,
    Q.lease_claimable_queued_one_kind,
    Q.lease_ready_one_kind,
)
_KINDS = _ClaimStatements(
    Q.lease_fail_exhausted_kinds,
    Q.lease_claimable_expired_kinds,
    Q.lease_claimable_queued_kinds,
    Q.lease_ready_kinds,
)
_ANY = _ClaimStatements(
    Q.lease_fail_exhausted_any,
    Q.lease_claimable_expired_any,
    Q.lease_claimable_queued_any,
    Q.lease_ready_any,
)


def _statements(kinds: Sequence[str] | None) -> _ClaimStatements:
    if kinds is None:
        return _ANY
    return _ONE_KIND if len(kinds) == 1 else _KINDS


def _held(lease: Lease, now: float) -> dict[str, Any]:
    return {
        "id": lease.job_id,
        "owner_id": lease.owner_id,
        "token": lease.fencing_token,
        "now": now,
    }


def _end_attempt(
    conn: sqlite3.Connection, token: int, now: float, outcome: str, error: str | None
) -> None:
    conn.execute(
        Q.lease_end_attempt, {"token": token, "now": now, "outcome": outcome, "error": error}
    )


def _claim(
    conn: sqlite3.Connection,
    owner_id: str,
    statements: _ClaimStatements,
    kinds: str | None,
    limit: int,
) -> tuple[list[Lease], bool]:
    """The leases granted, and whether limits held back ready work."""
    now = _now(conn)
    which = {"now": now, "kinds": kinds}
    for token, error in conn.execute(statements.fail_exhausted, which).fetchall():
        _end_attempt(conn, token, now, "lease_expired", error)
    limits = read_limits(conn, kinds, now)
    scan = which | limits.scan_arguments() | {"limit": limit * LOOKAHEAD if limits.any else limit}
    if statements is _ONE_KIND and limits.full_kinds():
        candidates = []  # the one kind is full: nothing to scan
    else:
        candidates = conn.execute(statements.expired, scan).fetchall()
        candidates += conn.execute(statements.queued, scan).fetchall()
    found = len(candidates)
    candidates = choose(candidates, limits, limit)
    spend_tokens(conn, limits, candidates)
    held_back = len(candidates) < min(found, limit) or (limits.any and not candidates)
    if not candidates:
        return [], held_back
    last = conn.execute(Q.lease_take_tokens, {"count": len(candidates)}).fetchone()[0]
    first = last - len(candidates) + 1
    leases: list[Lease] = []
    # Within one batch the tokens follow the job id, as on PostgreSQL.
    ordered = sorted(candidates, key=lambda c: int(c["id"]))
    for token, candidate in enumerate(ordered, start=first):
        expiry: str | None = candidate["expiry_error"]
        if expiry is not None:
            _end_attempt(conn, candidate["fencing_token"], now, "lease_expired", expiry)
        row = conn.execute(
            Q.lease_grant,
            {
                "owner_id": owner_id,
                "token": token,
                "now": now,
                "expiry_error": expiry,
                "id": candidate["id"],
            },
        ).fetchone()
        conn.execute(
            Q.lease_open_attempt,
            {
                "token": token,
                "id": row["id"],
                "attempt": row["attempt"],
                "owner_id": owner_id,
                "now": now,
            },
        )
        leases.append(lease_from(row, DECODING))
    return leases, held_back


def _fail_one(
    conn: sqlite3.Connection,
    now: float,
    lease: Lease,
    encoded: str | None,
    retry_in: float | None,
) -> JobState | None:
    row = conn.execute(
        Q.lease_fail, _held(lease, now) | {"retry_in": retry_in, "error": encoded}
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
    held = _held(lease, now)
    if conn.execute(Q.lease_held, held).fetchone() is None:
        return False
    stage = held | {"name": name, "idempotency_key": idempotency_key, "result": encoded}
    if conn.execute(Q.lease_insert_stage, stage).fetchone() is not None:
        return True
    mine = {"id": lease.job_id, "name": name, "token": lease.fencing_token}
    return conn.execute(Q.lease_stage_is_mine, mine).fetchone() is not None


def _cancel(conn: sqlite3.Connection, job_id: int, encoded: str | None) -> bool | None:
    now = _now(conn)
    target = conn.execute(Q.lease_cancel_target, {"id": job_id}).fetchone()
    if target is None:
        return None
    if target["state"] not in ("queued", "running"):
        return False
    conn.execute(Q.lease_cancel, {"id": job_id, "error": encoded, "now": now})
    if target["state"] == "running":
        _end_attempt(conn, target["fencing_token"], now, "cancelled", encoded)
    return True


def _retry(conn: sqlite3.Connection, job_id: int) -> bool | None:
    target = conn.execute(Q.lease_cancel_target, {"id": job_id}).fetchone()
    if target is None:
        return None
    if target["state"] not in ("failed", "cancelled"):
        return False
    conn.execute(Q.lease_retry, {"id": job_id, "now": _now(conn)})
    return True


def _audited(
    act: Callable[[sqlite3.Connection], bool | None], job_id: int, audit: JobAudit | None
) -> Callable[[sqlite3.Connection], bool | None]:
    """``act`` on one job and, when it did something, the audit row ``audit`` gives, in the
    same write transaction: from the job as it was and as ``act`` left it."""
    if audit is None:
        return act

    def run(conn: sqlite3.Connection) -> bool | None:
        before = conn.execute(Q.lease_job_summary, (job_id,)).fetchone()
        done = act(conn)
        if done and before is not None:
            after = conn.execute(Q.lease_job_summary, (job_id,)).fetchone()
            entry = audit(_as_dict(before), _as_dict(after))
            conn.execute(Q.audit, entry.arguments())
        return done

    return run


def _as_dict(row: sqlite3.Row) -> dict[str, Any]:
    return dict(zip(row.keys(), tuple(row), strict=True))


class SQLiteDriver(Driver):
    queries = Q
    decoding = DECODING

    _db: SQLiteDatabase

    def __init__(self, db: SQLiteDatabase) -> None:
        super().__init__(db)
        self._held_back: set[str | None] = set()

    async def opened(self, *, timeout: float) -> None:
        # The file is opened on first use: a store that cannot be read fails here, at once.
        await self._run(lambda conn: conn.execute(Q.lease_ping).fetchone(), timeout=timeout)

    async def close(self) -> None:
        await self._db.close()

    async def _run(
        self, fn: Callable[[sqlite3.Connection], T], *, timeout: float, write: bool = False
    ) -> T:
        self.round_trips += 1
        return await self._db.run(fn, timeout=timeout, write=write)

    async def _fetch(self, sql: str, args: Sequence[Any], *, timeout: float) -> list[sqlite3.Row]:
        return await self._run(
            lambda conn: conn.execute(sql, tuple(args)).fetchall(), timeout=timeout
        )

    async def migrate(self, *, timeout: float) -> list[str]:
        return await self._run(migrate_sqlite_sync, timeout=timeout)

    async def now(self, *, timeout: float) -> datetime:
        value = await self._run(_now, timeout=timeout)
        return _time(value)

    async def enqueue(self, jobs: Sequence[NewJob], *, timeout: float) -> list[int]:
        def run(conn: sqlite3.Connection) -> list[int]:
            ids: list[int] = []
            now = _now(conn)
            for job in jobs:
                row = conn.execute(
                    Q.lease_enqueue,
                    {
                        "kind": job.kind,
                        "payload": _dumps(job.payload),
                        "idempotency_key": job.idempotency_key,
                        "max_attempts": job.max_attempts,
                        "lease_seconds": job.lease_seconds,
                        "heartbeat_seconds": job.heartbeat_seconds,
                        "jitter_seconds": job.jitter_seconds,
                        "stage_timeout_seconds": job.stage_timeout_seconds,
                        "tool_timeout_seconds": job.tool_timeout_seconds,
                        "run_after_seconds": job.run_after_seconds,
                        "priority": job.priority,
                        "concurrency_key": job.concurrency_key,
                        "model": job.model,
                        "now": now,
                    },
                ).fetchone()
                if row is None:
                    row = conn.execute(
                        Q.lease_job_by_key, {"idempotency_key": job.idempotency_key}
                    ).fetchone()
                ids.append(int(row[0]))
            return ids

        return await self._run(run, timeout=timeout, write=True)

    async def declare(self, scheduling: Scheduling, *, timeout: float) -> None:
        def run(conn: sqlite3.Connection) -> None:
            now = _now(conn)
            for c in scheduling.classes:
                conn.execute(
                    Q.lease_declare_work_class,
                    {
                        "kind": c.kind,
                        "max_running": c.max_running,
                        "max_running_per_key": c.max_running_per_key,
                        "provider": c.provider,
                        "now": now,
                    },
                )
            for r in scheduling.rates:
                conn.execute(
                    Q.lease_declare_rate_limit,
                    {
                        "provider": r.provider,
                        "capacity": float(r.limit),
                        "per_seconds": r.per_seconds,
                        "now": now,
                    },
                )

        await self._run(run, timeout=timeout, write=True)

    async def claim(
        self,
        wanted: Sequence[tuple[str, int]],
        kinds: Sequence[str] | None,
        *,
        locks: Sequence[str],
        timeout: float,
    ) -> list[list[Lease]]:
        # One BEGIN IMMEDIATE transaction: claims take turns already, no locks needed.
        encoded, statements = _kinds(kinds), _statements(kinds)

        def run(conn: sqlite3.Connection) -> tuple[list[list[Lease]], bool]:
            granted, held_back = [], False
            for owner_id, limit in wanted:
                leases, held = _claim(conn, owner_id, statements, encoded, limit)
                granted.append(leases)
                held_back = held_back or held
            return granted, held_back

        granted, held_back = await self._run(run, timeout=timeout, write=True)
        # Work held back by a limit still looks ready to `lease_ready`: until a claim of
        # these kinds gets something again, waiting for work waits a whole poll period.
        if held_back and not any(granted):
            self._held_back.add(encoded)
        else:
            self._held_back.discard(encoded)
        return granted

    async def extend_many(
        self, leases: Sequence[Lease], *, timeout: float
    ) -> list[datetime | None]:
        def run(conn: sqlite3.Connection) -> list[float | None]:
            now = _now(conn)
            renewed: list[float | None] = []
            for lease in leases:
                row = conn.execute(Q.lease_extend, _held(lease, now)).fetchone()
                renewed.append(None if row is None else float(row[0]))
            return renewed

        renewed = await self._run(run, timeout=timeout, write=True)
        return [None if value is None else _time(value) for value in renewed]

    async def complete_many(
        self, items: Sequence[tuple[Lease, Any]], *, timeout: float, held: bool = False
    ) -> list[bool]:
        encoded = [(lease, _dumps(result)) for lease, result in items]

        def run(conn: sqlite3.Connection) -> list[bool]:
            done: list[bool] = []
            now = _now(conn)
            for lease, result in encoded:
                row = conn.execute(
                    Q.lease_complete, _held(lease, now) | {"result": result}
                ).fetchone()
                if row is not None:
                    _end_attempt(conn, row[0], now, "succeeded", None)
                done.append(row is not None)
            return done

        return await self._run(run, timeout=timeout, write=True)

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
            row = conn.execute(Q.lease_release, _held(lease, now)).fetchone()
            if row is None:
                return False
            _end_attempt(conn, row[0], now, "released", None)
            return True

        return await self._run(run, timeout=timeout, write=True)

    async def cancel(
        self, job_id: int, reason: Any, *, audit: JobAudit | None = None, timeout: float
    ) -> bool | None:
        encoded = _dumps(reason)
        act = _audited(lambda conn: _cancel(conn, job_id, encoded), job_id, audit)
        return await self._run(act, timeout=timeout, write=True)

    async def retry(
        self, job_id: int, *, audit: JobAudit | None = None, timeout: float
    ) -> bool | None:
        act = _audited(lambda conn: _retry(conn, job_id), job_id, audit)
        return await self._run(act, timeout=timeout, write=True)

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
        encoded, statement = _kinds(kinds), _statements(kinds).ready
        if encoded in self._held_back:
            await asyncio.sleep(timeout)
            return False

        def ready(conn: sqlite3.Connection) -> bool:
            which = {"now": _now(conn), "kinds": encoded}
            return conn.execute(statement, which).fetchone() is not None

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
