"""The request target as sent, and the one path the gateway routes it by.

The gateway forwards the raw path and query byte for byte. It must therefore choose the route
from those same bytes, and read them the way the upstream will: percent-decoded. A target
whose decoded form has a different shape than its raw form (``/h/%2e%2e/admin``,
``/inv/..%2Fadmin``) would be checked under one route and acted on under another, so it is
refused: dot-segments (raw or encoded), empty segments, an encoded ``/`` (unless the route
allows it), ``\\``, ``?``, ``#``, NUL or another control character, and malformed
percent-encoding are 400 ``invalid-target``.
"""

from __future__ import annotations

import dataclasses
import re
import string
from dataclasses import dataclass
from urllib.parse import quote

from fencegate.problems import Problem
from fencegate.types import Scope

# RFC 3986 pchar (unreserved, sub-delims, ":" and "@"), "/" and "%" for escapes.
_PATH_CHARS = frozenset(
    (string.ascii_letters + string.digits + "-._~" + "!$&'()*+,;=" + ":@" + "/%").encode()
)
# The query is forwarded as sent; only bytes that can stand in a request line pass.
_QUERY_CHARS = frozenset(range(0x21, 0x7F)) - {ord("#")}
_HEX = frozenset(b"0123456789abcdefABCDEF")
# Decoded bytes that would change how the upstream splits the target.
_NEVER_ENCODED = {ord("\\"): "\\", ord("?"): "?", ord("#"): "#"}


@dataclass(frozen=True, slots=True)
class Target:
    raw_path: str  # as sent (ASCII)
    raw_query: str  # as sent, without "?"
    route_path: str  # percent-decoded (latin-1), except that an encoded "/" stays "%2F"
    encoded_slash: bool  # the raw path holds %2F
    empty_query: bool = False  # sent as "path?" (an empty query is still part of the target)

    @property
    def raw(self) -> str:
        if self.raw_query or self.empty_query:
            return f"{self.raw_path}?{self.raw_query}"
        return self.raw_path


def invalid_target(reason: str) -> Problem:
    return Problem(
        400,
        "invalid-target",
        "Invalid request target",
        f"the request target is refused: {reason}",
    )


# Most targets have no escape, no dot-segment and no empty segment: then the raw, decoded and
# routed forms are the same, and one match says so (the byte loop below is the full rule).
_PLAIN_SEGMENT = rb"(?!\.\.?(?:/|\Z))[A-Za-z0-9\-._~!$&'()*+,;=:@]+"
_PLAIN_PATH = re.compile(rb"/(?:%s(?:/%s)*/?)?" % (_PLAIN_SEGMENT, _PLAIN_SEGMENT))
_PLAIN_QUERY = re.compile(rb"[\x21\x22\x24-\x7e]*")


def parse_target(raw_path: bytes, raw_query: bytes) -> Target:
    """Validate a raw target; raises `Problem` 400 ``invalid-target``."""
    if _PLAIN_PATH.fullmatch(raw_path) and _PLAIN_QUERY.fullmatch(raw_query):
        path = raw_path.decode("ascii")
        return Target(path, raw_query.decode("ascii"), path, encoded_slash=False)
    return parse_target_fully(raw_path, raw_query)


def parse_target_fully(raw_path: bytes, raw_query: bytes) -> Target:
    """`parse_target` without the shortcut for plain targets."""
    if not raw_path.startswith(b"/"):
        raise invalid_target("the path must start with '/'")
    for byte in raw_path:
        if byte not in _PATH_CHARS:
            raise invalid_target(f"the path holds the byte 0x{byte:02X}, which must be encoded")
    for byte in raw_query:
        if byte not in _QUERY_CHARS:
            raise invalid_target(f"the query holds the byte 0x{byte:02X}, which must be encoded")

    decoded = bytearray()  # every escape decoded, "/" included: the upstream's reading
    routed = bytearray()  # the same, but an encoded "/" kept as "%2F"
    encoded_slash = False
    i = 0
    while i < len(raw_path):
        byte = raw_path[i]
        if byte != ord("%"):
            decoded.append(byte)
            routed.append(byte)
            i += 1
            continue
        pair = raw_path[i + 1 : i + 3]
        if len(pair) != 2 or pair[0] not in _HEX or pair[1] not in _HEX:
            raise invalid_target("malformed percent-encoding in the path")
        value = int(pair, 16)
        if value in _NEVER_ENCODED:
            raise invalid_target(f"an encoded {_NEVER_ENCODED[value]!r} in the path")
        if value < 0x20 or value == 0x7F:
            raise invalid_target("an encoded control character (NUL included) in the path")
        decoded.append(value)
        if value == ord("/"):
            encoded_slash = True
            routed.extend(b"%2F")
        else:
            routed.append(value)
        i += 3

    segments = bytes(decoded).split(b"/")[1:]
    for index, segment in enumerate(segments):
        if segment in (b".", b".."):
            raise invalid_target("a dot-segment ('.' or '..', raw or encoded) in the path")
        if not segment and index < len(segments) - 1:
            raise invalid_target("an empty segment ('//') in the path")
    return Target(
        raw_path=raw_path.decode("ascii"),
        raw_query=raw_query.decode("ascii"),
        route_path=bytes(routed).decode("latin-1"),
        encoded_slash=encoded_slash,
    )


# Set by the gateway's HTTP protocol (`fencegate.gateway.http_protocol`) when the request
# target ended in "?": ASGI's query_string is empty both for "/q" and "/q?".
EMPTY_QUERY_EXTENSION = "fencegate.empty_query"


def scope_target(scope: Scope) -> Target:
    """The target of an ASGI HTTP scope. ``raw_path`` is optional in ASGI; without it the
    decoded path is encoded again. Some test transports put the query into ``raw_path``."""
    raw_path = scope.get("raw_path")
    if not isinstance(raw_path, bytes | bytearray) or not raw_path:
        raw_path = quote(str(scope.get("path", "/")), safe="/:@!$&'()*+,;=-._~").encode()
    raw_path, marker, _ = bytes(raw_path).partition(b"?")
    query = scope.get("query_string", b"")
    target = parse_target(raw_path, bytes(query) if isinstance(query, bytes | bytearray) else b"")
    if not target.raw_query and (marker or EMPTY_QUERY_EXTENSION in scope.get("extensions", ())):
        return dataclasses.replace(target, empty_query=True)
    return target
