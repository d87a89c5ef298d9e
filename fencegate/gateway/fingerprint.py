"""What makes two requests "the same operation" for an idempotency key."""

from __future__ import annotations

import hashlib
from urllib.parse import unquote_plus


def _name(parameter: str) -> str:
    # As a form parser reads the name: `%61` and `a` may be one name to the upstream, so
    # their values keep their order between them. The "=" keeps different plain names in
    # the order a sort of whole parameters gave them (fingerprints stored before stay valid).
    return unquote_plus(parameter.partition("=")[0]) + "="


def sorted_query(query_string: str) -> str:
    """The query's parameters as sent, sorted by name, so ``?a=1&b=2`` and ``?b=2&a=1`` are
    one request; the values of a repeated name keep the order they were sent in, since the
    upstream reads ``?a=1&a=2`` and ``?a=2&a=1`` as different lists. Nothing in the result
    is decoded: ``?x=%2F`` and ``?x=/`` are two requests, as the upstream may read them
    differently."""
    if "&" not in query_string:
        return query_string
    return "&".join(sorted(query_string.split("&"), key=_name))  # a stable sort


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
