"""The backend layer (`fencegate.store.backends`): the one place a URL's kind chooses a
backend, and where a driver's errors become fencegate's, naming the store."""

from __future__ import annotations

from pathlib import Path

import pytest

from fencegate.errors import StoreUnavailable
from fencegate.store.backends import applied_migrations_read_only
from fencegate.store.dburl import parse_database_url


async def test_a_file_that_is_no_database_is_unavailable_and_named(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_bytes(b"not a database, " * 256)
    with pytest.raises(StoreUnavailable, match="cannot read the SQLite store") as caught:
        await applied_migrations_read_only(parse_database_url(f"sqlite:///{path}"), timeout=5)
    assert str(path.resolve()) in str(caught.value)


async def test_a_refused_connection_is_unavailable_and_named() -> None:
    target = parse_database_url("postgresql://fencegate@127.0.0.1:1/nothing")
    with pytest.raises(StoreUnavailable, match=r"cannot read PostgreSQL at .*127\.0\.0\.1:1"):
        await applied_migrations_read_only(target, timeout=5)
