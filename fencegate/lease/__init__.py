"""The worker half of fencegate: a durable lease queue (`LeaseQueue`) and the `Worker` that
runs jobs on it with heartbeats, fencing tokens, stages and signed calls."""

from typing import TYPE_CHECKING, Any

from fencegate.lease import errors
from fencegate.lease.errors import (
    IntervalRuleViolation,
    JobNotFound,
    LeaseQueueError,
    StoreUnavailable,
    UnknownWorkClass,
)
from fencegate.lease.models import Attempt, Job, Lease, NewJob, StageRecord
from fencegate.lease.policy import WorkClass
from fencegate.lease.queue import LeaseQueue

if TYPE_CHECKING:
    from fencegate.lease.worker import Worker

__all__ = [
    "Attempt",
    "IntervalRuleViolation",
    "Job",
    "JobNotFound",
    "Lease",
    "LeaseQueue",
    "LeaseQueueError",
    "NewJob",
    "StageRecord",
    "StoreUnavailable",
    "UnknownWorkClass",
    "WorkClass",
    "Worker",
    "errors",
]


def __getattr__(name: str) -> Any:
    # Imported on first use: the queue alone must not need the worker's dependencies.
    if name == "Worker":
        from fencegate.lease.worker import Worker

        return Worker
    raise AttributeError(name)
