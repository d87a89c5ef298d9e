"""The records the lease queue hands out. Times are aware UTC datetimes from the database
clock; JSON values (payload, result, error) are whatever was stored."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fencegate.lease.policy import RateLimit

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
    priority: int = 0
    concurrency_key: str | None = None
    model: str | None = None


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
    priority: int = 0
    concurrency_key: str | None = None
    model: str | None = None


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
    priority: int = 0
    concurrency_key: str | None = None
    model: str | None = None


@dataclass(frozen=True, slots=True)
class ClassLimits:
    """What the database enforces for one work class (see `WorkClass`)."""

    kind: str
    max_running: int | None
    max_running_per_key: int | None
    provider: str | None


@dataclass(frozen=True, slots=True)
class Scheduling:
    """The limits a queue declared: written to the store before its first claim, and the
    names a claim of limited kinds locks (claims of them take turns)."""

    classes: tuple[ClassLimits, ...] = ()
    rates: tuple[RateLimit, ...] = ()

    def lock_names(self, kinds: Sequence[str] | None) -> list[str]:
        """The kinds and providers whose limits a claim of ``kinds`` must count alone."""
        names: set[str] = set()
        bucketed = {rate.provider for rate in self.rates}
        for limits in self.classes:
            if kinds is not None and limits.kind not in kinds:
                continue
            if limits.max_running is not None or limits.max_running_per_key is not None:
                names.add(f"kind:{limits.kind}")
            if limits.provider is not None and limits.provider in bucketed:
                names.add(f"provider:{limits.provider}")
        return sorted(names)
