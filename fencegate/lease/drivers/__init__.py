"""Store drivers: each only runs the lease queue's SQL on one database and turns rows into
records. The rules live in `fencegate.lease.queue`."""

from fencegate.lease.drivers.base import Driver

__all__ = ["Driver"]
