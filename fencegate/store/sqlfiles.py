"""Where the `.sql` files are: the installed package ``fencegate.sql`` (the top-level
``sql/`` directory, mapped at install time), or that directory itself when fencegate runs
from a source checkout (``PYTHONPATH=.``), where no ``fencegate.sql`` package exists."""

from __future__ import annotations

import functools
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from fencegate.store.dburl import StoreKind


@functools.cache
def sql_root() -> Traversable:
    try:
        return resources.files("fencegate.sql")
    except ModuleNotFoundError:
        checkout = Path(__file__).resolve().parent.parent.parent / "sql"
        if not (checkout / "postgres").is_dir():
            raise ModuleNotFoundError(
                "fencegate's SQL files were not found: neither the installed package "
                f"fencegate.sql nor {checkout} (reinstall fencegate)"
            ) from None
        return checkout


def store_folder(kind: StoreKind) -> Traversable:
    """The folder of one store's migrations (its ``queries/`` folder is inside)."""
    return sql_root().joinpath("postgres" if kind == "postgresql" else "sqlite")
