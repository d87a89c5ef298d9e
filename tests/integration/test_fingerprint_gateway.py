"""No input makes the gateway fail or forward garbage: any headers, body and query through the
middleware on a real SQLite store."""

from __future__ import annotations

import asyncio
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fencegate import FenceGateMiddleware
from fencegate.gateway.headers import parse_entity, parse_fence, parse_idempotency_key
from fencegate.gateway.routes import RoutePolicy
from fencegate.store import open_gateway_store
from fencegate.store.migrations import migrate
from tests.support.asgi import call
from tests.support.echo_app import EchoApp

header_names = st.sampled_from(
    ["idempotency-key", "x-execution-fence", "x-execution-entity", "content-length", "x-other"]
)


header_values = st.one_of(
    st.binary(max_size=300).filter(lambda b: b"\r" not in b and b"\n" not in b),
    st.integers(min_value=-(2**64), max_value=2**64).map(lambda n: str(n).encode()),
    st.sampled_from([b"k", b'"k"', b"1", b"e", b"0", b""]),
)


requests = st.tuples(
    st.sampled_from(["POST", "PUT", "GET", "DELETE"]),
    st.lists(st.tuples(header_names, header_values), max_size=6),
    st.binary(max_size=200),
    st.text(alphabet="ab=&%2", max_size=10),
)


def test_no_input_makes_the_gateway_fail_or_forward_garbage(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'prop.db'}"
    loop = asyncio.new_event_loop()
    loop.run_until_complete(migrate(url))
    store = loop.run_until_complete(open_gateway_store(url, run_migrations=False))
    echo = EchoApp()
    policy = RoutePolicy(
        prefix="/", key_required=False, max_body_bytes=100, max_stored_body_bytes=50
    )
    app = FenceGateMiddleware(echo, store=store, default_policy=policy, store_timeout=30.0)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(requests)
    def check(request: tuple[str, list[tuple[str, bytes]], bytes, str]) -> None:
        method, headers, body, query = request
        raw = [(name.encode(), value) for name, value in headers]
        before = len(echo.seen_headers)
        answer = loop.run_until_complete(
            call(app, method, "/ops", headers=raw, body=body, query=query)
        )
        assert 100 <= answer.status < 500, (answer.status, answer.body)
        if answer.status >= 400:
            assert answer.header("content-type") == "application/problem+json"
        if len(echo.seen_headers) > before and method != "GET":
            seen = echo.seen_headers[-1]
            # Whatever reached the app carries well-formed protocol headers only.
            for name, parse in (
                ("idempotency-key", parse_idempotency_key),
                ("x-execution-fence", parse_fence),
                ("x-execution-entity", parse_entity),
            ):
                values = [v.decode("latin-1") for k, v in raw if k == name.encode()]
                if values:
                    assert seen.get(name) is not None
                    parse(values)  # raises Problem if a malformed one got through

    try:
        check()
    finally:
        # The middleware's gateway registration heartbeats until it is closed (with no
        # lifespan here, by hand), as an application's shutdown would.
        loop.run_until_complete(app.close())
        loop.run_until_complete(store.close())
        loop.close()
