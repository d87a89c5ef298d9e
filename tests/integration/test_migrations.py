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


async def test_postgres_indexed_names_compare_bytewise(pg_url: str) -> None:
    """Every name an index of fencegate's holds (tenants, keys, entities, kinds, nonces...)
    is COLLATE "C": under a linguistic database default (en_US.UTF-8) each index search and
    insertion on it would call strcoll. Only the migrations' own bookkeeping keeps the
    database's collation."""
    conn = await asyncpg.connect(pg_url)
    try:
        rows = await conn.fetch(
            """
            SELECT DISTINCT t.relname AS "table", a.attname AS "column",
                   a.attcollation::regcollation::text AS collation
              FROM pg_index AS x
              JOIN pg_class AS t ON t.oid = x.indrelid
              JOIN pg_attribute AS a ON a.attrelid = t.oid AND a.attnum = ANY(x.indkey)
             WHERE t.relname LIKE 'fencegate\\_%' AND t.relname <> 'fencegate_migrations'
               AND a.atttypid = 'text'::regtype
             ORDER BY 1, 2
            """
        )
    finally:
        await conn.close()
    indexed = {(r["table"], r["column"]): r["collation"] for r in rows}
    assert ("fencegate_idempotency_keys", "key") in indexed  # the query reads what it should
    assert {name: c for name, c in indexed.items() if c != '"C"'} == {}
