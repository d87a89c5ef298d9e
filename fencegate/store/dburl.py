"""Which store a database URL names: PostgreSQL (asyncpg) or SQLite (standard library)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

DEFAULT_SQLITE_URL = "sqlite:///fencegate.db"


@dataclass(frozen=True)
class DatabaseURL:
    kind: Literal["postgresql", "sqlite"]
    url: str
    sqlite_path: Path | None = None


def parse_database_url(url: str | None) -> DatabaseURL:
    """Parse ``postgresql://…``, ``postgres://…``, ``sqlite:///relative.db`` or
    ``sqlite:////absolute.db``. No URL means the embedded default ``./fencegate.db``."""
    url = url or DEFAULT_SQLITE_URL
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("postgresql", "postgres"):
        return DatabaseURL("postgresql", url)
    if scheme == "sqlite":
        rest = url[len("sqlite://") :]
        if not rest.startswith("/") or rest == "/":
            raise ValueError(f"SQLite URL needs a path, e.g. sqlite:///fencegate.db (got {url!r})")
        path = rest[1:]
        if path == ":memory:":
            raise ValueError("an in-memory SQLite store cannot be shared; give a file path")
        return DatabaseURL("sqlite", url, Path(path))
    raise ValueError(f"unsupported database URL {url!r}: use postgresql://… or sqlite:///path.db")
