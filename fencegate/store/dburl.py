"""Which store a database URL names: PostgreSQL (asyncpg) or SQLite (standard library).

A PostgreSQL URL may name the schema fencegate's tables live in with ``?schema=NAME``
(default: the server's search path, normally ``public``). fencegate takes that parameter out
of the URL and sets the connections' ``search_path`` instead, so every statement stays
unqualified and one database can hold several fencegate installations.

``?pool_mode=transaction`` says the URL reaches PostgreSQL through a transaction-pooling
connection pooler (PgBouncer's ``pool_mode = transaction``): each call then runs in a
transaction of its own with unnamed statements (no prepared statement outlives the
transaction), settings go in ``SET LOCAL`` instead of start-up parameters, and the lease
queue polls instead of LISTENing. ``pool_mode=session`` (the default) is a direct connection
or a session pooler.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

# The two stores, as every part names them.
StoreKind = Literal["postgresql", "sqlite"]

DEFAULT_SQLITE_URL = "sqlite:///fencegate.db"

# Taken out of the URL before it reaches the driver.
POOL_MODE_OPTION = "pool_mode"
_OWN_PARAMETERS = ("schema", POOL_MODE_OPTION)
_POOL_MODES = ("session", "transaction")

_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


@dataclass(frozen=True)
class DatabaseURL:
    kind: StoreKind
    url: str  # as given
    sqlite_path: Path | None = None
    schema: str | None = None  # PostgreSQL: where the tables live
    # PostgreSQL: reached through a transaction-pooling connection pooler.
    transaction_pooling: bool = False

    @property
    def dsn(self) -> str:
        """The URL for the driver: fencegate's own parameters taken out."""
        if self.kind != "postgresql":
            return self.url
        parts = urlsplit(self.url)
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        query = [(k, v) for k, v in pairs if k not in _OWN_PARAMETERS]
        return urlunsplit(parts._replace(query=urlencode(query)))

    @property
    def where(self) -> str:
        """Hosts and database, without user or password: for messages."""
        parts = urlsplit(self.url)
        return parts.netloc.rpartition("@")[2] + parts.path


def parse_database_url(url: str | None) -> DatabaseURL:
    """Parse ``postgresql://…[?schema=NAME][&pool_mode=transaction]``, ``postgres://…``,
    ``sqlite:///relative.db`` or ``sqlite:////absolute.db``. No URL means the embedded
    default ``./fencegate.db``."""
    url = url or DEFAULT_SQLITE_URL
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("postgresql", "postgres"):
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        schemas = [v for k, v in pairs if k == "schema"]
        schema = schemas[-1] if schemas else None
        if schema is not None and not _SCHEMA_NAME.fullmatch(schema):
            raise ValueError(
                f"schema={schema!r}: a schema name is lower-case letters, digits and _ "
                "(at most 63), not starting with a digit"
            )
        modes = [v for k, v in pairs if k == POOL_MODE_OPTION]
        mode = modes[-1] if modes else "session"
        if mode not in _POOL_MODES:
            raise ValueError(
                f"pool_mode={mode!r}: use pool_mode=transaction behind a transaction-pooling "
                "PgBouncer, pool_mode=session (the default) otherwise"
            )
        return DatabaseURL(
            "postgresql", url, schema=schema, transaction_pooling=mode == "transaction"
        )
    if scheme == "sqlite":
        rest = url[len("sqlite://") :]
        if not rest.startswith("/") or rest == "/":
            raise ValueError(f"SQLite URL needs a path, e.g. sqlite:///fencegate.db (got {url!r})")
        path = rest[1:]
        if path == ":memory:":
            raise ValueError("an in-memory SQLite store cannot be shared; give a file path")
        return DatabaseURL("sqlite", url, Path(path))
    raise ValueError(f"unsupported database URL {url!r}: use postgresql://… or sqlite:///path.db")


def redacted(url: str | None) -> str:
    """A database URL fit for a log line or an error message: no password."""
    if not url:
        return "sqlite:///fencegate.db"
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
