"""What the lease queue raises.

`StoreUnavailable` is the one a worker must treat differently from the others: the database
did not answer in time, so ownership of any lease is *unknown* (not lost).
"""

from __future__ import annotations

from fencegate.errors import FencegateError, StoreUnavailable

__all__ = [
    "IntervalRuleViolation",
    "JobNotFound",
    "LeaseQueueError",
    "StoreUnavailable",
    "UnknownWorkClass",
]


class LeaseQueueError(FencegateError):
    """Base class of the lease queue's own errors (store trouble is `StoreUnavailable`, the
    same class the gateway's stores raise)."""


class IntervalRuleViolation(LeaseQueueError, ValueError):
    """A lease that would not survive the tolerated missed heartbeats plus jitter."""


class UnknownWorkClass(LeaseQueueError, KeyError):
    """A work class (job kind) that was never declared on this queue."""

    def __str__(self) -> str:
        # KeyError would print the repr of its argument; the message reads better as is.
        return str(self.args[0]) if self.args else "unknown work class"


class JobNotFound(LeaseQueueError, LookupError):
    """No job has this id."""
