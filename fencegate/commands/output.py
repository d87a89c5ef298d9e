"""How the operator commands print: one JSON document with ``--json``, else aligned text
tables with times in UTC, for a person at a terminal."""

from __future__ import annotations

import argparse
import getpass
import math
import os
import socket
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from fencegate.commands.migrate import add_database_url
from fencegate.operator_actions import when
from fencegate.store.release_rule import DEFAULT_RELEASE_MARGIN

# Columns whose values are epoch seconds.
_TIMES = frozenset(
    {"at", "created_at", "updated_at", "completed_at", "expires_at", "locked_until",
     "claimed_at", "ended_at", "committed_at", "run_after", "lease_until", "heartbeat_at",
     "now"}
)  # fmt: skip


def add_common(
    parser: argparse.ArgumentParser, *, tenant_default: str | None, tenant: bool = True
) -> None:
    """``--database-url``, ``--tenant``, ``--json`` and ``--timeout``, as every operator
    command takes them (``--tenant`` only where the records have one: jobs do not)."""
    add_database_url(parser)
    if tenant:
        default = os.environ.get("FENCEGATE_TENANT", tenant_default)
        scope = f"default {default!r}" if default else "default: every tenant"
        parser.add_argument(
            "--tenant", default=default, help=f"the tenant ({scope}; env FENCEGATE_TENANT)"
        )
    parser.add_argument("--json", action="store_true", help="one JSON document, not a table")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds for the store")


def add_actor(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--by",
        default=f"{getpass.getuser()}@{socket.gethostname()}",
        help="who does it, for the audit record (default user@host)",
    )
    parser.add_argument("--reason", help="why, for the audit record")


def add_release_margin(parser: argparse.ArgumentParser) -> None:
    default = os.environ.get("FENCEGATE_RELEASE_MARGIN", f"{DEFAULT_RELEASE_MARGIN:g}")
    parser.add_argument(
        "--release-margin",
        type=_seconds,
        default=default,  # a string: argparse converts (and refuses) it like a given one
        help="seconds a request may still be on its way to the upstream after its gateway's "
        f"lease ended (default {DEFAULT_RELEASE_MARGIN:g}; env FENCEGATE_RELEASE_MARGIN): the "
        "same value as the gateways' --release-margin",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the release margin is 0 or more seconds")
    return value


def readable(row: dict[str, Any]) -> dict[str, Any]:
    return {k: when(v) if k in _TIMES else v for k, v in row.items()}


def print_json(document: Any) -> None:
    sys.stdout.write(orjson.dumps(document, default=str).decode() + "\n")


def print_table(rows: Iterable[dict[str, Any]], columns: Sequence[str]) -> None:
    cells = [[_cell(readable(row).get(c)) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    if not cells:
        print("(none)")


def print_fields(row: dict[str, Any]) -> None:
    shown = readable(row)
    width = max((len(k) for k in shown), default=0)
    for name, value in shown.items():
        if isinstance(value, list):
            continue
        print(f"{name:<{width}}  {_cell(value)}")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, dict):
        return orjson.dumps(value).decode()
    return str(value)
