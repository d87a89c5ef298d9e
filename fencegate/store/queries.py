"""Named queries, loaded from the ``.sql`` files under ``sql/<store>/queries/``.

As in Procrastinate's ``queries.sql``, each query is introduced by a ``-- name: NAME`` line;
the lines after it, up to the next marker, are its text (comments included). A driver only
runs these by name: no SQL is written in Python, and a reviewer reads each statement whole.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Literal

StoreKind = Literal["postgresql", "sqlite"]

_MARKER = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def parse_queries(text: str, *, source: str = "<sql>") -> dict[str, str]:
    """``{name: sql}`` from one file's text; a name given twice is an error."""
    queries: dict[str, str] = {}
    markers = list(_MARKER.finditer(text))
    for index, marker in enumerate(markers):
        end = markers[index + 1].start() if index + 1 < len(markers) else len(text)
        name = marker.group(1)
        if name in queries:
            raise ValueError(f"{source}: query {name!r} is defined twice")
        body = text[marker.end() : end].strip()
        if not body:
            raise ValueError(f"{source}: query {name!r} is empty")
        queries[name] = body
    return queries


@functools.cache
def queries(kind: StoreKind) -> dict[str, str]:
    """Every named query of one store, from all of its query files."""
    folder = resources.files("fencegate.sql").joinpath(
        "postgres" if kind == "postgresql" else "sqlite", "queries"
    )
    found: dict[str, str] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        text = entry.read_text(encoding="utf-8")
        for name, sql in parse_queries(text, source=entry.name).items():
            if name in found:
                raise ValueError(f"{entry.name}: query {name!r} is also defined in another file")
            found[name] = sql
    return found


class Queries:
    """Attribute access to one store's queries: ``q.release`` is the ``release`` query. A
    missing name fails when the driver is built, not when the statement first runs."""

    def __init__(self, kind: StoreKind, *names: str) -> None:
        available = queries(kind)
        missing = [name for name in names if name not in available]
        if missing:
            raise LookupError(f"no {kind} queries named {', '.join(missing)}")
        self._queries = {name: available[name] for name in names}

    def __getattr__(self, name: str) -> str:
        try:
            return self._queries[name]
        except KeyError:
            raise AttributeError(f"query {name!r} was not declared for this driver") from None
