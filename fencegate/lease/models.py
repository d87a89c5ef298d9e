"""The records the lease queue hands out. Times are aware UTC datetimes from the database
clock; JSON values (payload, result, error) are whatever was stored."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
AttemptOutcome = Literal[
    "succeeded", "failed", "retry_scheduled", "released", "cancelled", "lease_expired"
]
JOB_STATES: tuple[JobState, ...] = ("queued", "running", "succeeded", "failed", "cancelled")


@dataclass(frozen=True, slots=True)
class Lease:
    """Permission for ``owner_id`` to work on one job until ``lease_until``.

    Every conditional call (extend, complete, fail, release, commit_stage) presents the
    lease; the database accepts it only while id, owner and fencing token still match and
    the lease has not expired.
    """

    job_id: int
    kind: str
    owner_id: str
    fencing_token: int
    lease_until: datetime
    lease_seconds: float
    heartbeat_seconds: float
    attempt: int
    max_attempts: int
    payload: Any
    idempotency_key: str
    stage_timeout_seconds: float | None
    tool_timeout_seconds: float | None


@dataclass(frozen=True, slots=True)
class Job:
    id: int
    kind: str
    state: JobState
    owner_id: str | None
    lease_until: datetime | None
    fencing_token: int | None
    heartbeat_at: datetime | None
    attempt: int
    max_attempts: int
    run_after: datetime
    idempotency_key: str
    payload: Any
    result: Any
    error: Any
    lease_seconds: float
    heartbeat_seconds: float
    jitter_seconds: float
    stage_timeout_seconds: float | None
    created_at: datetime
    updated_at: datetime
    tool_timeout_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Attempt:
    """One grant of a lease: who held which token when, and how it ended (None = not yet)."""

    job_id: int
    attempt: int
    fencing_token: int
    owner_id: str
    claimed_at: datetime
    ended_at: datetime | None
    outcome: AttemptOutcome | None
    error: Any


@dataclass(frozen=True, slots=True)
class StageRecord:
    """The committed result of one named stage of a job; a retry skips it."""

    job_id: int
    name: str
    idempotency_key: str
    result: Any
    fencing_token: int
    committed_at: datetime


@dataclass(frozen=True, slots=True)
class NewJob:
    """One job to enqueue, with the policy values already resolved and checked."""

    kind: str
    payload: Any
    idempotency_key: str
    max_attempts: int
    lease_seconds: float
    heartbeat_seconds: float
    jitter_seconds: float
    stage_timeout_seconds: float | None
    tool_timeout_seconds: float | None
    run_after_seconds: float
