"""What the lease queue needs from a store, and what both stores do alike.

A driver runs named statements (``sql/<store>/queries/lease.sql``) on the storage core's
connection layer (`fencegate.store.pg`, `fencegate.store.sqlite_db`), which owns deadlines
and the error rule; `Driver` holds that `Database`, each subclass is one backend's. The
reads are the same on both stores: a named query with positional parameters (``$1`` on
PostgreSQL, ``?1`` on SQLite), whose rows become records here. Only how a column value is
decoded differs (`Decoding`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from fencegate.lease.models import (
    Attempt,
    Job,
    JobState,
    Lease,
    NewJob,
    Scheduling,
    StageRecord,
)
from fencegate.store.audit import JobAudit
from fencegate.store.backends import NamedQueries
from fencegate.store.queries import Queries


class Row(Protocol):
    """A result row, read by column name (asyncpg's Record, sqlite3's Row)."""

    def __getitem__(self, name: str, /) -> Any: ...


@dataclass(frozen=True, slots=True)
class Decoding:
    """How one store's column values become the records' types. PostgreSQL's driver already
    gives datetimes and decoded JSON; SQLite keeps epoch seconds and JSON text."""

    time: Callable[[Any], datetime]  # never called with NULL
    json: Callable[[Any], Any]


def _optional_float(value: float | None) -> float | None:
    return None if value is None else float(value)


def lease_from(row: Row, decode: Decoding) -> Lease:
    return Lease(
        job_id=row["id"],
        kind=row["kind"],
        owner_id=row["owner_id"],
        fencing_token=row["fencing_token"],
        lease_until=decode.time(row["lease_until"]),
        lease_seconds=float(row["lease_seconds"]),
        heartbeat_seconds=float(row["heartbeat_seconds"]),
        attempt=row["attempt"],
        max_attempts=row["max_attempts"],
        payload=decode.json(row["payload"]),
        idempotency_key=row["idempotency_key"],
        stage_timeout_seconds=_optional_float(row["stage_timeout_seconds"]),
        tool_timeout_seconds=_optional_float(row["tool_timeout_seconds"]),
        priority=row["priority"],
        concurrency_key=row["concurrency_key"],
        model=row["model"],
    )


def job_from(row: Row, decode: Decoding) -> Job:
    def when(name: str) -> datetime | None:
        value = row[name]
        return None if value is None else decode.time(value)

    return Job(
        id=row["id"],
        kind=row["kind"],
        state=row["state"],
        owner_id=row["owner_id"],
        lease_until=when("lease_until"),
        fencing_token=row["fencing_token"],
        heartbeat_at=when("heartbeat_at"),
        attempt=row["attempt"],
        max_attempts=row["max_attempts"],
        run_after=decode.time(row["run_after"]),
        idempotency_key=row["idempotency_key"],
        payload=decode.json(row["payload"]),
        result=decode.json(row["result"]),
        error=decode.json(row["error"]),
        lease_seconds=float(row["lease_seconds"]),
        heartbeat_seconds=float(row["heartbeat_seconds"]),
        jitter_seconds=float(row["jitter_seconds"]),
        stage_timeout_seconds=_optional_float(row["stage_timeout_seconds"]),
        created_at=decode.time(row["created_at"]),
        updated_at=decode.time(row["updated_at"]),
        tool_timeout_seconds=_optional_float(row["tool_timeout_seconds"]),
        priority=row["priority"],
        concurrency_key=row["concurrency_key"],
        model=row["model"],
    )


def attempt_from(row: Row, decode: Decoding) -> Attempt:
    ended = row["ended_at"]
    return Attempt(
        job_id=row["job_id"],
        attempt=row["attempt"],
        fencing_token=row["fencing_token"],
        owner_id=row["owner_id"],
        claimed_at=decode.time(row["claimed_at"]),
        ended_at=None if ended is None else decode.time(ended),
        outcome=row["outcome"],
        error=decode.json(row["error"]),
    )


def stage_from(row: Row, decode: Decoding) -> StageRecord:
    return StageRecord(
        job_id=row["job_id"],
        name=row["name"],
        idempotency_key=row["idempotency_key"],
        result=decode.json(row["result"]),
        fencing_token=row["fencing_token"],
        committed_at=decode.time(row["committed_at"]),
    )


def split_by_slots(leases: Sequence[Lease], wanted: Sequence[tuple[str, int]]) -> list[list[Lease]]:
    """Leases granted slot by slot (the first ``limit`` to the first claim, and so on) as one
    list per claim."""
    granted: list[list[Lease]] = []
    start = 0
    for _, limit in wanted:
        granted.append(list(leases[start : start + limit]))
        start += limit
    return granted


class Driver(abc.ABC):
    """One store under the lease queue. The writes are each store's own statements; the
    reads are shared."""

    queries: Queries
    decoding: Decoding

    def __init__(self, db: NamedQueries) -> None:
        self._db = db
        # Statements (PostgreSQL) or transactions (SQLite) sent so far: how batching is
        # seen (tests, benchmarks).
        self.round_trips = 0

    @abc.abstractmethod
    async def _fetch(self, sql: str, args: Sequence[Any], *, timeout: float) -> Sequence[Row]:
        """The rows of one read-only statement, its parameters given by position."""

    async def opened(self, *, timeout: float) -> None:
        """Called once a driver is built on a store just opened: a check that it answers,
        where opening the connection layer did not already make one."""
        return None

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def migrate(self, *, timeout: float) -> list[str]: ...

    @abc.abstractmethod
    async def now(self, *, timeout: float) -> datetime: ...

    @abc.abstractmethod
    async def enqueue(self, jobs: Sequence[NewJob], *, timeout: float) -> list[int]:
        """Insert jobs; a job whose idempotency key exists already yields the existing id."""

    @abc.abstractmethod
    async def declare(self, scheduling: Scheduling, *, timeout: float) -> None:
        """Write the declared work-class limits and rate limits (the last declaration wins)."""

    @abc.abstractmethod
    async def claim(
        self,
        wanted: Sequence[tuple[str, int]],
        kinds: Sequence[str] | None,
        *,
        locks: Sequence[str],
        timeout: float,
    ) -> list[list[Lease]]:
        """Grant each ``(owner, limit)`` of ``wanted`` up to ``limit`` leases within the
        limits stored, in one transaction, the first claims first; one list per claim.
        ``locks`` names the kinds and providers whose limits these claims count (claims of
        them take turns)."""

    @abc.abstractmethod
    async def extend_many(
        self, leases: Sequence[Lease], *, timeout: float
    ) -> list[datetime | None]:
        """Per lease, the new lease_until, or None when that lease is no longer held."""

    @abc.abstractmethod
    async def complete_many(
        self, items: Sequence[tuple[Lease, Any]], *, timeout: float, held: bool = False
    ) -> list[bool]:
        """Per item, whether the job was completed (False: its lease is no longer held).
        ``held``: the caller never makes two such calls at once (the queue's batcher of
        `complete` calls), so they may run on one connection kept between them."""

    @abc.abstractmethod
    async def fail_many(
        self, items: Sequence[tuple[Lease, Any, float | None]], *, timeout: float
    ) -> list[JobState | None]:
        """End each ``(lease, error, retry_in)`` attempt, each row checked on its own: queued
        again after ``retry_in`` seconds, or failed for good when ``retry_in`` is None (the
        queue decides which). The job's new state per item, None where rejected."""

    @abc.abstractmethod
    async def release(self, lease: Lease, *, timeout: float) -> bool: ...

    @abc.abstractmethod
    async def cancel(
        self, job_id: int, reason: Any, *, audit: JobAudit | None = None, timeout: float
    ) -> bool | None:
        """True when cancelled, False when already finished, None when there is no such job.
        ``audit`` gives the audit row of a cancel that happened, written in its transaction
        from the job as it was and as it is."""

    @abc.abstractmethod
    async def retry(
        self, job_id: int, *, audit: JobAudit | None = None, timeout: float
    ) -> bool | None:
        """Queue a failed or cancelled job again, with one more attempt: True when done, False
        when it is not failed or cancelled, None when there is no such job. ``audit`` as for
        `cancel`."""

    @abc.abstractmethod
    async def commit_stage_many(
        self, items: Sequence[tuple[Lease, str, str, Any]], *, timeout: float
    ) -> list[bool]:
        """Record each ``(lease, name, idempotency_key, result)`` stage while its lease is
        held; one answer per item."""

    @abc.abstractmethod
    async def wait_for_work(self, kinds: Sequence[str] | None, *, timeout: float) -> bool: ...

    async def get(self, job_id: int, *, timeout: float) -> Job | None:
        rows = await self._fetch(self.queries.lease_get_job, (job_id,), timeout=timeout)
        return job_from(rows[0], self.decoding) if rows else None

    async def list_jobs(
        self,
        *,
        state: JobState | None,
        kind: str | None,
        limit: int,
        before: int | None = None,
        timeout: float,
    ) -> list[Job]:
        """Newest first; ``before`` (a job id) gives the page after the one that ended there."""
        args = (state, kind, limit, before)
        rows = await self._fetch(self.queries.lease_list_jobs, args, timeout=timeout)
        return [job_from(row, self.decoding) for row in rows]

    async def attempts(self, job_id: int, *, timeout: float) -> list[Attempt]:
        rows = await self._fetch(self.queries.lease_attempts, (job_id,), timeout=timeout)
        return [attempt_from(row, self.decoding) for row in rows]

    async def stage_result(self, job_id: int, name: str, *, timeout: float) -> StageRecord | None:
        rows = await self._fetch(self.queries.lease_stage_result, (job_id, name), timeout=timeout)
        return stage_from(rows[0], self.decoding) if rows else None
