"""The request target is forwarded byte for byte, under the route those same bytes select.

A target the upstream would read under another route than the gateway (dot-segments, raw
or encoded; an encoded ``/``; ``\\``, ``?``, ``#`` or NUL encoded; bad escapes) is refused
with 400 ``invalid-target``. Checked here on the parser; tests/acceptance/test_target_gateway.py
checks the same through real processes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fencegate.gateway.target import Target, parse_target, parse_target_fully
from fencegate.problems import Problem

# (sent, what the upstream of old saw): every one of these changed on the way.
REFUSED = [
    "/v1/a%3Fb=1",
    "/v1/a%23frag",
    "/h/../admin/x",
    "/h/%2e%2e/admin/x",
    "/h/%2E%2E/admin/x",
    "/inv/..%2Fadmin/x",
    "/h/%2e%2e%2f%2e%2e%2fetc/passwd",
    "/h/./admin",
    "/h/.",
    "/h/..",
    "/a%5Cb",
    "/a\\b",
    "/a%00b",
    "/a%zz",
    "/a%2",
    "//admin/x",
]
# Refused too, but cannot stand in a request line as they are.
NOT_SENDABLE = ["/a%0d%0aX: 1", "/a b", "/caf\u00e9"]
FORWARDED = [
    "/v1/a%252F",
    "/v1/a",
    "/v1/%61dmin",
    "/%61dmin/x",  # the upstream reads /admin/x: routed as /admin
    "/h/%2e%2e.x",
    "/v1/a;b=c",
    "/v1/~user/x.y",
    "/",
    "/v1/a/",
]


@pytest.mark.parametrize("path", REFUSED + NOT_SENDABLE)
def test_targets_read_differently_upstream_are_refused(path: str) -> None:
    with pytest.raises(Problem) as raised:
        parse_target(path.encode("utf-8"), b"")
    assert (raised.value.status, raised.value.kind) == (400, "invalid-target")


@pytest.mark.parametrize("path", FORWARDED)
def test_plain_targets_keep_their_bytes(path: str) -> None:
    target = parse_target(path.encode(), b"x=%2F&y=1")
    assert (target.raw_path, target.raw_query) == (path, "x=%2F&y=1")


def test_the_route_path_is_what_the_upstream_reads_but_an_encoded_slash_stays() -> None:
    assert parse_target(b"/%61dmin/x", b"").route_path == "/admin/x"
    slashed = parse_target(b"/files/a%2Fb", b"")
    assert (slashed.route_path, slashed.encoded_slash) == ("/files/a%2Fb", True)


def _outcome(parse: Callable[[bytes, bytes], Target], path: bytes, query: bytes) -> object:
    try:
        return parse(path, query)
    except Problem as problem:
        return ("refused", problem.detail)


# Bytes that matter to the rules, so that random targets often hit them.
_TRICKY = st.sampled_from([b"/", b".", b"..", b"%", b"%2F", b"%2e", b"a", b"-", b"~", b"%41"])
_TARGET_BYTES = st.lists(_TRICKY | st.binary(min_size=1, max_size=2), max_size=12).map(b"".join)


@settings(max_examples=2000, deadline=None)
@given(path=_TARGET_BYTES, query=st.binary(max_size=8) | _TARGET_BYTES)
def test_the_shortcut_for_plain_targets_agrees_with_the_full_rule(
    path: bytes, query: bytes
) -> None:
    """The one-match shortcut answers exactly as the byte-by-byte rule, for any target."""
    for sent in (path, b"/" + path):
        assert _outcome(parse_target, sent, query) == _outcome(parse_target_fully, sent, query)
