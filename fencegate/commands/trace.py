"""`fencegate trace ENTITY-or-KEY`: one timeline that joins the gateway's decisions with the
lease grants whose fencing tokens they carried — the answer to "who sent these two requests,
with which token, and which one was fenced off"."""

from __future__ import annotations

import argparse

from fencegate.commands.migrate import run_on_store
from fencegate.commands.output import add_common, print_json, print_table, readable
from fencegate.errors import CommandError
from fencegate.store.inspect import Inspector, Trace

_COLUMNS = (
    "at",
    "source",
    "what",
    "token",
    "worker",
    "job_id",
    "attempt",
    "owner",
    "key",
    "request_id",
    "target",
    "status",
)


# Reads and actions: the store must exist and be migrated (checked before `run`).
NEEDS_EXISTING_STORE = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("subject", help="an entity (e.g. job:17, invoice_id:inv-1042) or a key")
    add_common(parser, tenant_default=None)


async def _trace(args: argparse.Namespace) -> Trace:
    inspector = await Inspector.open(args.database_url, timeout=args.timeout)
    try:
        return await inspector.trace(args.subject, tenant=args.tenant, timeout=args.timeout)
    finally:
        await inspector.close()


def run(args: argparse.Namespace) -> int:
    trace = run_on_store(_trace(args))
    if not trace.events:
        raise CommandError(f"nothing recorded for {args.subject!r}")
    if args.json:
        print_json({"subject": trace.subject, "fence": trace.fence, "events": trace.events})
        return 0
    if trace.fence is not None:
        fence = readable(trace.fence)
        print(f"fence of {trace.subject}: {fence['last_accepted']} (since {fence['updated_at']})")
    print_table(trace.events, _COLUMNS)
    return 0
