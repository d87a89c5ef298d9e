"""`fencegate console`: the operator's web console, behind a token.

It reads through the same `Inspector` as ``fencegate keys|jobs|trace`` and acts through the
same code (every action confirmed first, and audited under the token's name). Without any
token configured it does not start: an open console would let anyone resolve keys.
"""

from __future__ import annotations

import argparse
import os

from fencegate.commands.existing_store import require_existing_store
from fencegate.commands.migrate import add_database_url, run_on_store
from fencegate.commands.output import add_release_margin
from fencegate.console.auth import TokenConfigError, load_tokens
from fencegate.errors import CommandError
from fencegate.store.inspect import Inspector


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_database_url(parser)
    parser.add_argument(
        "--host",
        default=os.environ.get("FENCEGATE_CONSOLE_HOST", "127.0.0.1"),
        help="address to listen on (default 127.0.0.1, this host only; 0.0.0.0 for every "
        "interface, e.g. in a container; env FENCEGATE_CONSOLE_HOST)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("FENCEGATE_CONSOLE_PORT", "8090")),
        help="port to listen on (default 8090; env FENCEGATE_CONSOLE_PORT)",
    )
    parser.add_argument(
        "--tokens",
        default=os.environ.get("FENCEGATE_CONSOLE_TOKENS_FILE"),
        help="TOML file of [[tokens]] (name, token or token_sha256, role, tenant); "
        "else the document in env FENCEGATE_CONSOLE_TOKENS",
    )
    parser.add_argument(
        "--show-payloads",
        action="store_true",
        help="show jobs' payloads and results (hidden by default: they may hold customer data)",
    )
    parser.add_argument(
        "--refresh-seconds", type=int, default=15, help="read pages reload this often (0: never)"
    )
    add_release_margin(parser)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds for the store")


async def _check_store(url: str | None, timeout: float) -> None:
    """Fail at start, not on the first page: the store answers and has the operator schema."""
    inspector = await Inspector.open(url, timeout=timeout)
    try:
        await inspector.now(timeout=timeout)
        await inspector.audit_log(limit=1, timeout=timeout)
    finally:
        await inspector.close()


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from fencegate.console import create_console_app

    try:
        tokens = load_tokens(args.tokens, os.environ)
    except TokenConfigError as exc:
        raise CommandError(str(exc)) from None
    # After the tokens (no token, no console), before anything opens the store: a missing
    # store is named, never created.
    require_existing_store(args.database_url, timeout=args.timeout)
    try:
        run_on_store(_check_store(args.database_url, args.timeout))
    except CommandError as exc:
        raise CommandError(f"{exc} (is the store migrated? run `fencegate migrate`)") from None
    app = create_console_app(
        args.database_url,
        tokens=tokens,
        show_payloads=args.show_payloads,
        refresh_seconds=args.refresh_seconds,
        release_margin=args.release_margin,
        timeout=args.timeout,
    )
    print(f"fencegate console on http://{args.host}:{args.port}/ ({len(tokens)} tokens)",
          flush=True)  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", server_header=False)
    return 0
