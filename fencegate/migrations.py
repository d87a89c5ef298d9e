"""Moved to `fencegate.store.migrations`."""

from fencegate.store.migrations import *  # noqa: F403
