"""Moved to `fencegate.store.dburl`."""

from fencegate.store.dburl import *  # noqa: F403
