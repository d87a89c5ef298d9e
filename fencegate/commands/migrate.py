"""`fencegate migrate`: apply the SQL under `sql/` to PostgreSQL or SQLite."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

from fencegate.errors import CommandError
from fencegate.store import StoreUnavailable
from fencegate.store.dburl import parse_database_url
from fencegate.store.migrations import migrate

T = TypeVar("T")


def add_database_url(parser: argparse.ArgumentParser) -> None:
    """``--database-url``, as every command that opens the store takes it."""
    parser.add_argument(
        "--database-url",
        default=os.environ.get("FENCEGATE_DATABASE_URL"),
        help="postgresql://… or sqlite:///path.db (default: sqlite:///fencegate.db; "
        "env FENCEGATE_DATABASE_URL)",
    )


def run_on_store(work: Coroutine[Any, Any, T], *, store: str | None = None) -> T:
    """Run a command's work on the store; any failure is one clear line, not a traceback.
    ``store`` (how to name the store, e.g. ``PostgreSQL at postgresql://…``) prefixes it."""
    prefix = f"{store}: " if store else ""
    try:
        return asyncio.run(work)
    except CommandError:
        raise
    except (ValueError, OSError, StoreUnavailable) as exc:
        raise CommandError(f"{prefix}{exc}") from exc
    except Exception as exc:  # asyncpg / sqlite errors: say what failed
        raise CommandError(f"{prefix}{type(exc).__name__}: {exc}") from exc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_database_url(parser)
    parser.add_argument(
        "--citus",
        action="store_true",
        help="require a Citus coordinator and distribute the gateway's tables by tenant "
        "(done anyway where the citus extension is installed)",
    )


def run(args: argparse.Namespace) -> int:
    from fencegate.commands.existing_store import store_name

    try:
        target = parse_database_url(args.database_url)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    citus = True if getattr(args, "citus", False) else None
    applied = run_on_store(
        migrate(args.database_url, citus=citus), store=f"cannot migrate {store_name(target)}"
    )
    if applied:
        for name in applied:
            print(f"applied {name}")
    else:
        print("already up to date")
    return 0
