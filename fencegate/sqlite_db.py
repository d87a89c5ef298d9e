"""Moved to `fencegate.store.sqlite_db`."""

from fencegate.store.sqlite_db import *  # noqa: F403
