"""`fencegate migrate`: apply the SQL under `sql/` to PostgreSQL or SQLite."""

from __future__ import annotations

import argparse
import asyncio
import os

from fencegate.cli import CommandError
from fencegate.migrations import migrate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        default=os.environ.get("FENCEGATE_DATABASE_URL"),
        help="postgresql://… or sqlite:///path.db (default: sqlite:///fencegate.db; "
        "env FENCEGATE_DATABASE_URL)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        applied = asyncio.run(migrate(args.database_url))
    except (ValueError, OSError) as exc:
        raise CommandError(str(exc)) from exc
    except Exception as exc:  # asyncpg / sqlite errors: say what failed, not a traceback
        raise CommandError(f"{type(exc).__name__}: {exc}") from exc
    if applied:
        for name in applied:
            print(f"applied {name}")
    else:
        print("already up to date")
    return 0
