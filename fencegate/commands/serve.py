"""`fencegate serve`: the gateway in front of an upstream HTTP API, run by uvicorn.

Every option also reads ``FENCEGATE_<OPTION>`` from the environment (command line wins), and
``--config routes.toml`` may add a ``[gateway]`` table and ``[[routes]]``. The embedded
SQLite store is migrated on start; a PostgreSQL store only with ``--migrate`` (or
``fencegate migrate`` beforehand), since its schema is the operator's to change.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import shutil
import socket
import tempfile
from typing import Any

import orjson

from fencegate.errors import CommandError
from fencegate.gateway.config import ConfigError, GatewayConfig, load_config
from fencegate.gateway.metrics import MULTIPROC_ENV
from fencegate.store.dburl import StoreKind
from fencegate.types import Authenticator

OVERRIDES_ENV = "FENCEGATE_SERVE_OVERRIDES"

# (option, settings field, type, help)
_OPTIONS: list[tuple[str, str, type, str]] = [
    ("--upstream", "upstream", str, "base URL to forward to, e.g. http://127.0.0.1:9000"),
    ("--host", "host", str, "address to listen on (default 127.0.0.1)"),
    ("--port", "port", int, "port to listen on (default 8080)"),
    ("--database-url", "database_url", str, "postgresql://… or sqlite:///path.db"),
    ("--config", "config", str, "TOML file with a [gateway] table and [[routes]]"),
    ("--keys", "keys", str, "signature keys for step 1 (see the signatures documentation)"),
    ("--inflight-lease-seconds", "inflight_lease_seconds", float, "in-flight lease (30)"),
    ("--key-ttl-seconds", "key_ttl_seconds", float, "how long keys are kept (86400)"),
    ("--fence-ttl-seconds", "fence_ttl_seconds", float, "idle fences kept (2592000)"),
    ("--purge-interval-seconds", "purge_interval_seconds", float, "0 for none (300)"),
    ("--max-body-bytes", "max_body_bytes", int, "largest request body (10485760)"),
    ("--upstream-timeout", "upstream_timeout", float, "seconds for the upstream (30)"),
    ("--store-timeout", "store_timeout", float, "seconds for the store, then 503 (2)"),
    (
        "--shutdown-grace-seconds",
        "shutdown_grace_seconds",
        float,
        "on SIGTERM, how long to keep recording answers the store has not taken (10)",
    ),
    (
        "--gateway-heartbeat",
        "gateway_heartbeat",
        float,
        "seconds between this process's heartbeats in the store's gateway registry; it counts "
        "as alive for three (2)",
    ),
    (
        "--release-margin",
        "release_margin",
        float,
        "seconds a request may still be on its way to the upstream after its lease ended: "
        "keys are released by anyone else (an operator, the reconciler) only after it (30)",
    ),
    (
        "--reconcile-interval",
        "reconcile_interval",
        float,
        "seconds between the reconciler's looks for keys to settle, 0 for none (1)",
    ),
    (
        "--answer-cache",
        "answer_cache",
        int,
        "completed answers kept in memory per process: a replay without a fence is answered "
        "without a round trip, its history row written within 0.2 s; 0 for none (10000)",
    ),
    ("--log-level", "log_level", str, "critical, error, warning, info, debug (info)"),
    ("--log-format", "log_format", str, "text, or json: one object per line on stderr (text)"),
    ("--workers", "workers", int, "worker processes (1)"),
    (
        "--header-timeout",
        "header_timeout",
        float,
        "seconds for a client to send a whole request head, else closed (10)",
    ),
    (
        "--body-timeout",
        "body_timeout",
        float,
        "seconds a request body may go without a byte, else 408 and closed (10)",
    ),
    (
        "--idle-timeout",
        "idle_timeout",
        float,
        "seconds a kept-alive connection may stay idle between requests (5)",
    ),
    (
        "--max-connections",
        "max_connections",
        int,
        "open client connections per worker process, fewer if the open-files limit is "
        "lower (10000)",
    ),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for option, dest, kind, help_text in _OPTIONS:
        env = "FENCEGATE_" + dest.upper()
        parser.add_argument(
            option, dest=dest, type=kind, default=None, help=f"{help_text}; env {env}"
        )
    parser.add_argument(
        "--migrate",
        dest="migrate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the SQL migrations on start (default: yes for SQLite, no for PostgreSQL); "
        "env FENCEGATE_MIGRATE",
    )
    parser.add_argument(
        "--decision-history",
        dest="decision_history",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep one history row per decision, written in the decision's own transaction "
        "(default: yes); env FENCEGATE_DECISION_HISTORY",
    )
    parser.add_argument(
        "--require-synchronous-replication",
        dest="require_synchronous_replication",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="refuse to start on a PostgreSQL whose standbys replicate asynchronously (a "
        "failover would lose acknowledged decisions; default: one warning line); "
        "env FENCEGATE_REQUIRE_SYNCHRONOUS_REPLICATION",
    )
    parser.add_argument(
        "--decision-log",
        dest="decision_log",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="log one line per decision on the fencegate.decisions logger (default: yes); "
        "env FENCEGATE_DECISION_LOG",
    )


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["migrate", "decision_history", "decision_log", "require_synchronous_replication"]
    names = [dest for _, dest, _, _ in _OPTIONS] + flags
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def build_config(overrides: dict[str, Any]) -> GatewayConfig:
    try:
        config = load_config(overrides)
    except ConfigError as exc:
        raise CommandError(str(exc)) from exc
    if config.settings.upstream is None:
        raise CommandError("no upstream: give --upstream URL (or FENCEGATE_UPSTREAM)")
    return config


def configure_logging(config: GatewayConfig) -> None:
    from fencegate.gateway.logs import configure_logging as configure

    configure(
        config.settings.log_level,
        config.settings.log_format,
        decision_log=config.settings.decision_log,
    )


def apply_connection_limits(config: GatewayConfig) -> int:
    """Raise the open-files limit as far as allowed and set the connection guard's limits
    for this process; the connection limit in force."""
    from fencegate.gateway import connections

    settings = config.settings
    most = connections.connections_within(
        connections.raise_open_files_limit(),
        wanted=settings.max_connections,
        store_pool=settings.store_pool_size,
    )
    connections.configure(
        connections.ConnectionLimits(
            header_timeout=settings.header_timeout,
            idle_timeout=settings.idle_timeout,
            body_timeout=settings.body_timeout,
            max_connections=most,
        )
    )
    return most


def create_app_from_environment() -> Any:
    """Factory for worker processes (``--workers N``): each rebuilds the same config."""
    from fencegate.gateway.app import GatewayApplication

    overrides = orjson.loads(os.environ.get(OVERRIDES_ENV, "{}"))
    config = build_config(overrides)
    configure_logging(config)
    apply_connection_limits(config)
    return GatewayApplication(
        config, authenticator=check_authenticator(config), authenticator_loaded=True
    )


def check_authenticator(config: GatewayConfig) -> Authenticator | None:
    """Load the signature keys before serving, so a bad key file stops the start with
    one clear line instead of a failed worker."""
    from fencegate.gateway.app import load_authenticator

    try:
        return load_authenticator(config.authenticator_spec(), base_dir=config.base_dir())
    except (ValueError, OSError) as exc:
        raise CommandError(str(exc)) from exc


def check_store(config: GatewayConfig) -> StoreKind:
    """Open the store (migrating it when asked) and check its schema before serving, so a
    database nobody migrated stops the start with one line naming `fencegate migrate`.
    Returns the store's kind."""
    from fencegate.store import open_gateway_store
    from fencegate.store.dburl import redacted
    from fencegate.store.replication import ReplicationNotSynchronous
    from fencegate.store.schema import SchemaMismatch, require_schema

    settings = config.settings

    async def check() -> StoreKind:
        store = await open_gateway_store(
            settings.database_url,
            run_migrations=settings.migrate,
            pool_max_size=1,
            require_synchronous_replication=settings.require_synchronous_replication,
        )
        try:
            await require_schema(
                store, database_url=settings.database_url, timeout=settings.store_timeout
            )
            return store.kind
        finally:
            await store.close()

    try:
        return asyncio.run(check())
    except (SchemaMismatch, ReplicationNotSynchronous) as exc:
        raise CommandError(str(exc)) from exc
    except ValueError as exc:  # the URL itself: its message says what is wrong
        raise CommandError(str(exc)) from None
    except Exception as exc:
        raise CommandError(
            f"cannot open the store {redacted(settings.database_url)}: {type(exc).__name__}: {exc}"
        ) from exc


def check_address(host: str, port: int) -> None:
    """Refuse to start, in one line, when the address cannot be listened on (a port another
    process holds): uvicorn would first run the application's start-up, say "Application
    startup complete", and only then fail to bind. Bound the way uvicorn binds it
    (SO_REUSEADDR), then let go for uvicorn to take."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            held = (
                " (another process is listening there; stop it or give --port)"
                if (exc.errno == errno.EADDRINUSE)
                else ""
            )
            raise CommandError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc}{held}"
            ) from None


def announce(
    config: GatewayConfig, *, signatures: bool, store_kind: StoreKind, max_connections: int
) -> None:
    """One line (or JSON object) at start-up: what this gateway fronts, what it records in,
    and what it demands of each route. The password of the database URL is hidden."""
    from fencegate.gateway.decisions import text_fields
    from fencegate.store.dburl import redacted
    from fencegate.store.schema import schema_version

    settings = config.settings
    policies = config.policies()
    if not any(p.prefix == "/" for p in policies):
        policies.append(config.default_policy())
    routes: list[dict[str, Any]] = [
        {
            "prefix": p.prefix,
            "upstream": p.upstream or settings.upstream,
            "methods": sorted(p.key_methods),
            "on_unknown": p.on_unknown,
            "timeout": p.timeout,
            "error_format": p.error_format,
            "reconcile": p.reconcile.describe() if p.reconcile is not None else None,
            **(
                {"protocol": "mcp", "tools": [tool.name for tool in p.tools]}
                if p.protocol == "mcp"
                else {}
            ),
        }
        for p in policies
    ]
    fields: dict[str, Any] = {
        "event": "gateway_starting",
        "upstreams": sorted({str(r["upstream"]) for r in routes}),
        "store": redacted(settings.database_url),
        "schema_version": schema_version(store_kind),
        "signatures": "on" if signatures else "off",
        "workers": settings.workers,
        "listen": f"{settings.host}:{settings.port}",
        "max_connections": max_connections,
        "header_timeout": settings.header_timeout,
        "body_timeout": settings.body_timeout,
        "idle_timeout": settings.idle_timeout,
    }
    described = "; ".join(
        f"{r['prefix']} methods={','.join(r['methods'])} on_unknown={r['on_unknown']} "
        f"timeout={r['timeout']:g}s error_format={r['error_format']}"
        + (f" reconcile={r['reconcile']!r}" if r["reconcile"] else "")
        + (f" protocol=mcp tools={','.join(r['tools']) or '-'}" if "tools" in r else "")
        for r in routes
    )
    logging.getLogger("fencegate.gateway").info(
        "gateway starting: %s routes: %s",
        text_fields({**fields, "upstreams": ",".join(fields["upstreams"])}, skip=("event",)),
        described,
        extra={"fields": {**fields, "routes": routes}},
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from fencegate.gateway.app import GatewayApplication

    overrides = overrides_from(args)
    config = build_config(overrides)
    settings = config.settings
    configure_logging(config)
    check_address(settings.host, settings.port)
    # The store first: a bad --database-url is the only line printed, not after the keys'.
    store_kind = check_store(config)
    authenticator = check_authenticator(config)
    max_connections = apply_connection_limits(config)
    announce(
        config,
        signatures=authenticator is not None,
        store_kind=store_kind,
        max_connections=max_connections,
    )
    from fencegate.gateway.connections import GuardedHttpToolsProtocol

    common: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "loop": "uvloop",
        # uvicorn's httptools protocol with a header timeout, a connection limit and the
        # raw target kept (fencegate.gateway.connections).
        "http": GuardedHttpToolsProtocol,
        "lifespan": "on",
        "log_level": settings.log_level,
        "access_log": False,  # one log line per request costs more than the decision
        "server_header": False,
        "date_header": False,
    }
    if settings.log_format == "json":
        # uvicorn's own records go to the root handler too, so every line is JSON.
        common["log_config"] = None
    if settings.workers > 1:
        os.environ[OVERRIDES_ENV] = orjson.dumps(overrides, default=str).decode()
        # Workers are spawned, so they import prometheus_client with this set and write
        # their values where /metrics in any of them sums them up. Private to this run,
        # and gone with it: counters from another run must never be added in.
        metrics_dir = tempfile.mkdtemp(prefix="fencegate-metrics-")
        os.environ[MULTIPROC_ENV] = metrics_dir
        try:
            uvicorn.run(
                "fencegate.commands.serve:create_app_from_environment",
                factory=True,
                workers=settings.workers,
                **common,
            )
        finally:
            shutil.rmtree(metrics_dir, ignore_errors=True)
            del os.environ[MULTIPROC_ENV]
    else:
        uvicorn.run(
            GatewayApplication(config, authenticator=authenticator, authenticator_loaded=True),
            **common,
        )
    return 0
