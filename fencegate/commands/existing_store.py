"""The store an operator command reads or acts on must already exist and be migrated.

Opening a SQLite file creates it, and an empty database answers every query with "no such
table": a command run from the wrong directory would then invent an empty store and print a
driver error. Instead, before the command runs, this names the store that was looked at and
what to do (``--database-url``, ``fencegate migrate``), and creates nothing.
"""

from __future__ import annotations

import asyncio

from fencegate.errors import CommandError, StoreUnavailable
from fencegate.store.backends import applied_migrations_read_only, describe_store
from fencegate.store.dburl import DatabaseURL, parse_database_url, redacted
from fencegate.store.schema import SchemaMismatch, check_applied

# The store as a person reads it in an error (kept under this name for the commands).
store_name = describe_store


def what_to_do(target: DatabaseURL) -> str:
    return (
        "name the gateway's store with --database-url (or FENCEGATE_DATABASE_URL), or create "
        f"it with `fencegate migrate --database-url {redacted(target.url)}`"
    )


def require_existing_store(url: str | None, *, timeout: float) -> None:
    """Raise `CommandError` (one line: which store, what to do) unless the store exists and
    holds the schema this fencegate needs."""
    try:
        target = parse_database_url(url)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    where = store_name(target)
    try:
        applied = asyncio.run(applied_migrations_read_only(target, timeout=timeout))
    except FileNotFoundError:
        raise CommandError(
            f"there is no store here: {where} does not exist (nothing was created); "
            f"{what_to_do(target)}"
        ) from None
    except StoreUnavailable as exc:
        # Worded by the backend layer, which names the store.
        raise CommandError(str(exc)) from None
    try:
        check_applied(applied, target.kind, url)
    except SchemaMismatch as exc:
        if applied is None:
            raise CommandError(f"{where} holds no fencegate schema; {what_to_do(target)}") from None
        raise CommandError(f"{where}: {exc}") from None
