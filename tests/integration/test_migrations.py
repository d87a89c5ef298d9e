import asyncpg
import pytest

from fencegate.store.dburl import parse_database_url
from fencegate.store.migrations import migrate, split_sqlite_statements


async def test_migrate_is_idempotent(store_url: str) -> None:
    assert await migrate(store_url) == []


def test_split_sqlite_statements_keeps_trigger_bodies() -> None:
    script = """
    CREATE TABLE a (x INTEGER);
    -- a comment
    CREATE TRIGGER t AFTER INSERT ON a BEGIN
        UPDATE a SET x = x + 1;
    END;
    """
    statements = split_sqlite_statements(script)
    assert len(statements) == 2
    assert statements[1].endswith("END;")


@pytest.mark.parametrize("url", ["mysql://x", "sqlite://", "sqlite:///:memory:", "http://x"])
def test_bad_database_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError):
        parse_database_url(url)


async def test_postgres_records_applied_files(pg_url: str) -> None:
    conn = await asyncpg.connect(pg_url)
    try:
        names = [r["name"] for r in await conn.fetch("SELECT name FROM fencegate_migrations")]
    finally:
        await conn.close()
    assert names == sorted(names)
