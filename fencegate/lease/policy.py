"""Work classes: the intervals and attempt policy of one kind of job.

Intervals belong to the work class, never to the job's own code or to a model: a lease is
refused unless it outlives the heartbeats it may miss plus a margin for jitter
(``lease > R * heartbeat + jitter``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

DEFAULT_LEASE_SECONDS = 90.0
DEFAULT_HEARTBEAT_SECONDS = 30.0
DEFAULT_TOLERATED_MISSES = 1
DEFAULT_JITTER_SECONDS = 20.0
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_BACKOFF_BASE_SECONDS = 1.0
DEFAULT_BACKOFF_MAX_SECONDS = 300.0


def _seconds(value: float) -> str:
    return f"{value:g}s"


def check_intervals(
    *,
    lease_seconds: float,
    heartbeat_seconds: float,
    tolerated_misses: int,
    jitter_seconds: float,
) -> None:
    """Raise `IntervalRuleViolation` unless ``lease > R * heartbeat + jitter``."""
    from fencegate.lease.errors import IntervalRuleViolation

    if heartbeat_seconds <= 0:
        raise IntervalRuleViolation(f"heartbeat {_seconds(heartbeat_seconds)} must be positive")
    if jitter_seconds < 0:
        raise IntervalRuleViolation(f"jitter {_seconds(jitter_seconds)} must not be negative")
    if tolerated_misses < 1:
        raise IntervalRuleViolation(
            f"tolerated misses {tolerated_misses} must be at least 1: a lease that cannot "
            "survive one lost heartbeat expires under ordinary latency"
        )
    bound = tolerated_misses * heartbeat_seconds + jitter_seconds
    if not lease_seconds > bound:
        raise IntervalRuleViolation(
            f"lease {_seconds(lease_seconds)} must exceed {tolerated_misses} × heartbeat "  # noqa: RUF001
            f"{_seconds(heartbeat_seconds)} + jitter {_seconds(jitter_seconds)} "
            f"= {_seconds(bound)}"
        )


@dataclass(frozen=True, slots=True)
class WorkClass:
    """The policy of one job kind. Checked when created."""

    kind: str
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS
    tolerated_misses: int = DEFAULT_TOLERATED_MISSES
    jitter_seconds: float = DEFAULT_JITTER_SECONDS
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    backoff_base_seconds: float = DEFAULT_BACKOFF_BASE_SECONDS
    backoff_max_seconds: float = DEFAULT_BACKOFF_MAX_SECONDS
    stage_timeout_seconds: float | None = None
    tool_timeout_seconds: float | None = None

    def __post_init__(self) -> None:
        if not self.kind:
            raise ValueError("a work class needs a kind")
        check_intervals(
            lease_seconds=self.lease_seconds,
            heartbeat_seconds=self.heartbeat_seconds,
            tolerated_misses=self.tolerated_misses,
            jitter_seconds=self.jitter_seconds,
        )
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts {self.max_attempts} must be at least 1")
        if self.backoff_base_seconds < 0 or self.backoff_max_seconds < self.backoff_base_seconds:
            raise ValueError(
                f"backoff must satisfy 0 <= base ({self.backoff_base_seconds:g}s) "
                f"<= max ({self.backoff_max_seconds:g}s)"
            )
        for name in ("stage_timeout_seconds", "tool_timeout_seconds"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} {value:g} must be positive")


def backoff_seconds(
    attempt: int, *, base: float, cap: float, rng: random.Random | None = None
) -> float:
    """Delay before retrying after failed attempt number ``attempt`` (1-based).

    Exponential and capped, with "equal jitter": between half and all of the exponential
    step, so retries of many jobs that failed together spread out but still back off.
    """
    # The exponent is bounded so that a job with thousands of attempts cannot overflow.
    step = min(cap, base * 2.0 ** min(max(attempt - 1, 0), 64))
    return step * jitter_factor(rng)


def jitter_factor(rng: random.Random | None = None) -> float:
    return 0.5 + 0.5 * (rng or random).random()


def fails_for_good(attempt: int, max_attempts: int, *, permanent: bool) -> bool:
    """Whether failing attempt number ``attempt`` ends the job (`failed`) rather than
    scheduling a retry: the error is permanent, or no attempt is left.

    The one home of this rule: the queue turns it into "no retry" before the store writes
    anything, and the worker reads the outcome from it without asking the store again. (A
    lease that expires on its last attempt is failed by the claim that finds it.)
    """
    return permanent or attempt >= max_attempts
