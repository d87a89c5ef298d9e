"""One fact ASGI loses that the gateway's HTTP protocol (`fencegate.gateway.connections`)
puts back: whether the request target ended in "?" with an empty query. ``/v1/q`` and
``/v1/q?`` are different targets (RFC 3986 keeps the empty query) and the gateway forwards
the target byte for byte, but ASGI gives both the same empty ``query_string``. The scope then
carries the ``fencegate.empty_query`` extension."""

from __future__ import annotations

from typing import Any

from fencegate.gateway.target import EMPTY_QUERY_EXTENSION


def mark_empty_query(url: bytes, scope: Any) -> None:
    """Called once the request head is parsed, before the request's task runs."""
    target = url.partition(b"#")[0]
    if target.endswith(b"?") and target.count(b"?") == 1 and not scope.get("query_string"):
        scope.setdefault("extensions", {})[EMPTY_QUERY_EXTENSION] = {}
