"""`fencegate fences show ENTITY`: the last fence accepted for an entity, and every fenced
decision about it (accepted, stale), with the token each request carried."""

from __future__ import annotations

import argparse

from fencegate.commands.migrate import run_on_store
from fencegate.commands.output import add_common, print_fields, print_json, print_table
from fencegate.errors import CommandError
from fencegate.store.inspect import Inspector, Trace

_COLUMNS = ("at", "what", "token", "key", "owner", "request_id", "method", "target")


# Reads and actions: the store must exist and be migrated (checked before `run`).
NEEDS_EXISTING_STORE = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    show = actions.add_parser("show", help="an entity's fence and its history")
    show.add_argument("entity", help="the entity, e.g. invoice_id:inv-1042 or job:17")
    add_common(show, tenant_default=None)


async def _show(args: argparse.Namespace) -> Trace:
    inspector = await Inspector.open(args.database_url, timeout=args.timeout)
    try:
        return await inspector.fence(args.entity, tenant=args.tenant, timeout=args.timeout)
    finally:
        await inspector.close()


def run(args: argparse.Namespace) -> int:
    trace = run_on_store(_show(args))
    if trace.fence is None and not trace.events:
        raise CommandError(f"no fence for entity {args.entity!r}")
    if args.json:
        print_json({"entity": args.entity, "fence": trace.fence, "history": trace.events})
        return 0
    if trace.fence is not None:
        print_fields(trace.fence)
        print()
    print_table(trace.events, _COLUMNS)
    return 0
