"""`fencegate jobs list|show|retry|cancel|purge`: the lease queue as an operator sees it.

``list`` also shows each scheduling limit in force (per work class, per key, per provider's
rate), how many jobs run under it and how many ready jobs it holds back.

``show`` gives a job's attempts (token, owner, times, outcome) and stages; errors appear as a
code and a hash, never as text (it may quote the payload). ``retry`` gives a failed or
cancelled job one more attempt; ``cancel`` stops a queued or running one (its holder's next
heartbeat or commit finds it gone); ``purge`` deletes finished jobs with their attempts and
stages. Each action is recorded with who, why, and the job before and after.
"""

from __future__ import annotations

import argparse
import re

from fencegate.commands.migrate import run_on_store
from fencegate.commands.output import (
    add_actor,
    add_common,
    print_fields,
    print_json,
    print_table,
)
from fencegate.errors import CommandError
from fencegate.lease import LeaseQueue
from fencegate.operator_actions import cancel_job, retry_job
from fencegate.store.inspect import JOB_STATES, Inspector, Page, Row

_LIST = ("id", "kind", "state", "priority", "concurrency_key", "attempt", "max_attempts",
         "fencing_token", "owner_id", "lease_until", "updated_at", "has_error")  # fmt: skip
_LIMITS = ("rule", "subject", "limit", "running", "waiting", "detail")
_ATTEMPTS = ("attempt", "fencing_token", "owner_id", "claimed_at", "ended_at", "outcome", "error")
_STAGES = ("name", "fencing_token", "committed_at", "idempotency_key")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


# Reads and actions: the store must exist and be migrated (checked before `run`).
NEEDS_EXISTING_STORE = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    listing = actions.add_parser("list", help="jobs, newest first, a page at a time")
    add_common(listing, tenant_default=None, tenant=False)
    listing.add_argument("--state", choices=JOB_STATES)
    listing.add_argument("--kind", help="the work class")
    listing.add_argument("--cursor", help="the cursor a previous page printed")
    listing.add_argument("--limit", type=int, default=50, help="jobs per page (default 50)")
    for name, text in (
        ("show", "a job with its attempts and stages"),
        ("retry", "give a failed or cancelled job one more attempt"),
        ("cancel", "cancel a queued or running job"),
    ):
        action = actions.add_parser(name, help=text)
        action.add_argument("job_id", type=int)
        add_common(action, tenant_default=None, tenant=False)
        if name != "show":
            add_actor(action)
    purge = actions.add_parser("purge", help="delete finished jobs not updated for a while")
    purge.add_argument(
        "--older-than", required=True, help="e.g. 7d, 12h, 30m, 90s: finished and idle that long"
    )
    add_common(purge, tenant_default=None, tenant=False)
    add_actor(purge)


def duration(text: str) -> float:
    match = _DURATION.match(text.strip())
    if match is None:
        raise CommandError(f"--older-than {text!r}: give a number and a unit, e.g. 7d or 12h")
    return float(match.group(1)) * _UNIT[match.group(2)]


async def _with_inspector(
    args: argparse.Namespace,
) -> tuple[Page, list[Row]] | Row | int | None:
    inspector = await Inspector.open(args.database_url, timeout=args.timeout)
    actor = f"operator:{getattr(args, 'by', '')}"
    try:
        if args.action == "list":
            page = await inspector.jobs(
                state=args.state, kind=args.kind, cursor=args.cursor, limit=args.limit,
                timeout=args.timeout,
            )  # fmt: skip
            return page, await inspector.limits(timeout=args.timeout)
        if args.action == "show":
            return await inspector.job(args.job_id, timeout=args.timeout)
        if args.action in ("retry", "cancel"):
            return await _act(args, inspector, actor)
        return await inspector.purge_jobs(
            older_than_seconds=duration(args.older_than), actor=actor, timeout=args.timeout
        )
    finally:
        await inspector.close()


async def _act(args: argparse.Namespace, inspector: Inspector, actor: str) -> Row | None:
    action = retry_job if args.action == "retry" else cancel_job
    async with await LeaseQueue.connect(args.database_url) as queue:
        return await action(
            queue, inspector, args.job_id, actor=actor, reason=args.reason, timeout=args.timeout
        )


def run(args: argparse.Namespace) -> int:
    if args.action == "list" and args.limit < 1:
        raise CommandError("--limit must be at least 1")
    result = run_on_store(_with_inspector(args))
    if args.action == "list":
        assert isinstance(result, tuple)
        page, limits = result
        if args.json:
            print_json({"jobs": page.rows, "cursor": page.cursor, "limits": limits})
        else:
            print_table(page.rows, _LIST)
            if page.cursor:
                print(f"more: --cursor {page.cursor}")
            if limits:
                print("\nlimits (running under each, ready jobs held back by it):")
                print_table(limits, _LIMITS)
        return 0
    if args.action == "purge":
        print_json({"deleted": result}) if args.json else print(f"purged {result} jobs")
        return 0
    if result is None:
        verb = {"show": "no", "retry": "no failed or cancelled", "cancel": "no queued or running"}
        raise CommandError(f"{verb[args.action]} job {args.job_id}")
    assert isinstance(result, dict)
    if args.json:
        print_json(result)
    elif args.action == "show":
        print_fields(result)
        print("\nattempts:")
        print_table(result["attempts"], _ATTEMPTS)
        print("\nstages:")
        print_table(result["stages"], _STAGES)
    else:
        print(f"job {args.job_id}: {args.action} done, now {result['state']}")
    return 0
