"""Work classes: the intervals and attempt policy of one kind of job.

Intervals belong to the work class, never to the job's own code or to a model: a lease is
refused unless it outlives the heartbeats it may miss plus a margin for jitter
(``lease > R * heartbeat + jitter``).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

DEFAULT_LEASE_SECONDS = 90.0
DEFAULT_HEARTBEAT_SECONDS = 30.0
DEFAULT_TOLERATED_MISSES = 1
DEFAULT_JITTER_SECONDS = 20.0
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_BACKOFF_BASE_SECONDS = 1.0
DEFAULT_BACKOFF_MAX_SECONDS = 300.0

# Provider and model names are metric labels: declared names, never free text from a model.
_LABEL = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")


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
    # Scheduling, enforced by the database for every worker of the fleet: at most
    # max_running jobs of this kind hold a live lease at once, at most max_running_per_key
    # per concurrency key; each job granted takes a token from the provider's bucket
    # (`RateLimit`). provider and model also label the metrics and events.
    max_running: int | None = None
    max_running_per_key: int | None = None
    provider: str | None = None
    model: str | None = None
    # The models a job of this class may name (`enqueue(model=...)`), besides ``model``.
    models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.kind:
            raise ValueError("a work class needs a kind")
        for name in ("max_running", "max_running_per_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} {value!r} must be a whole number of at least 1")
        if isinstance(self.models, str):
            raise TypeError(f"models must be a tuple of names, e.g. models=({self.models!r},)")
        for name, value in [("provider", self.provider), ("model", self.model)] + [
            ("models", m) for m in self.models
        ]:
            if value is not None and not _LABEL.fullmatch(value):
                raise ValueError(f"{name} {value!r} must match {_LABEL.pattern} (it is a label)")

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

    def allows_model(self, model: str) -> bool:
        """Whether a job of this class may name ``model`` (a declared name, never free text)."""
        return model == self.model or model in self.models


@dataclass(frozen=True, slots=True)
class RateLimit:
    """At most ``limit`` jobs of the provider's work classes granted per ``per_seconds``,
    across the fleet: a token bucket kept in the database (``limit`` tokens, refilled at
    ``limit / per_seconds`` a second). A job that finds no token stays queued, holding no
    lease, until one is there."""

    provider: str
    limit: int
    per_seconds: float = 1.0

    def __post_init__(self) -> None:
        if not _LABEL.fullmatch(self.provider):
            raise ValueError(f"provider {self.provider!r} must match {_LABEL.pattern}")
        if not isinstance(self.limit, int) or self.limit < 1:
            raise ValueError(f"rate limit {self.limit!r} must be a whole number of at least 1")
        if not self.per_seconds > 0:
            raise ValueError(f"per_seconds {self.per_seconds:g} must be positive")


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
