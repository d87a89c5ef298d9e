"""What makes two requests "the same operation" for an idempotency key."""

from __future__ import annotations

import hashlib


def sorted_query(query_string: str) -> str:
    """The query's parameters as sent, in a canonical order, so ``?a=1&b=2`` and
    ``?b=2&a=1`` are one request. Nothing is decoded: ``?x=%2F`` and ``?x=/`` are two
    requests, as the upstream may read them differently."""
    if not query_string:
        return ""
    return "&".join(sorted(query_string.split("&")))


def request_fingerprint(method: str, path: str, query_string: str, body: bytes) -> str:
    """Hex SHA-256 over method, the path as sent, sorted query and body.

    Each part is length-prefixed, so no two different requests can be spelled into the same
    byte string (a path may contain any character once decoded).
    """
    digest = hashlib.sha256()
    for part in (
        method.upper().encode(),
        path.encode("utf-8", "surrogateescape"),
        sorted_query(query_string).encode(),
    ):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    digest.update(len(body).to_bytes(8, "big"))
    digest.update(body)
    return digest.hexdigest()
