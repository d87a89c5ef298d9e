"""`fencegate keys list|show|resolve`: the idempotency keys, one key, and resolving one whose
outcome is unknown.

A key is unknown when the upstream may have acted but its answer was never recorded: the
upstream timed out, or the gateway holding it stopped before recording. The gateway answers
such a key with 424 ``outcome-unknown`` and never forwards it again on its own. The operator
finds out what really happened upstream, then either records that answer (``--completed``:
every retry replays it) or releases the key (``--release``: the next request runs again).

Both only once no copy of the request can still reach the upstream (the release rule,
docs/operations/safe-release.md): its gateway is not alive, and its lease ended (or its
outcome became unknown) longer ago than the release margin. Otherwise the command refuses,
saying why and from when it is safe; ``--force`` overrides it, and is audited as such.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from fencegate.commands.migrate import add_database_url, run_on_store
from fencegate.commands.output import (
    add_actor,
    add_common,
    add_release_margin,
    print_fields,
    print_json,
    print_table,
)
from fencegate.errors import CommandError
from fencegate.operator_actions import (
    key_fields,
    key_history,
    refusal,
    resolve_key,
    stored_answer,
)
from fencegate.store import (
    KeyRecord,
    Resolution,
    ResolveResult,
    StoredResponse,
    open_gateway_store,
)
from fencegate.store.inspect import Inspector, Page
from fencegate.store.key_states import KEY_STATES
from fencegate.types import DEFAULT_TENANT

# Reads and actions: the store must exist and be migrated (checked before `run`).
NEEDS_EXISTING_STORE = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True

    listing = actions.add_parser("list", help="keys by state, a page at a time")
    add_common(listing, tenant_default=None)
    listing.add_argument(
        "--state",
        choices=KEY_STATES,
        help="outcome_unknown takes in both reasons: upstream_timeout (marked so) and "
        "lease_expired (in flight, its gateway's lease ran out)",
    )
    listing.add_argument("--cursor", help="the cursor a previous page printed")
    listing.add_argument("--limit", type=int, default=50, help="keys per page (default 50)")

    show = actions.add_parser(
        "show", help="one key: state, request, holder, when it may be released, history"
    )
    _common(show)
    add_release_margin(show)
    show.add_argument("--json", action="store_true", help="one JSON object instead of a table")

    resolve = actions.add_parser(
        "resolve", help="record the real answer of an unknown key, or release it"
    )
    _common(resolve)
    what = resolve.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--completed", action="store_true", help="store an answer: every retry replays it"
    )
    what.add_argument(
        "--release", action="store_true", help="delete the key: the next request runs again"
    )
    resolve.add_argument("--status", type=int, help="the answer's HTTP status (with --completed)")
    resolve.add_argument(
        "--body", default="", help="the answer's body: text, or @FILE to read it from a file"
    )
    resolve.add_argument(
        "--content-type", default="application/json", help="the answer's Content-Type"
    )
    add_release_margin(resolve)
    resolve.add_argument(
        "--force",
        action="store_true",
        help="skip the release rule (a copy of the request may still reach the upstream and "
        "run again); audited as keys.resolve_forced",
    )
    add_actor(resolve)


_LIST_COLUMNS = (
    "tenant",
    "key",
    "state",
    "reason",
    "attempt",
    "owner",
    "entity",
    "fence",
    "created_at",
    "response_status",
)
_HISTORY_COLUMNS = ("at", "what", "attempt", "token", "owner", "request_id", "status")
# History words after which a key has no row: the next request with it runs as new.
_RELEASES = ("released", "resolved_released", "resolved_forced", "reconciled_released")


def _show_gone(args: argparse.Namespace, history: list[dict[str, object]]) -> int:
    """A key with no row: released (it stays visible through its history) or never seen."""
    if not history:
        raise CommandError(f"no key {args.key!r} for tenant {args.tenant!r}")
    last = history[-1]
    state = "released" if last.get("what") in _RELEASES else "gone"
    if args.json:
        print_json({"tenant": args.tenant, "key": args.key, "state": state, "history": history})
        return 0
    by = f" by {last.get('owner')}" if last.get("owner") else ""
    print(
        f"key {args.key!r} (tenant {args.tenant!r}) has no record now: {state}{by} "
        f"({last.get('what')}); the next request with it runs as new. Its history:"
    )
    print()
    print_table(history, _HISTORY_COLUMNS)
    return 0


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("key", help="the Idempotency-Key, as the client sent it")
    parser.add_argument(
        "--tenant",
        default=os.environ.get("FENCEGATE_TENANT", DEFAULT_TENANT),
        help=f"the tenant that owns the key (default {DEFAULT_TENANT!r}; env FENCEGATE_TENANT)",
    )
    add_database_url(parser)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds for the store")


async def _show(args: argparse.Namespace) -> KeyRecord | None:
    store = await open_gateway_store(args.database_url, run_migrations=False, pool_max_size=1)
    try:
        return await store.get_key(
            args.tenant, args.key, margin=args.release_margin, timeout=args.timeout
        )
    finally:
        await store.close()


async def _resolve(args: argparse.Namespace, answer: StoredResponse | None) -> Resolution:
    """Resolve the key under the release rule, with the audit record (who did it, why, and
    the key before and after) in the same transaction."""
    store = await open_gateway_store(args.database_url, run_migrations=False, pool_max_size=1)
    try:
        return await resolve_key(
            store,
            tenant=args.tenant,
            key=args.key,
            answer=answer,
            actor=f"operator:{args.by}",
            reason=args.reason,
            margin=args.release_margin,
            force=args.force,
            timeout=args.timeout,
        )
    finally:
        await store.close()


async def _list(args: argparse.Namespace) -> Page:
    inspector = await Inspector.open(args.database_url, timeout=args.timeout)
    try:
        return await inspector.keys(
            tenant=args.tenant,
            state=args.state,
            cursor=args.cursor,
            limit=args.limit,
            timeout=args.timeout,
        )
    finally:
        await inspector.close()


async def _history(args: argparse.Namespace) -> list[dict[str, object]]:
    inspector = await Inspector.open(args.database_url, timeout=args.timeout)
    try:
        return await key_history(inspector, tenant=args.tenant, key=args.key, timeout=args.timeout)
    finally:
        await inspector.close()


def _read_body(spec: str) -> bytes:
    if not spec.startswith("@"):
        return spec.encode()
    try:
        return Path(spec[1:]).read_bytes()
    except OSError as exc:
        raise CommandError(f"cannot read the body file {spec[1:]!r}: {exc.strerror}") from exc


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        if args.limit < 1:
            raise CommandError("--limit must be at least 1")
        page = run_on_store(_list(args))
        if args.json:
            print_json({"keys": page.rows, "cursor": page.cursor})
        else:
            print_table(page.rows, _LIST_COLUMNS)
            if page.cursor:
                print(f"more: --cursor {shlex.quote(page.cursor)}")
        return 0
    if args.action == "show":
        record = run_on_store(_show(args))
        history = run_on_store(_history(args))
        if record is None:
            return _show_gone(args, history)
        fields = key_fields(record)
        if args.json:
            print_json({**fields, "history": history})
        else:
            print_fields(fields)
            print()
            print_table(history, _HISTORY_COLUMNS)
        return 0

    answer: StoredResponse | None = None
    if args.completed:
        if args.status is None or not 100 <= args.status <= 599:
            raise CommandError("--completed needs --status N, an HTTP status from 100 to 599")
        answer = stored_answer(args.status, _read_body(args.body), args.content_type)
    elif args.status is not None or args.body:
        raise CommandError("--status and --body go with --completed, not --release")
    done = run_on_store(_resolve(args, answer))
    result = done.result
    if result is ResolveResult.NOT_FOUND:
        raise CommandError(f"no key {args.key!r} for tenant {args.tenant!r}")
    if result is ResolveResult.NOT_UNKNOWN:
        raise CommandError(
            f"key {args.key!r} is completed: there is nothing to release or record; left as it is"
        )
    if result is ResolveResult.BLOCKED:
        what = "released" if answer is None else "resolved"
        raise CommandError(f"key {args.key!r} not {what}: {refusal(done)}")
    forced = " (forced: the release rule was skipped)" if done.forced else ""
    print(f"key {args.key!r} (tenant {args.tenant!r}) {result.value}{forced}")
    return 0
