"""What a store's schema is, as a list of lines to compare: two databases built different
ways (a fresh migrate, an upgrade from a release before 1.0) must give the same lines.
Everything a statement can depend on, read from the catalogue; the migrations' bookkeeping
table is left out."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import asyncpg

BOOKKEEPING = "fencegate_migrations"

# Everything a statement can depend on, read from pg_catalog for the current schema; each
# row a tuple of text. Names of system-generated objects (a column's sequence) are kept: the
# dump preserves them.
PG_CATALOGUE = {
    "columns": """
        SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), a.attidentity, a.attgenerated
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace = current_schema()::regnamespace AND c.relname <> $1
          AND c.relkind IN ('r', 'v', 'm', 'p') AND a.attnum > 0 AND NOT a.attisdropped
        ORDER BY c.relname, a.attnum""",
    "relations": """
        SELECT relname, relkind::text, relpersistence::text, reloptions::text
        FROM pg_class WHERE relnamespace = current_schema()::regnamespace AND relname <> $1
          AND relname NOT LIKE $1 || '_%'
        ORDER BY relname""",
    "constraints": """
        SELECT conrelid::regclass::text, conname, contype::text, pg_get_constraintdef(oid)
        FROM pg_constraint WHERE connamespace = current_schema()::regnamespace
          AND conrelid::regclass::text <> $1
        ORDER BY 1, 2""",
    "indexes": """
        SELECT indexname, indexdef FROM pg_indexes
        WHERE schemaname = current_schema() AND tablename <> $1 ORDER BY indexname""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_functiondef(p.oid)
        FROM pg_proc p WHERE p.pronamespace = current_schema()::regnamespace
          AND $1 = $1 ORDER BY 1, 2""",
    "triggers": """
        SELECT tgname, pg_get_triggerdef(t.oid) FROM pg_trigger t
        JOIN pg_class c ON c.oid = t.tgrelid
        WHERE c.relnamespace = current_schema()::regnamespace AND NOT t.tgisinternal
          AND $1 = $1 ORDER BY 1""",
    "sequences": """
        SELECT sequencename, data_type::text, start_value, increment_by, min_value, max_value,
               cycle FROM pg_sequences
        WHERE schemaname = current_schema() AND $1 = $1 ORDER BY 1""",
    "types": """
        SELECT t.typname, t.typtype::text, format_type(t.typbasetype, t.typtypmod),
               (SELECT string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder)
                  FROM pg_enum e WHERE e.enumtypid = t.oid),
               (SELECT string_agg(pg_get_constraintdef(k.oid), ',' ORDER BY k.conname)
                  FROM pg_constraint k WHERE k.contypid = t.oid)
        FROM pg_type t WHERE t.typnamespace = current_schema()::regnamespace
          AND t.typtype IN ('e', 'd') AND $1 = $1 ORDER BY 1""",
    "views": """
        SELECT viewname, definition FROM pg_views
        WHERE schemaname = current_schema() AND $1 = $1 ORDER BY 1""",
}


async def pg_catalogue(url: str) -> list[str]:
    conn = await asyncpg.connect(url)
    try:
        lines = []
        for what, sql in PG_CATALOGUE.items():
            for row in await conn.fetch(sql, BOOKKEEPING):
                lines.append(f"{what}: " + " | ".join(str(v) for v in row))
        return lines
    finally:
        await conn.close()


def sqlite_catalogue(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(
            "SELECT type, name, tbl_name, sql FROM sqlite_master "
            "WHERE name NOT LIKE 'sqlite_%' AND tbl_name != ? ORDER BY type, name",
            (BOOKKEEPING,),
        ).fetchall()
        lines = [" | ".join(" ".join(str(v).split()) for v in row) for row in rows]
        for (table,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name != ? ORDER BY name",
            (BOOKKEEPING,),
        ).fetchall():
            lines += [
                f"{table}: {tuple(c)}" for c in conn.execute(f'PRAGMA table_xinfo("{table}")')
            ]
        return lines
    finally:
        conn.close()
