"""The fingerprint, and property tests: no input makes the gateway answer 5xx or forward a
malformed request."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fencegate.gateway.fingerprint import request_fingerprint


def test_fingerprint_covers_method_path_query_and_body() -> None:
    base = request_fingerprint("POST", "/a", "x=1&y=2", b"{}")
    assert base == request_fingerprint("post", "/a", "y=2&x=1", b"{}")
    assert len(base) == 64
    for other in (
        request_fingerprint("PUT", "/a", "x=1&y=2", b"{}"),
        request_fingerprint("POST", "/b", "x=1&y=2", b"{}"),
        request_fingerprint("POST", "/a", "x=1&y=3", b"{}"),
        request_fingerprint("POST", "/a", "x=1&y=2", b"{ }"),
        request_fingerprint("POST", "/a", "x=1&y=2&y=2", b"{}"),
    ):
        assert other != base


@given(
    st.text(max_size=20), st.text(max_size=20), st.binary(max_size=20),
    st.text(max_size=20), st.text(max_size=20), st.binary(max_size=20),
)  # fmt: skip
def test_fingerprint_has_no_collisions_between_field_splits(
    path_a: str, query_a: str, body_a: bytes, path_b: str, query_b: str, body_b: bytes
) -> None:
    same = (path_a, body_a) == (path_b, body_b) and _canon(query_a) == _canon(query_b)
    a = request_fingerprint("POST", path_a, query_a, body_a)
    b = request_fingerprint("POST", path_b, query_b, body_b)
    assert (a == b) == same


def _canon(query: str) -> str:
    from fencegate.gateway.fingerprint import sorted_query

    return sorted_query(query)
