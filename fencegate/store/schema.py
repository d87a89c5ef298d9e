"""Whether a store's database holds the schema this code needs.

The schema is the list of migration files shipped in the package (`sql/<store>/`); a database
is current when `fencegate_migrations` names exactly those. The gateway refuses to start on
anything else, and ``/healthz`` reports it, so that a database nobody migrated is one clear
line at start-up rather than a 500 on every keyed request.
"""

from __future__ import annotations

from typing import Literal

from fencegate.errors import FencegateError
from fencegate.store.base import GatewayStore
from fencegate.store.dburl import redacted
from fencegate.store.migrations import (
    FUNCTIONS,
    function_files,
    legacy_files,
    migration_files,
)


class SchemaMismatch(FencegateError):
    """The database lacks the schema this code needs (or has one from a newer release)."""


def needed_migrations(kind: Literal["postgresql", "sqlite"]) -> list[str]:
    """The versioned migrations, then the functions as they are now."""
    return [name for name, _ in migration_files(kind)] + [
        record for record, _ in function_files(kind)
    ]


def schema_version(kind: Literal["postgresql", "sqlite"]) -> str:
    """The newest migration this code needs, e.g. ``003_unknown_outcomes``."""
    return [name for name, _ in migration_files(kind)][-1].removesuffix(".sql")


def operator_store_argument(url: str | None) -> str:
    """``--database-url …`` for the commands a 424 problem tells an operator to run. The
    body goes to API clients, who must learn nothing of the server: not a PostgreSQL URL's
    internal hosts, nor a SQLite file's path. The command reads the operator's own
    ``FENCEGATE_DATABASE_URL`` (the gateway's start-up line names the store)."""
    del url  # the same words whatever the store: its location stays on the server
    return '--database-url "$FENCEGATE_DATABASE_URL"'


def check_applied(
    applied: list[str] | None,
    kind: Literal["postgresql", "sqlite"],
    database_url: str | None,
) -> None:
    """Raise `SchemaMismatch` unless ``applied`` (None: no migrations table) is current."""
    needed = needed_migrations(kind)
    fix = (
        f"run `fencegate migrate --database-url {redacted(database_url)}` (or start with --migrate)"
    )
    if applied is None:
        raise SchemaMismatch(f"the database has no fencegate schema: {fix}")
    # The pre-1.0 files that built a database stay recorded: they are known.
    known = set(needed) | {name for name, _ in legacy_files(kind)}
    unknown = sorted(name for name in set(applied) - known if not name.startswith(FUNCTIONS + "/"))
    if unknown:
        raise SchemaMismatch(
            f"the database has migrations this fencegate does not know ({', '.join(unknown)}): "
            f"it was migrated by a newer release; upgrade fencegate"
        )
    missing = [name for name in needed if name not in applied]
    if missing and all(name.startswith(FUNCTIONS + "/") for name in missing):
        # Only functions differ: an older or newer release migrated it.
        changed = ", ".join(name.split("/", 1)[1].split("@", 1)[0] for name in missing)
        raise SchemaMismatch(
            f"the database's fencegate functions ({changed}) are not this release's: {fix}"
        )
    if missing:
        raise SchemaMismatch(f"the database's fencegate schema lacks {', '.join(missing)}: {fix}")


async def require_schema(store: GatewayStore, *, database_url: str | None, timeout: float) -> None:
    """Raise `SchemaMismatch` (one line naming `fencegate migrate`) unless the store holds
    the schema this code needs. `fencegate serve` and the middleware both call it at start."""
    applied = await store.applied_migrations(timeout=timeout)
    check_applied(applied, store.kind, database_url)
