"""What the lease queue raises.

`StoreUnavailable` is the one a worker must treat differently from the others: the database
did not answer in time, so ownership of any lease is *unknown* (not lost).
"""

from __future__ import annotations


class LeaseQueueError(Exception):
    """Base class of every lease-queue error."""


class StoreUnavailable(LeaseQueueError):
    """The database was unreachable or did not answer within the call's timeout."""


class IntervalRuleViolation(LeaseQueueError, ValueError):
    """A lease that would not survive the tolerated missed heartbeats plus jitter."""


class UnknownWorkClass(LeaseQueueError, KeyError):
    """A work class (job kind) that was never declared on this queue."""

    def __str__(self) -> str:
        # KeyError would print the repr of its argument; the message reads better as is.
        return str(self.args[0]) if self.args else "unknown work class"


class JobNotFound(LeaseQueueError, LookupError):
    """No job has this id."""
