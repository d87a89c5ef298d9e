"""The shape of the SQL files: a baseline first among the versioned migrations, the pre-1.0
files only under legacy/, and each PostgreSQL function in one file of its own, its body
nowhere else."""

from __future__ import annotations

import re

import pytest

from fencegate.store.dburl import StoreKind
from fencegate.store.migrations import (
    BASELINE,
    function_files,
    legacy_files,
    migration_files,
)
from fencegate.store.queries import queries


@pytest.mark.parametrize("kind", ["postgresql", "sqlite"])
def test_the_baseline_comes_first_and_legacy_files_stay_apart(kind: StoreKind) -> None:
    names = [name for name, _ in migration_files(kind)]
    assert names[0] == BASELINE and names == sorted(names)
    legacy = [name for name, _ in legacy_files(kind)]
    assert legacy[0] == "001_gateway.sql" and not set(legacy) & set(names)


def test_each_function_is_created_in_its_own_file_and_nowhere_else() -> None:
    created: dict[str, list[str]] = {}
    sources = [(f"versioned {n}", sql) for n, sql in migration_files("postgresql")]
    sources += [(f"legacy {n}", sql) for n, sql in legacy_files("postgresql")]
    sources += [(f"query {n}", sql) for n, sql in queries("postgresql").items()]
    sources += [(record, sql) for record, sql in function_files("postgresql")]
    for where, sql in sources:
        for name in re.findall(r"CREATE (?:OR REPLACE )?FUNCTION (\w+)", sql):
            created.setdefault(name, []).append(where)
    assert created, "no function found"
    for name, places in created.items():
        assert len(places) == 1 and places[0].startswith(f"functions/{name}.sql@"), (name, places)
