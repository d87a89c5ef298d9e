"""Every named query a driver runs exists in its store's query files: a typo fails here, not
on the first request that needs the statement."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fencegate.store.dburl import StoreKind
from fencegate.store.queries import parse_queries, queries

PACKAGE = Path(__file__).resolve().parents[2] / "fencegate"

# Each driver, the store whose queries it runs, and how it names its Queries object.
DRIVERS: list[tuple[str, StoreKind, str]] = [
    ("store/postgres.py", "postgresql", "Q"),
    ("store/sqlite.py", "sqlite", "Q"),
    ("lease/drivers/postgres.py", "postgresql", "Q"),
    ("lease/drivers/sqlite.py", "sqlite", "Q"),
    ("store/reconcile.py", "postgresql", "PG"),
    ("store/reconcile.py", "sqlite", "LITE"),
    # What both gateway stores do alike runs each store's queries of the same names.
    ("store/base.py", "postgresql", "self.queries"),
    ("store/base.py", "sqlite", "self.queries"),
    # The reads both lease drivers share run each store's queries of the same names.
    ("lease/drivers/base.py", "postgresql", "self.queries"),
    ("lease/drivers/base.py", "sqlite", "self.queries"),
]


@pytest.mark.parametrize(("module", "kind", "name"), DRIVERS)
def test_every_query_a_driver_runs_is_defined(module: str, kind: StoreKind, name: str) -> None:
    source = (PACKAGE / module).read_text(encoding="utf-8")
    used = set(re.findall(rf"\b{re.escape(name)}\.([a-z_][a-z0-9_]*)\b", source))
    assert used, f"{module} runs no named query?"
    missing = sorted(used - set(queries(kind)))
    assert not missing, f"{module}: no {kind} queries named {missing}"


@pytest.mark.parametrize("kind", ["postgresql", "sqlite"])
def test_the_inspector_runs_only_defined_queries(kind: StoreKind) -> None:
    source = (PACKAGE / "store/inspect.py").read_text(encoding="utf-8")
    used = set(re.findall(r'_(?:rows|value|execute)\(\s*"([a-z_]+)"', source))
    used |= set(re.findall(r'\(\s*"([a-z_]+)",\s*\(', source))  # (name, args) steps
    assert used and not sorted(used - set(queries(kind)))


def test_a_name_given_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="defined twice"):
        parse_queries("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;\n")


TEMPLATE = """
-- template: pick
-- The one statement.
SELECT id FROM jobs WHERE /* TEMPLATE: kinds */ ORDER BY id;

-- name: pick_one from pick
-- A comment is allowed here.
-- kinds: kind = $1

-- name: pick_any from pick
-- kinds: $1::text IS NULL
"""


def test_a_template_expands_into_each_variant() -> None:
    parsed = parse_queries(TEMPLATE)
    assert sorted(parsed) == ["pick_any", "pick_one"]  # the template itself is not a query
    assert parsed["pick_one"].endswith("SELECT id FROM jobs WHERE kind = $1 ORDER BY id;")
    assert "WHERE $1::text IS NULL ORDER BY" in parsed["pick_any"]
    assert "TEMPLATE" not in parsed["pick_one"] + parsed["pick_any"]


@pytest.mark.parametrize(
    ("variant", "error"),
    [
        ("-- name: pick_two from pick\n-- kind: kind = $1\n", "fills \\['kind'\\]"),
        ("-- name: pick_two from pick\n-- kinds: a\n-- other: b\n", "its template has"),
        ("-- name: pick_two from pick\nkind = $1\n", "fills no slot"),
        ("-- name: pick_two from nowhere\n-- kinds: a\n", "not a template above it"),
    ],
)
def test_a_variant_that_does_not_fit_its_template_is_refused(variant: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_queries(TEMPLATE + variant)


@pytest.mark.parametrize("kind", ["postgresql", "sqlite"])
def test_no_loaded_query_keeps_an_unfilled_slot(kind: StoreKind) -> None:
    assert not [name for name, sql in queries(kind).items() if "TEMPLATE:" in sql]
