"""One exception root: whatever fencegate raises on purpose, ``except FencegateError`` catches."""

from __future__ import annotations

import fencegate
from fencegate import FencegateError
from fencegate.cli import CommandError
from fencegate.gateway.config import ConfigError
from fencegate.lease import errors as lease_errors
from fencegate.lease.execution import OwnershipLost, OwnershipUnknown, PermanentError
from fencegate.problems import Problem
from fencegate.signing import KeyConfigError
from fencegate.store import StoreUnavailable
from fencegate.store.schema import SchemaMismatch


def test_every_public_error_is_a_fencegate_error() -> None:
    for error in (
        CommandError,
        ConfigError,
        Problem,
        SchemaMismatch,
        KeyConfigError,
        StoreUnavailable,
        lease_errors.LeaseQueueError,
        lease_errors.JobNotFound,
        lease_errors.UnknownWorkClass,
        lease_errors.IntervalRuleViolation,
        OwnershipLost,
        OwnershipUnknown,
        PermanentError,
    ):
        assert issubclass(error, FencegateError), error


def test_the_gateway_and_the_lease_queue_share_one_store_unavailable() -> None:
    assert lease_errors.StoreUnavailable is StoreUnavailable is fencegate.StoreUnavailable
