"""Only ``NNN_what.sql`` files are migrations: the current schema beside them is not one."""

from __future__ import annotations

import pytest

from fencegate.store.dburl import StoreKind
from fencegate.store.migrations import migration_files
from fencegate.store.schema_dump import schema_path


@pytest.mark.parametrize("kind", ["postgresql", "sqlite"])
def test_schema_file_is_not_a_migration(kind: StoreKind) -> None:
    assert schema_path(kind).is_file()
    names = [name for name, _ in migration_files(kind)]
    assert "schema.sql" not in names
    assert names == sorted(names) and names[0].startswith("001_")
