"""Named queries, loaded from the ``.sql`` files under ``sql/<store>/queries/``.

As in Procrastinate's ``queries.sql``, each query is introduced by a ``-- name: NAME`` line;
the lines after it, up to the next marker, are its text (comments included). A driver only
runs these by name: no SQL is written in Python, and a reviewer reads each statement whole.
"""

from __future__ import annotations

import functools
import re
from typing import Literal

from fencegate.store.sqlfiles import store_folder

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
    folder = store_folder(kind).joinpath("queries")
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
    """Attribute access to one store's queries: ``q.release`` is the ``release`` query. That
    every ``Q.name`` a driver uses exists is checked by a unit test over the drivers' source,
    so a typo fails the build, not the first request."""

    def __init__(self, kind: StoreKind) -> None:
        self.kind = kind
        self._queries = queries(kind)

    def __getattr__(self, name: str) -> str:
        try:
            return self._queries[name]
        except KeyError:
            raise AttributeError(f"no {self.kind} query named {name!r}") from None
