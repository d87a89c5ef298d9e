"""What the lease queue needs from a store."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

from fencegate.lease.models import Attempt, Job, JobState, Lease, NewJob, StageRecord

# The columns both stores read into a `Job` and a `Lease`, in their fields' order.
JOB_COLUMNS = """id, kind, state, owner_id, lease_until, fencing_token, heartbeat_at, attempt,
    max_attempts, run_after, idempotency_key, payload, result, error, lease_seconds,
    heartbeat_seconds, jitter_seconds, stage_timeout_seconds, created_at, updated_at,
    tool_timeout_seconds"""

LEASE_COLUMNS = """id, kind, owner_id, fencing_token, lease_until, lease_seconds,
    heartbeat_seconds, attempt, max_attempts, payload, idempotency_key, stage_timeout_seconds,
    tool_timeout_seconds"""


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

    async def extend(self, lease: Lease, *, timeout: float) -> datetime | None:
        """The new lease_until, or None when the lease is no longer held."""
        ...

    async def extend_many(
        self, leases: Sequence[Lease], *, timeout: float
    ) -> list[datetime | None]: ...

    async def complete_many(
        self, items: Sequence[tuple[Lease, Any]], *, timeout: float
    ) -> list[bool]: ...

    async def fail(
        self, lease: Lease, error: Any, *, retry_in: float | None, timeout: float
    ) -> JobState | None:
        """End the attempt: retry after ``retry_in`` seconds while attempts remain, else
        (or when ``retry_in`` is None) fail the job. The job's new state, None if rejected."""
        ...

    async def fail_many(
        self, items: Sequence[tuple[Lease, Any, float | None]], *, timeout: float
    ) -> list[JobState | None]:
        """`fail` for many ``(lease, error, retry_in)`` in one transaction, each row checked
        on its own; one answer per item."""
        ...

    async def release(self, lease: Lease, *, timeout: float) -> bool: ...

    async def cancel(self, job_id: int, reason: Any, *, timeout: float) -> bool | None:
        """True when cancelled, False when already finished, None when there is no such job."""
        ...

    async def get(self, job_id: int, *, timeout: float) -> Job | None: ...

    async def list_jobs(
        self, *, state: JobState | None, kind: str | None, limit: int, timeout: float
    ) -> list[Job]: ...

    async def attempts(self, job_id: int, *, timeout: float) -> list[Attempt]: ...

    async def stage_result(
        self, job_id: int, name: str, *, timeout: float
    ) -> StageRecord | None: ...

    async def commit_stage(
        self, lease: Lease, name: str, idempotency_key: str, result: Any, *, timeout: float
    ) -> bool: ...

    async def commit_stage_many(
        self, items: Sequence[tuple[Lease, str, str, Any]], *, timeout: float
    ) -> list[bool]:
        """`commit_stage` for many ``(lease, name, idempotency_key, result)``; one answer
        per item."""
        ...

    async def wait_for_work(self, kinds: Sequence[str] | None, *, timeout: float) -> bool: ...
