"""`fencegate purge`: delete expired idempotency keys, idle fences and expired signature
nonces, in batches. The gateway also does this on its own every purge interval."""

from __future__ import annotations

import argparse
import os

from fencegate.commands.migrate import add_database_url, run_on_store
from fencegate.errors import CommandError
from fencegate.gateway.config import DAY
from fencegate.store import PurgeCounts, open_gateway_store

# Reads and actions: the store must exist and be migrated (checked before `run`).
NEEDS_EXISTING_STORE = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_database_url(parser)
    parser.add_argument(
        "--fence-ttl-seconds",
        type=float,
        # A string default goes through `type`, so a bad value is a usage error here.
        default=os.environ.get("FENCEGATE_FENCE_TTL_SECONDS", str(30 * DAY)),
        help="delete fences not updated for this long (default 30 days; "
        "env FENCEGATE_FENCE_TTL_SECONDS)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=1000, help="rows deleted per statement (default 1000)"
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds allowed per batch (default 60)"
    )


async def purge(
    url: str | None, *, fence_ttl_seconds: float, batch_size: int, timeout: float
) -> PurgeCounts:
    store = await open_gateway_store(url, run_migrations=False, pool_max_size=1, timeout=timeout)
    try:
        return await store.purge(
            fence_ttl_seconds=fence_ttl_seconds, batch_size=batch_size, timeout=timeout
        )
    finally:
        await store.close()


def run(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise CommandError("--batch-size must be at least 1")
    counts = run_on_store(
        purge(
            args.database_url,
            fence_ttl_seconds=args.fence_ttl_seconds,
            batch_size=args.batch_size,
            timeout=args.timeout,
        )
    )
    print(
        f"purged {counts.keys} keys, {counts.fences} fences, {counts.nonces} nonces, "
        f"{counts.decisions} decision history rows"
    )
    return 0
