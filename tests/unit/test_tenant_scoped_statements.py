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

TENANT_TABLES = (
    "fencegate_idempotency_keys",
    "fencegate_fences",
    "fencegate_decisions",
    "fencegate_signature_nonces",
)
# The functions a gateway calls on a tenant's rows (distributed on their tenant on Citus).
TENANT_FUNCTIONS = (
    "fencegate_step",
    "fencegate_renew",
    "fencegate_remember_nonce",
    "fencegate_release",
    "fencegate_mark_unknown",
)

# Statements meant to span tenants: maintenance by expiry time, not a request's decision;
# and the reconciler's poll for due keys (it settles each by its tenant and key): its claim
# spans tenants on one PostgreSQL and names one on Citus, after a read of which tenants have
# due keys (no row locks, so Citus may run it on every shard).
SPANS_TENANTS = {
    "purge_keys",
    "purge_fences",
    "purge_nonces",
    "purge_decisions",
    "reconcile_claim",
    "reconcile_due_tenants",
}


def touched_tables(sql: str) -> set[str]:
    return {t for t in TENANT_TABLES if re.search(rf"\b{t}\b", sql)}


def tenant_filtered(statement: str) -> bool:
    """Each WHERE of the statement names a tenant (``tenant = …``) and each INSERT writes
    one; an INSERT … SELECT from a CTE that was itself filtered carries the tenant on. An
    upsert's DO UPDATE acts on the row its conflict target (which holds the tenant) found."""
    # The owner gateway's registration, read for the release rule: the registry is not a
    # tenant's (a reference table on Citus, a copy on every node).
    statement = re.sub(
        r"\(SELECT g\.alive_until FROM fencegate_gateways g\s+WHERE g\.instance = "
        r"split_part\([^)]*\)\)",
        "(owner_alive_until)",
        statement,
    )
    statement = statement.partition("ON CONFLICT (tenant")[0]
    if "ON CONFLICT" in statement:
        return False  # a conflict target without the tenant
    wheres = re.findall(
        r"\bWHERE\b(.*?)(?=\bWHERE\b|\bRETURNING\b|\)\s*,|\)\s*SELECT|$)",
        statement,
        flags=re.S | re.I,
    )
    for where in wheres:
        if re.search(r"\$\d+::boolean|^\s*\$\d+\s*$|^\s*NOT\s", where.strip()):
            continue  # a switch (history kept or not), not a row filter
        if not re.search(r"\b\w*\.?tenant\s*=", where):
            return False
    for insert in re.findall(r"INSERT INTO\s+\w+(?:\s+AS\s+\w+)?\s*\(([^)]*)\)", statement):
        if "tenant" not in insert:
            return False
    return True


def function_statements(function: str) -> list[str]:
    """The SQL statements in the body of one function (its one file)."""
    [sql] = [sql for record, sql in function_files("postgresql") if f"/{function}.sql@" in record]
    body = sql.split("$$")[1]
    statements = re.split(r";\s*\n", body)
    return [
        s
        for s in statements
        if touched_tables(s) and re.search(r"\b(SELECT|UPDATE|DELETE|INSERT)\b", s)
    ]


def test_every_gateway_statement_on_tenant_rows_filters_on_the_tenant() -> None:
    gateway = {name: sql for name, sql in queries("postgresql").items() if touched_tables(sql)}
    assert {"get_key", "resolve_completed", "resolve_released"} <= set(gateway)
    unfiltered = [
        name
        for name, sql in gateway.items()
        if name not in SPANS_TENANTS and not tenant_filtered(sql)
    ]
    assert unfiltered == []


def test_every_statement_of_the_step_function_filters_on_the_tenant() -> None:
    statements = function_statements("fencegate_step")
    assert len(statements) >= 5
    unfiltered = [s.strip()[:120] for s in statements if not tenant_filtered(s)]
    assert unfiltered == []


def test_the_renew_and_nonce_functions_filter_on_the_tenant() -> None:
    for function in TENANT_FUNCTIONS[1:]:
        statements = function_statements(function)
        assert statements, function
        unfiltered = [s.strip()[:120] for s in statements if not tenant_filtered(s)]
        assert unfiltered == [], function
