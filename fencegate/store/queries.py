"""Named queries, loaded from the ``.sql`` files under ``sql/<store>/queries/``.

As in Procrastinate's ``queries.sql``, each query is introduced by a ``-- name: NAME`` line;
the lines after it, up to the next marker, are its text (comments included). A driver only
runs these by name: no SQL is written in Python, and a reviewer reads each statement whole.

Statements that differ in one clause are written once, as River's SQL templates are: a
``-- template: NAME`` holds the statement with ``/* TEMPLATE: slot */`` where the clause
goes, and each variant is a query of its own, ``-- name: VARIANT from NAME``, whose body is
one ``-- slot: sql`` line per slot (other lines starting ``--`` are comments). Variants are
expanded when the file is loaded, so a driver runs ``Q.VARIANT`` like any other query.
"""

from __future__ import annotations

import functools
import re

from fencegate.store.dburl import StoreKind
from fencegate.store.sqlfiles import store_folder

_IDENT = r"[a-z_][a-z0-9_]*"
_MARKER = re.compile(
    rf"^--\s*(name|template):\s*({_IDENT})(?:\s+from\s+({_IDENT}))?\s*$", re.MULTILINE
)
_SLOT_USE = re.compile(rf"/\*\s*TEMPLATE:\s*({_IDENT})\s*\*/")
_SLOT_FILL = re.compile(rf"^--\s*({_IDENT}):\s*(.+?)\s*$")


def _fill(template: str, body: str, *, source: str, name: str) -> str:
    """The template's text with each slot replaced by the variant's clause for it."""
    fills: dict[str, str] = {}
    for line in body.splitlines():
        match = _SLOT_FILL.match(line.strip())
        if match is not None:
            fills[match.group(1)] = match.group(2)
        elif not line.strip().startswith("--"):
            raise ValueError(f"{source}: variant {name!r} has a line that fills no slot: {line!r}")
    wanted = set(_SLOT_USE.findall(template))
    if set(fills) != wanted:
        raise ValueError(
            f"{source}: variant {name!r} fills {sorted(fills)}, its template has {sorted(wanted)}"
        )
    return _SLOT_USE.sub(lambda m: fills[m.group(1)], template)


def parse_queries(text: str, *, source: str = "<sql>") -> dict[str, str]:
    """``{name: sql}`` from one file's text (templates expanded into their variants); a name
    given twice is an error."""
    queries: dict[str, str] = {}
    templates: dict[str, str] = {}
    markers = list(_MARKER.finditer(text))
    for index, marker in enumerate(markers):
        end = markers[index + 1].start() if index + 1 < len(markers) else len(text)
        what, name, base = marker.groups()
        if name in queries or name in templates:
            raise ValueError(f"{source}: query {name!r} is defined twice")
        body = text[marker.end() : end].strip()
        if not body:
            raise ValueError(f"{source}: query {name!r} is empty")
        if what == "template":
            templates[name] = body
        elif base is not None:
            if base not in templates:
                raise ValueError(f"{source}: {name!r} is from {base!r}, not a template above it")
            queries[name] = _fill(templates[base], body, source=source, name=name)
        else:
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
