"""What the lease queue needs from a store. The statements are in
``sql/<store>/queries/lease.sql``; connections, deadlines and the error rule are the storage
core's (`fencegate.store.pg`, `fencegate.store.sqlite_db`)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

from fencegate.lease.models import Attempt, Job, JobState, Lease, NewJob, StageRecord


class Driver(Protocol):
    # Statements (PostgreSQL) or transactions (SQLite) sent so far: how batching is seen.
    round_trips: int

    async def close(self) -> None: ...

    async def migrate(self, *, timeout: float) -> list[str]: ...

    async def now(self, *, timeout: float) -> datetime: ...

    async def enqueue(self, jobs: Sequence[NewJob], *, timeout: float) -> list[int]:
        """Insert jobs; a job whose idempotency key exists already yields the existing id."""
        ...

    async def claim(
        self, owner_id: str, kinds: Sequence[str] | None, limit: int, *, timeout: float
    ) -> list[Lease]: ...

    async def extend_many(
        self, leases: Sequence[Lease], *, timeout: float
    ) -> list[datetime | None]:
        """Per lease, the new lease_until, or None when that lease is no longer held."""
        ...

    async def complete_many(
        self, items: Sequence[tuple[Lease, Any]], *, timeout: float
    ) -> list[bool]: ...

    async def fail_many(
        self, items: Sequence[tuple[Lease, Any, float | None]], *, timeout: float
    ) -> list[JobState | None]:
        """End each ``(lease, error, retry_in)`` attempt, each row checked on its own: queued
        again after ``retry_in`` seconds, or failed for good when ``retry_in`` is None (the
        queue decides which). The job's new state per item, None where rejected."""
        ...

    async def release(self, lease: Lease, *, timeout: float) -> bool: ...

    async def cancel(self, job_id: int, reason: Any, *, timeout: float) -> bool | None:
        """True when cancelled, False when already finished, None when there is no such job."""
        ...

    async def get(self, job_id: int, *, timeout: float) -> Job | None: ...

    async def list_jobs(
        self,
        *,
        state: JobState | None,
        kind: str | None,
        limit: int,
        before: int | None = None,
        timeout: float,
    ) -> list[Job]: ...

    async def attempts(self, job_id: int, *, timeout: float) -> list[Attempt]: ...

    async def stage_result(
        self, job_id: int, name: str, *, timeout: float
    ) -> StageRecord | None: ...

    async def commit_stage_many(
        self, items: Sequence[tuple[Lease, str, str, Any]], *, timeout: float
    ) -> list[bool]:
        """Record each ``(lease, name, idempotency_key, result)`` stage while its lease is
        held; one answer per item."""
        ...

    async def wait_for_work(self, kinds: Sequence[str] | None, *, timeout: float) -> bool: ...
