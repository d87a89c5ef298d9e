"""Every gateway statement on a tenant's rows names the tenant, so the tables can be
distributed by tenant (Citus) and each statement routed to one shard: the named statements
of sql/postgres/queries/gateway.sql and every statement in the newest fencegate_step.

The statements that span tenants on purpose are listed, with why (see the capacity model,
docs/operations/capacity.md): expiry purges, run by the gateway's purger and `fencegate purge`,
which a distributed table runs on every shard in parallel."""

from __future__ import annotations

import re

from fencegate.store.migrations import function_files
from fencegate.store.queries import queries

TENANT_TABLES = ("fencegate_idempotency_keys", "fencegate_fences", "fencegate_decisions")

# Statements meant to span tenants: maintenance by expiry time, not a request's decision;
# and the reconciler's poll for due keys (it settles each by its tenant and key).
SPANS_TENANTS = {"purge_keys", "purge_fences", "purge_decisions", "reconcile_claim"}


def touched_tables(sql: str) -> set[str]:
    return {t for t in TENANT_TABLES if re.search(rf"\b{t}\b", sql)}


def tenant_filtered(statement: str) -> bool:
    """Each WHERE of the statement names a tenant (``tenant = …``) and each INSERT writes
    one; an INSERT … SELECT from a CTE that was itself filtered carries the tenant on. An
    upsert's DO UPDATE acts on the row its conflict target (which holds the tenant) found."""
    statement = statement.partition("ON CONFLICT (tenant")[0]
    if "ON CONFLICT" in statement:
        return False  # a conflict target without the tenant
    wheres = re.findall(r"\bWHERE\b(.*?)(?=\bWHERE\b|\bRETURNING\b|\)\s*,|\)\s*SELECT|$)",
                        statement, flags=re.S | re.I)  # fmt: skip
    for where in wheres:
        if re.search(r"\$\d+::boolean|^\s*\$\d+\s*$|^\s*NOT\s", where.strip()):
            continue  # a switch (history kept or not), not a row filter
        if not re.search(r"\b\w*\.?tenant\s*=", where):
            return False
    for insert in re.findall(r"INSERT INTO\s+\w+(?:\s+AS\s+\w+)?\s*\(([^)]*)\)", statement):
        if "tenant" not in insert:
            return False
    return True


def step_statements() -> list[str]:
    """The SQL statements in the body of fencegate_step (its one file)."""
    [step] = [
        sql for record, sql in function_files("postgresql") if "/fencegate_step.sql@" in record
    ]
    body = step.split("$$")[1]
    statements = re.split(r";\s*\n", body)
    return [
        s
        for s in statements
        if touched_tables(s) and re.search(r"\b(SELECT|UPDATE|DELETE|INSERT)\b", s)
    ]


def test_every_gateway_statement_on_tenant_rows_filters_on_the_tenant() -> None:
    gateway = {name: sql for name, sql in queries("postgresql").items() if touched_tables(sql)}
    assert {"release", "mark_unknown", "renew", "get_key"} <= set(gateway)
    unfiltered = [
        name for name, sql in gateway.items()
        if name not in SPANS_TENANTS and not tenant_filtered(sql)
    ]  # fmt: skip
    assert unfiltered == []


def test_every_statement_of_the_step_function_filters_on_the_tenant() -> None:
    statements = step_statements()
    assert len(statements) >= 5
    unfiltered = [s.strip()[:120] for s in statements if not tenant_filtered(s)]
    assert unfiltered == []


def test_a_statement_without_its_tenant_is_caught() -> None:
    sql = queries("postgresql")["renew"]
    assert tenant_filtered(sql)
    assert not tenant_filtered(sql.replace("tenant = $1 AND ", ""))
    assert not tenant_filtered("INSERT INTO fencegate_fences (entity) VALUES ($1)")
