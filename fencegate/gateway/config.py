"""Gateway configuration: `FENCEGATE_*` environment variables, command-line options and an
optional TOML file with a ``[gateway]`` table and ``[[routes]]``.

Precedence, highest first: command line, environment, the file's ``[gateway]`` table,
defaults. A bad value is refused at start with the field and the reason.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fencegate.gateway.routes import DEFAULT_KEY_METHODS, EntityRule, RoutePolicy

DAY = 24 * 3600.0


class Route(BaseModel):
    """One ``[[routes]]`` entry: the policy for every path under ``prefix``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefix: str = "/"
    upstream: str | None = None  # default: the gateway's --upstream
    methods: list[str] = Field(default_factory=lambda: sorted(DEFAULT_KEY_METHODS))
    key_required: bool = True
    fence_required: bool = False
    entity: str = "header"
    # None: the gateway-wide setting (upstream_timeout, max_body_bytes, key_ttl_seconds)
    timeout: float | None = Field(default=None, gt=0)
    stored_statuses: list[int] | None = None
    store_5xx: bool = False
    on_unknown: Literal["retry", "reject"] = "reject"
    allow_encoded_slashes: bool = False
    max_body_bytes: int | None = Field(default=None, gt=0)
    max_stored_body_bytes: int = Field(default=1024 * 1024, ge=0)
    key_ttl_seconds: float | None = Field(default=None, gt=0)

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with '/'")
        return value

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, value: str | None) -> str | None:
        if value is not None:
            check_upstream(value)
        return value

    @field_validator("methods")
    @classmethod
    def _methods(cls, value: list[str]) -> list[str]:
        methods = [m.upper() for m in value]
        for method in methods:
            if not method.isalpha():
                raise ValueError(f"{method!r} is not an HTTP method")
        return methods

    @field_validator("entity")
    @classmethod
    def _entity(cls, value: str) -> str:
        EntityRule(value)  # raises ValueError with the reason
        return value

    @field_validator("stored_statuses")
    @classmethod
    def _statuses(cls, value: list[int] | None) -> list[int] | None:
        for status in value or []:
            if not 100 <= status <= 599:
                raise ValueError(f"{status} is not an HTTP status")
        return value

    def policy(self, settings: GatewaySettings) -> RoutePolicy:
        return RoutePolicy(
            prefix=self.prefix,
            upstream=(self.upstream or settings.upstream or "").rstrip("/") or None,
            key_methods=frozenset(self.methods),
            key_required=self.key_required,
            fence_required=self.fence_required,
            entity=EntityRule(self.entity),
            timeout=self.timeout or settings.upstream_timeout,
            stored_statuses=frozenset(self.stored_statuses)
            if self.stored_statuses is not None
            else None,
            store_5xx=self.store_5xx,
            on_unknown=self.on_unknown,
            allow_encoded_slashes=self.allow_encoded_slashes,
            max_body_bytes=self.max_body_bytes or settings.max_body_bytes,
            max_stored_body_bytes=self.max_stored_body_bytes,
            key_ttl_seconds=self.key_ttl_seconds or settings.key_ttl_seconds,
        )


def check_upstream(value: str) -> None:
    if not value.startswith(("http://", "https://")):
        raise ValueError("must be an http:// or https:// URL")


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FENCEGATE_", extra="ignore")

    upstream: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    database_url: str | None = None
    config: Path | None = None
    keys: str | None = None
    migrate: bool | None = None  # None: SQLite yes, PostgreSQL no
    key_ttl_seconds: float = Field(default=DAY, gt=0)
    fence_ttl_seconds: float = Field(default=30 * DAY, gt=0)
    inflight_lease_seconds: float = Field(default=30.0, gt=0)
    purge_interval_seconds: float = Field(default=300.0, ge=0)  # 0: no periodic purge
    max_body_bytes: int = Field(default=10 * 1024 * 1024, gt=0)
    upstream_timeout: float = Field(default=30.0, gt=0)
    store_timeout: float = Field(default=2.0, gt=0)
    store_pool_size: int = Field(default=20, gt=0)
    # On SIGTERM, how long to keep trying to record answers the store has not taken yet.
    shutdown_grace_seconds: float = Field(default=10.0, ge=0)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    workers: int = Field(default=1, ge=1)

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, value: str | None) -> str | None:
        if value is not None:
            check_upstream(value)
        return value


class ConfigError(ValueError):
    """A refused configuration; the message names the field and the reason."""


class GatewayConfig(BaseModel):
    """Settings plus routes, ready to build a gateway from."""

    settings: GatewaySettings
    routes: list[Route] = Field(default_factory=list)
    keys_table: dict[str, Any] | list[Any] | None = None

    def policies(self) -> list[RoutePolicy]:
        return [r.policy(self.settings) for r in self.routes]

    def default_policy(self) -> RoutePolicy:
        """The policy for paths under no configured route."""
        return Route().policy(self.settings)

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


def describe(exc: ValidationError, *, prefix: str = "") -> str:
    """``routes[0].on_unknown: Input should be 'retry' or 'reject'``, one per error."""
    parts = []
    for error in exc.errors():
        where = prefix
        for loc in error["loc"]:
            if isinstance(loc, int):
                where += f"[{loc}]"
            else:
                where += f".{loc}" if where else str(loc)
        message = error["msg"].removeprefix("Value error, ")
        parts.append(f"{where or 'config'}: {message}")
    return "; ".join(parts)


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
        raise ConfigError(f"{path}: {describe(exc)}") from exc

    explicit = {name: getattr(settings, name) for name in settings.model_fields_set}
    unknown = set(file.gateway) - set(GatewaySettings.model_fields)
    if unknown:
        raise ConfigError(f"{path}: gateway.{sorted(unknown)[0]}: Extra inputs are not permitted")
    try:
        settings = GatewaySettings(**{**file.gateway, **explicit})
    except ValidationError as exc:
        raise ConfigError(f"{path}: {describe(exc, prefix='gateway')}") from exc
    routes: list[Route] = []
    for index, entry in enumerate(file.routes):
        try:
            routes.append(Route.model_validate(entry))
        except ValidationError as exc:
            raise ConfigError(f"{path}: {describe(exc, prefix=f'routes[{index}]')}") from exc
    config = GatewayConfig(settings=settings, routes=routes, keys_table=file.keys)
    missing = [r.prefix for r in routes if r.upstream is None and settings.upstream is None]
    if missing:
        raise ConfigError(
            f"{path}: routes with prefix {missing[0]!r} has no upstream and no --upstream is given"
        )
    return config
