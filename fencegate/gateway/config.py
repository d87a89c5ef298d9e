"""Gateway configuration: `FENCEGATE_*` environment variables, command-line options and an
optional TOML file with a ``[gateway]`` table and ``[[routes]]``.

Precedence, highest first: command line, environment, the file's ``[gateway]`` table,
defaults. A bad value is refused at start with the field and the reason.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fencegate.errors import FencegateError
from fencegate.gateway.answers import DEFAULT_ANSWER_CACHE_SIZE
from fencegate.gateway.routes import RoutePolicy, check_upstream
from fencegate.store.release_rule import DEFAULT_GATEWAY_HEARTBEAT, DEFAULT_RELEASE_MARGIN

DAY = 24 * 3600.0


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FENCEGATE_", extra="ignore")

    upstream: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    database_url: str | None = None
    config: Path | None = None
    keys: str | None = None
    migrate: bool | None = None  # None: SQLite yes, PostgreSQL no
    # One fencegate_decisions row per decision, in the decision's own transaction.
    decision_history: bool = True
    # Completed answers kept in memory per process, replaying requests without a fence
    # without a round trip (least recently used first out; 0: none).
    answer_cache: int = Field(default=DEFAULT_ANSWER_CACHE_SIZE, ge=0)
    # One line per decision on the fencegate.decisions logger (INFO).
    decision_log: bool = True
    key_ttl_seconds: float = Field(default=DAY, gt=0)
    fence_ttl_seconds: float = Field(default=30 * DAY, gt=0)
    inflight_lease_seconds: float = Field(default=30.0, gt=0)
    purge_interval_seconds: float = Field(default=300.0, ge=0)  # 0: no periodic purge
    max_body_bytes: int = Field(default=10 * 1024 * 1024, gt=0)
    upstream_timeout: float = Field(default=30.0, gt=0)
    store_timeout: float = Field(default=2.0, gt=0)
    store_pool_size: int = Field(
        default=20, gt=0, description="the most connections each gateway process keeps to the store"
    )
    # Refuse a PostgreSQL whose standbys all replicate asynchronously (else: one warning).
    require_synchronous_replication: bool = False
    # How often the reconciler looks for keys of reconciling routes to settle (seconds,
    # with jitter); 0: no reconciler in this process.
    reconcile_interval: float = Field(default=1.0, ge=0)
    # On SIGTERM, how long to keep trying to record answers the store has not taken yet.
    shutdown_grace_seconds: float = Field(default=10.0, ge=0)
    # The gateway registry: this process heartbeats its row every gateway_heartbeat seconds
    # (it counts as alive for three of them). The release rule: a request may still be on
    # its way to the upstream release_margin seconds after its gateway's lease ended, so a
    # key is released by anyone else (an operator, the reconciler) only after that.
    gateway_heartbeat: float = Field(default=DEFAULT_GATEWAY_HEARTBEAT, gt=0, le=3600)
    release_margin: float = Field(default=DEFAULT_RELEASE_MARGIN, ge=0, le=DAY)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    # text for people; json: one object per line on stderr, for log pipelines.
    log_format: Literal["text", "json"] = "text"
    workers: int = Field(default=1, ge=1)
    # Connections (`fencegate serve` only): a request head must arrive within header_timeout
    # seconds, a request body may go body_timeout seconds without a byte, a kept-alive
    # connection may stay idle idle_timeout seconds between requests, and each worker
    # process keeps at most max_connections open (fewer if its open-files limit cannot hold
    # them).
    header_timeout: float = Field(default=10.0, gt=0, le=3600)
    body_timeout: float = Field(default=10.0, gt=0, le=3600)
    idle_timeout: float = Field(default=5.0, gt=0, le=3600)
    max_connections: int = Field(default=10_000, gt=0)

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, value: str | None) -> str | None:
        check_upstream(value)
        return value


def route_policy(entry: dict[str, Any], settings: GatewaySettings) -> RoutePolicy:
    """A ``[[routes]]`` table as a `RoutePolicy`: what it leaves out comes from the
    gateway-wide settings (upstream, upstream timeout, body limit, key TTL)."""
    inherited: dict[str, Any] = {
        "upstream": settings.upstream,
        "timeout": settings.upstream_timeout,
        "max_body_bytes": settings.max_body_bytes,
        "key_ttl_seconds": settings.key_ttl_seconds,
    }
    given = {("key_methods" if k == "methods" else k): v for k, v in entry.items()}
    for name, value in inherited.items():
        if given.get(name) is None:
            given[name] = value
    return RoutePolicy(**given)


class ConfigError(FencegateError, ValueError):
    """A refused configuration; the message names the field and the reason."""


class GatewayConfig(BaseModel):
    """Settings plus routes, ready to build a gateway from."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    settings: GatewaySettings
    routes: list[RoutePolicy] = Field(default_factory=list)
    keys_table: dict[str, Any] | list[Any] | None = None

    def policies(self) -> list[RoutePolicy]:
        return list(self.routes)

    def default_policy(self) -> RoutePolicy:
        """The policy for paths under no configured route."""
        return route_policy({}, self.settings)

    def base_dir(self) -> Path | None:
        """Relative paths in the config file are relative to the file."""
        config = self.settings.config
        return config.resolve().parent if config is not None else None

    def authenticator_spec(self) -> str | dict[str, Any] | list[Any] | None:
        return self.settings.keys or self.keys_table


class _ConfigFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gateway: dict[str, Any] = Field(default_factory=dict)
    routes: list[dict[str, Any]] = Field(default_factory=list)
    keys: dict[str, Any] | list[Any] | None = None  # `[keys]` or `[[keys]]`: for the signatures


def describe(exc: ValidationError, *, prefix: str = "", known: Iterable[str] = ()) -> str:
    """``routes[0].on_unknown: Input should be 'retry' or 'reject'``, one per error; a name
    that is not a field gets the closest of ``known`` as a suggestion."""
    parts = []
    for error in exc.errors():
        where = prefix
        for loc in error["loc"]:
            if isinstance(loc, int):
                where += f"[{loc}]"
            else:
                where += f".{loc}" if where else str(loc)
        where = where.replace(".key_methods", ".methods")  # the config file's name for it
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            name = str(error["loc"][-1]) if error["loc"] else ""
            message = unknown_name(name, known)
        parts.append(f"{where or 'config'}: {message}")
    return "; ".join(parts)


def unknown_name(name: str, known: Iterable[str]) -> str:
    """ "Extra inputs are not permitted", and the closest real name when one is close (a typo
    such as ``on_unknwon``)."""
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"Extra inputs are not permitted{hint}"


# The names each table of the config file takes (the file says ``methods`` for key_methods).
def _route_names() -> list[str]:
    fields = RoutePolicy.__pydantic_fields__  # type: ignore[attr-defined]
    return ["methods" if name == "key_methods" else name for name in fields]


def load_config(overrides: dict[str, Any] | None = None) -> GatewayConfig:
    """Read environment, ``overrides`` (the command line) and the config file they name."""
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    try:
        settings = GatewaySettings(**given)
    except ValidationError as exc:
        raise ConfigError(describe(exc)) from exc
    if settings.config is None:
        # Without a file, reading settings once is the whole story.
        return GatewayConfig(settings=settings)

    path = settings.config
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    try:
        file = _ConfigFile.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {describe(exc, known=_ConfigFile.model_fields)}") from exc

    explicit = {name: getattr(settings, name) for name in settings.model_fields_set}
    unknown = set(file.gateway) - set(GatewaySettings.model_fields)
    if unknown:
        name = sorted(unknown)[0]
        hint = unknown_name(name, GatewaySettings.model_fields)
        raise ConfigError(f"{path}: gateway.{name}: {hint}")
    try:
        settings = GatewaySettings(**{**file.gateway, **explicit})
    except ValidationError as exc:
        raise ConfigError(f"{path}: {describe(exc, prefix='gateway')}") from exc
    routes: list[RoutePolicy] = []
    for index, entry in enumerate(file.routes):
        try:
            routes.append(route_policy(entry, settings))
        except ValidationError as exc:
            where = f"routes[{index}]"
            raise ConfigError(
                f"{path}: {describe(exc, prefix=where, known=_route_names())}"
            ) from exc
    config = GatewayConfig(settings=settings, routes=routes, keys_table=file.keys)
    missing = [r.prefix for r in routes if r.upstream is None and settings.upstream is None]
    if missing:
        raise ConfigError(
            f"{path}: routes with prefix {missing[0]!r} has no upstream and no --upstream is given"
        )
    return config
