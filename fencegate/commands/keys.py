"""`fencegate keys show|resolve`: look at one idempotency key, and resolve one whose outcome
is unknown.

A key is unknown when the upstream may have acted but its answer was never recorded: the
upstream timed out, or the gateway holding it stopped before recording. The gateway answers
such a key with 424 ``outcome-unknown`` and never forwards it again on its own. The operator
finds out what really happened upstream, then either records that answer (``--completed``:
every retry replays it) or releases the key (``--release``: the next request runs again).
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import os
import socket
import sys
from datetime import UTC, datetime
from pathlib import Path

import orjson

from fencegate.cli import CommandError
from fencegate.commands.migrate import add_database_url, run_on_store
from fencegate.store import (
    KeyRecord,
    ResolveResult,
    StoredResponse,
    open_gateway_store,
)
from fencegate.types import DEFAULT_TENANT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True

    show = actions.add_parser("show", help="one key: state, holder, attempt, times")
    _common(show)
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
    resolve.add_argument(
        "--by",
        default=f"{getpass.getuser()}@{socket.gethostname()}",
        help="who resolves it, kept as the key's owner (default user@host)",
    )


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
        return await store.get_key(args.tenant, args.key, timeout=args.timeout)
    finally:
        await store.close()


async def _resolve(args: argparse.Namespace, answer: StoredResponse | None) -> ResolveResult:
    store = await open_gateway_store(args.database_url, run_migrations=False, pool_max_size=1)
    try:
        return await store.resolve_key(
            args.tenant,
            args.key,
            answer,
            resolved_by=f"operator:{args.by}",
            timeout=args.timeout,
        )
    finally:
        await store.close()


def _when(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds")


def _as_dict(record: KeyRecord) -> dict[str, object]:
    lease_left = (
        round(record.locked_until - record.now, 3)
        if record.state == "in_flight" and record.locked_until is not None
        else None
    )
    return {
        "tenant": record.tenant,
        "key": record.key,
        "state": record.state,
        "outcome_unknown": record.unknown,
        "owner": record.owner,
        "attempt": record.attempt,
        "entity": record.entity,
        "fence": record.fence,
        "fingerprint": record.fingerprint,
        "lease_seconds_left": lease_left,
        "reserved_at": _when(record.reserved_at),
        "created_at": _when(record.created_at),
        "completed_at": _when(record.completed_at),
        "expires_at": _when(record.expires_at),
        "response_status": record.response_status,
    }


def _read_body(spec: str) -> bytes:
    if not spec.startswith("@"):
        return spec.encode()
    try:
        return Path(spec[1:]).read_bytes()
    except OSError as exc:
        raise CommandError(f"cannot read the body file {spec[1:]!r}: {exc.strerror}") from exc


def run(args: argparse.Namespace) -> int:
    if args.action == "show":
        record = run_on_store(_show(args))
        if record is None:
            raise CommandError(f"no key {args.key!r} for tenant {args.tenant!r}")
        fields = _as_dict(record)
        if args.json:
            sys.stdout.write(orjson.dumps(fields).decode() + "\n")
        else:
            width = max(len(name) for name in fields)
            for name, value in fields.items():
                print(f"{name:<{width}}  {'-' if value is None else value}")
        return 0

    answer: StoredResponse | None = None
    if args.completed:
        if args.status is None or not 100 <= args.status <= 599:
            raise CommandError("--completed needs --status N, an HTTP status from 100 to 599")
        body = _read_body(args.body)
        answer = StoredResponse(
            status=args.status,
            headers=[("content-type", args.content_type)],
            body=body,
            sha256=hashlib.sha256(body).hexdigest(),
        )
    elif args.status is not None or args.body:
        raise CommandError("--status and --body go with --completed, not --release")
    result = run_on_store(_resolve(args, answer))
    if result is ResolveResult.NOT_FOUND:
        raise CommandError(f"no key {args.key!r} for tenant {args.tenant!r}")
    if result is ResolveResult.NOT_UNKNOWN:
        raise CommandError(
            f"key {args.key!r} is not in an unknown state (it is completed, or still in "
            "flight under a live lease): left as it is"
        )
    print(f"key {args.key!r} (tenant {args.tenant!r}) {result.value}")
    return 0
