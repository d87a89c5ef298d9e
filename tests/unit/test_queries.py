"""Every named query a driver runs exists in its store's query files: a typo fails here, not
on the first request that needs the statement."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fencegate.store.queries import StoreKind, parse_queries, queries

PACKAGE = Path(__file__).resolve().parents[2] / "fencegate"

# Each driver, the store whose queries it runs, and how it names its Queries object.
DRIVERS: list[tuple[str, StoreKind, str]] = [
    ("store/postgres.py", "postgresql", "Q"),
    ("store/sqlite.py", "sqlite", "Q"),
    ("lease/drivers/postgres.py", "postgresql", "Q"),
    ("lease/drivers/sqlite.py", "sqlite", "Q"),
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
