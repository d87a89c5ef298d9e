"""`fencegate audit list`: the operator actions recorded in ``fencegate_audit``, newest
first — who resolved which key, retried or cancelled which job, why, and the state before and
after. The console's Audit page shows the same records."""

from __future__ import annotations

import argparse

import orjson

from fencegate.commands.migrate import run_on_store
from fencegate.commands.output import add_common, print_json, print_table
from fencegate.errors import CommandError
from fencegate.store.inspect import Inspector, Row

_COLUMNS = ("at", "actor", "action", "tenant", "subject", "reason", "change")

# Reads and actions: the store must exist and be migrated (checked before `run`).
NEEDS_EXISTING_STORE = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    listing = actions.add_parser(
        "list", help="operator actions, newest first: who, what, why, before and after"
    )
    add_common(listing, tenant_default=None)
    listing.add_argument("--limit", type=int, default=50, help="records to show (default 50)")


async def _list(args: argparse.Namespace) -> list[Row]:
    inspector = await Inspector.open(args.database_url, timeout=args.timeout)
    try:
        rows = await inspector.audit_log(tenant=args.tenant, limit=args.limit, timeout=args.timeout)
    finally:
        await inspector.close()
    for row in rows:
        for side in ("before", "after"):
            row[side] = orjson.loads(row[side]) if row[side] else None
    return rows


def _change(row: Row) -> str:
    """``state outcome_unknown -> completed``: what the action changed, in one cell."""
    before, after = row["before"] or {}, row["after"] or {}
    # A released key has no state after: say what happened rather than print Python's None.
    gone = "released" if str(row.get("action", "")).endswith("released") else "-"
    changed = [
        f"{name} {before.get(name) or '-'} -> {after.get(name) or gone}"
        for name in ("state",)
        if before.get(name) != after.get(name)
    ]
    return "; ".join(changed)


def run(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise CommandError("--limit must be at least 1")
    rows = run_on_store(_list(args))
    if args.json:
        print_json({"audit": rows})
    else:
        print_table([{**row, "change": _change(row)} for row in rows], _COLUMNS)
    return 0
