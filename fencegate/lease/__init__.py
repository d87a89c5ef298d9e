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
from fencegate.lease.policy import RateLimit, WorkClass
from fencegate.lease.queue import LeaseQueue

if TYPE_CHECKING:
    from fencegate.lease.events import EventLog
    from fencegate.lease.execution import OwnershipLost, OwnershipUnknown, PermanentError
    from fencegate.lease.job import JobContext
    from fencegate.lease.worker import Worker, run_worker

__all__ = [
    "Attempt",
    "EventLog",
    "IntervalRuleViolation",
    "Job",
    "JobContext",
    "JobNotFound",
    "Lease",
    "LeaseQueue",
    "LeaseQueueError",
    "NewJob",
    "OwnershipLost",
    "OwnershipUnknown",
    "PermanentError",
    "RateLimit",
    "StageRecord",
    "StoreUnavailable",
    "UnknownWorkClass",
    "WorkClass",
    "Worker",
    "errors",
    "run_worker",
]

_WORKER_NAMES = {
    "Worker": "fencegate.lease.worker",
    "run_worker": "fencegate.lease.worker",
    "JobContext": "fencegate.lease.job",
    "EventLog": "fencegate.lease.events",
    "OwnershipLost": "fencegate.lease.execution",
    "OwnershipUnknown": "fencegate.lease.execution",
    "PermanentError": "fencegate.lease.execution",
}


def __getattr__(name: str) -> Any:
    # Imported on first use: the queue alone must not need the worker's dependencies.
    if name in _WORKER_NAMES:
        import importlib

        return getattr(importlib.import_module(_WORKER_NAMES[name]), name)
    raise AttributeError(name)
