"""Every behaviour of the HTTP contract (docs/protocol.md §2, §3) through the middleware, on
SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import hashlib

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fencegate import FenceGateMiddleware
from fencegate.gateway.fingerprint import request_fingerprint
from fencegate.gateway.routes import EntityRule, RoutePolicy
from fencegate.problems import Problem
from fencegate.store import DecideRequest, GatewayStore, Outcome
from fencegate.types import IncomingRequest, NonceStore
from tests.support.asgi import Answer, call
from tests.support.echo_app import EchoApp
from tests.support.waits import wait_until

PROBLEM = "application/problem+json"


@pytest.fixture
def echo() -> EchoApp:
    return EchoApp()


def gateway(
    echo: EchoApp, store: GatewayStore, *routes: RoutePolicy, **options: object
) -> FenceGateMiddleware:
    options.setdefault("store_timeout", 30.0)  # a loaded test machine is not an outage
    return FenceGateMiddleware(echo, store=store, routes=routes, **options)  # type: ignore[arg-type]


def keyed(key: str, **extra: str) -> list[tuple[str, str]]:
    headers = [("idempotency-key", key), ("content-type", "application/json")]
    headers += [(k.replace("_", "-"), v) for k, v in extra.items()]
    return headers


def assert_problem(answer: Answer, status: int, kind: str) -> dict[str, object]:
    assert answer.status == status, answer.body
    assert answer.header("content-type") == PROBLEM
    problem = answer.json()
    assert problem["type"].endswith("/" + kind)
    assert problem["status"] == status
    assert problem["title"] and problem["detail"]
    return dict(problem)


async def test_first_answer_is_replayed_with_its_headers(
    echo: EchoApp, store: GatewayStore
) -> None:
    app = gateway(echo, store)
    first = await call(app, "POST", "/orders", headers=keyed("k-1"), body=b"{}", query="status=201")
    again = await call(app, "POST", "/orders", headers=keyed("k-1"), body=b"{}", query="status=201")
    assert first.status == 201 and first.header("idempotent-replayed") is None
    assert again.status == 201
    assert again.body == first.body
    assert again.header("idempotent-replayed") == "true"
    assert again.header("x-custom") == "kept"
    assert again.header("content-type") == "application/json"
    assert again.header("set-cookie") is None and again.header("date") is None
    assert again.header("content-length") == str(len(first.body))
    assert echo.calls["k-1"] == 1


async def test_sorted_query_is_the_same_request(echo: EchoApp, store: GatewayStore) -> None:
    app = gateway(echo, store)
    await call(app, "POST", "/q", headers=keyed("k"), query="a=1&b=2")
    again = await call(app, "POST", "/q", headers=keyed("k"), query="b=2&a=1")
    assert again.header("idempotent-replayed") == "true"
    assert echo.calls["k"] == 1


async def test_a_repeated_parameter_in_another_order_is_another_request(
    echo: EchoApp, store: GatewayStore
) -> None:
    app = gateway(echo, store)
    await call(app, "POST", "/q", headers=keyed("k"), query="a=1&b=3&a=2")
    same = await call(app, "POST", "/q", headers=keyed("k"), query="b=3&a=1&a=2")
    assert same.header("idempotent-replayed") == "true"
    other = await call(app, "POST", "/q", headers=keyed("k"), query="a=2&b=3&a=1")
    assert_problem(other, 422, "key-reused")
    assert echo.calls["k"] == 1


@pytest.mark.parametrize(
    ("path", "query", "body", "method"),
    [("/other", "", b"{}", "POST"), ("/orders", "x=1", b"{}", "POST"),
     ("/orders", "", b'{"a":1}', "POST"), ("/orders", "", b"{}", "PUT")],
)  # fmt: skip
async def test_same_key_for_another_request_is_422(
    echo: EchoApp, store: GatewayStore, path: str, query: str, body: bytes, method: str
) -> None:
    app = gateway(echo, store)
    await call(app, "POST", "/orders", headers=keyed("k-1"), body=b"{}")
    answer = await call(app, method, path, headers=keyed("k-1"), body=body, query=query)
    assert_problem(answer, 422, "key-reused")
    assert echo.calls["k-1"] == 1


async def test_in_flight_key_is_409_with_retry_after_its_upstream_deadline(
    echo: EchoApp, store: GatewayStore
) -> None:
    # The first request may take at most its route's 4 s; the in-flight lease is 30 s. A
    # client honouring Retry-After must not wait out the lease.
    app = gateway(echo, store, RoutePolicy(prefix="/", timeout=4.0))
    first = asyncio.create_task(call(app, "POST", "/slow", headers=keyed("k"), query="delay=1.5"))
    await asyncio.wait_for(echo.started.wait(), 20)
    second = await call(app, "POST", "/slow", headers=keyed("k"), query="delay=1.5")
    problem = assert_problem(second, 409, "in-flight")
    retry_after = second.header("retry-after")
    assert retry_after is not None and 1 <= int(retry_after) <= 4
    assert problem["retry_after"] == int(retry_after)
    assert (await first).status == 200
    assert echo.calls["k"] == 1


async def test_stale_fence_is_412_and_stores_nothing(echo: EchoApp, store: GatewayStore) -> None:
    app = gateway(echo, store)
    fenced = keyed("k-5", x_execution_fence="5", x_execution_entity="invoice:1")
    assert (await call(app, "POST", "/pay", headers=fenced)).status == 200
    stale = keyed("k-4", x_execution_fence="4", x_execution_entity="invoice:1")
    problem = assert_problem(await call(app, "POST", "/pay", headers=stale), 412, "stale-fence")
    assert problem["last_accepted_fence"] == 5
    assert echo.calls["k-4"] == 0
    # The stale request left no key behind: the same key with a newer fence runs.
    newer = keyed("k-4", x_execution_fence="6", x_execution_entity="invoice:1")
    assert (await call(app, "POST", "/pay", headers=newer)).status == 200
    assert echo.calls["k-4"] == 1


async def test_equal_fence_is_accepted(echo: EchoApp, store: GatewayStore) -> None:
    app = gateway(echo, store)
    for key in ("a", "b"):
        headers = keyed(key, x_execution_fence="7", x_execution_entity="job:9")
        assert (await call(app, "POST", "/pay", headers=headers)).status == 200
    assert echo.calls["a"] == echo.calls["b"] == 1


async def test_fences_are_per_entity(echo: EchoApp, store: GatewayStore) -> None:
    app = gateway(echo, store)
    high = keyed("a", x_execution_fence="100", x_execution_entity="job:1")
    low = keyed("b", x_execution_fence="1", x_execution_entity="job:2")
    assert (await call(app, "POST", "/pay", headers=high)).status == 200
    assert (await call(app, "POST", "/pay", headers=low)).status == 200


async def test_fence_entity_from_path_template(echo: EchoApp, store: GatewayStore) -> None:
    capture = RoutePolicy(prefix="/invoices", entity=EntityRule("/invoices/{invoice_id}/capture"))
    app = gateway(echo, store, capture)
    new = [("x-execution-fence", "9"), ("idempotency-key", "a")]
    old = [("x-execution-fence", "8"), ("idempotency-key", "b")]
    assert (await call(app, "POST", "/invoices/42/capture", headers=new)).status == 200
    answer = await call(app, "POST", "/invoices/42/capture", headers=old)
    assert_problem(answer, 412, "stale-fence")
    other = await call(app, "POST", "/invoices/43/capture", headers=old)
    assert other.status == 200


async def test_fence_entity_from_json_field(echo: EchoApp, store: GatewayStore) -> None:
    app = gateway(echo, store, RoutePolicy(prefix="/", entity=EntityRule("json:invoice.id")))
    body = b'{"invoice": {"id": "inv-7"}}'
    new = [("x-execution-fence", "3"), ("idempotency-key", "a")]
    old = [("x-execution-fence", "2"), ("idempotency-key", "b")]
    assert (await call(app, "POST", "/pay", headers=new, body=body)).status == 200
    assert_problem(await call(app, "POST", "/pay", headers=old, body=body), 412, "stale-fence")
    missing = await call(app, "POST", "/pay", headers=old, body=b'{"invoice": {}}')
    assert_problem(missing, 400, "entity-required")


async def test_fence_without_entity_is_400(echo: EchoApp, store: GatewayStore) -> None:
    app = gateway(echo, store)
    answer = await call(app, "POST", "/pay", headers=keyed("k", x_execution_fence="1"))
    assert_problem(answer, 400, "entity-required")
    assert echo.calls["k"] == 0


class HeaderTenants:
    """Step 1 for tests: the tenant is named by a header (a real gateway verifies a
    signature instead)."""

    stripped_headers = frozenset({"x-tenant"})

    async def authenticate(self, request: IncomingRequest, nonces: NonceStore) -> str:
        values = request.header_values("x-tenant")
        if not values:
            raise Problem(401, "unauthenticated", "Who are you?", "no x-tenant header")
        return values[0]


async def test_tenants_never_share_keys_or_fences(echo: EchoApp, store: GatewayStore) -> None:
    app = gateway(echo, store, authenticator=HeaderTenants())
    for tenant, fence in (("acme", "10"), ("globex", "1")):
        headers = keyed("same-key", x_tenant=tenant, x_execution_fence=fence,
                        x_execution_entity="job:1")  # fmt: skip
        answer = await call(app, "POST", "/pay", headers=headers, body=tenant.encode())
        assert answer.status == 200, answer.body
        assert answer.header("idempotent-replayed") is None
    assert echo.calls["same-key"] == 2
    assert all("x-tenant" not in seen for seen in echo.seen_headers)
    assert_problem(await call(app, "POST", "/pay", headers=keyed("k")), 401, "unauthenticated")


@pytest.mark.parametrize(
    "headers",
    [
        [("idempotency-key", "")],
        [("idempotency-key", "x" * 256)],
        [("idempotency-key", b"caf\xe9")],
        [("idempotency-key", '"unterminated')],
        [("idempotency-key", "a"), ("idempotency-key", "b")],
        [("idempotency-key", "k"), ("x-execution-fence", "-1"), ("x-execution-entity", "e")],
        [("idempotency-key", "k"), ("x-execution-fence", "+1"), ("x-execution-entity", "e")],
        [("idempotency-key", "k"), ("x-execution-fence", "1.0"), ("x-execution-entity", "e")],
        [("idempotency-key", "k"), ("x-execution-fence", "1 2"), ("x-execution-entity", "e")],
        [("idempotency-key", "k"), ("x-execution-fence", str(2**63)), ("x-execution-entity", "e")],
        [("idempotency-key", "k"), ("x-execution-fence", "1"), ("x-execution-fence", "2"),
         ("x-execution-entity", "e")],
        [("idempotency-key", "k"), ("x-execution-entity", "e" * 256)],
    ],
)  # fmt: skip
async def test_malformed_headers_are_400(
    echo: EchoApp, store: GatewayStore, headers: list[tuple[str, str]]
) -> None:
    answer = await call(gateway(echo, store), "POST", "/pay", headers=headers)
    problem = assert_problem(answer, 400, "invalid-header")
    assert problem["header"] in {"Idempotency-Key", "X-Execution-Fence", "X-Execution-Entity"}
    assert sum(echo.calls.values()) == 0


async def test_identical_repeated_headers_are_fine(echo: EchoApp, store: GatewayStore) -> None:
    headers = [("idempotency-key", "k"), ("idempotency-key", "k"), ("x-execution-fence", "3"),
               ("x-execution-fence", "3"), ("x-execution-entity", "e")]  # fmt: skip
    assert (await call(gateway(echo, store), "POST", "/pay", headers=headers)).status == 200


async def test_quoted_key_is_the_same_key(echo: EchoApp, store: GatewayStore) -> None:
    app = gateway(echo, store)
    await call(app, "POST", "/pay", headers=[("idempotency-key", "job-1")])
    again = await call(app, "POST", "/pay", headers=[("idempotency-key", '"job-1"')])
    assert again.header("idempotent-replayed") == "true"


async def test_missing_key_is_400_and_missing_fence_is_428(
    echo: EchoApp, store: GatewayStore
) -> None:
    fenced = RoutePolicy(prefix="/fenced", fence_required=True)
    app = gateway(echo, store, fenced)
    missing_key = assert_problem(
        await call(app, "POST", "/payments/inv-9/capture"), 400, "key-required"
    )
    # The request as sent, not the route's prefix ("POST / requires ...").
    assert (
        missing_key["detail"] == "POST /payments/inv-9/capture requires an Idempotency-Key header"
    )
    missing_fence = assert_problem(
        await call(app, "POST", "/fenced/x", headers=keyed("k")), 428, "fence-required"
    )
    assert missing_fence["detail"] == "POST /fenced/x requires an X-Execution-Fence header"
    assert sum(echo.calls.values()) == 0


async def test_optional_key_route_passes_unkeyed_requests(
    echo: EchoApp, store: GatewayStore
) -> None:
    app = gateway(echo, store, RoutePolicy(prefix="/", key_required=False))
    assert (await call(app, "POST", "/pay")).status == 200
    assert (await call(app, "POST", "/pay")).status == 200
    assert echo.calls[""] == 2


async def test_body_over_the_limit_is_413(echo: EchoApp, store: GatewayStore) -> None:
    app = gateway(echo, store, RoutePolicy(prefix="/", max_body_bytes=100))
    chunked = await call(app, "POST", "/pay", headers=keyed("k"), body=b"x" * 101, chunk_size=40)
    problem = assert_problem(chunked, 413, "body-too-large")
    assert problem["max_body_bytes"] == 100
    declared = keyed("k", content_length="5000")
    assert_problem(await call(app, "POST", "/pay", headers=declared, body=b"x" * 10), 413,
                   "body-too-large")  # fmt: skip
    assert (await call(app, "POST", "/pay", headers=keyed("k"), body=b"x" * 100)).status == 200
    assert echo.calls["k"] == 1


async def test_5xx_is_released_so_a_retry_runs_again(echo: EchoApp, store: GatewayStore) -> None:
    app = gateway(echo, store)
    for _ in range(2):
        answer = await call(app, "POST", "/pay", headers=keyed("k"), query="status=503")
        assert answer.status == 503
        assert answer.header("idempotent-replayed") is None
    assert echo.calls["k"] == 2


async def test_5xx_is_stored_when_the_route_says_so(echo: EchoApp, store: GatewayStore) -> None:
    app = gateway(echo, store, RoutePolicy(prefix="/", store_5xx=True))
    await call(app, "POST", "/pay", headers=keyed("k"), query="status=500")
    again = await call(app, "POST", "/pay", headers=keyed("k"), query="status=500")
    assert again.status == 500 and again.header("idempotent-replayed") == "true"
    assert echo.calls["k"] == 1


async def test_unstored_status_list_releases_the_rest(echo: EchoApp, store: GatewayStore) -> None:
    app = gateway(echo, store, RoutePolicy(prefix="/", stored_statuses=frozenset({200})))
    await call(app, "POST", "/pay", headers=keyed("k"), query="status=429")
    again = await call(app, "POST", "/pay", headers=keyed("k"), query="status=429")
    assert again.header("idempotent-replayed") is None
    assert echo.calls["k"] == 2


async def test_large_response_is_recorded_by_hash(echo: EchoApp, store: GatewayStore) -> None:
    app = gateway(echo, store, RoutePolicy(prefix="/", max_stored_body_bytes=100))
    first = await call(app, "POST", "/report", headers=keyed("k"), query="size=5000")
    assert first.status == 200 and len(first.body) > 5000
    again = await call(app, "POST", "/report", headers=keyed("k"), query="size=5000")
    problem = assert_problem(again, 410, "response-not-stored")
    assert problem["original_status"] == 200
    assert problem["body_sha256"] == hashlib.sha256(first.body).hexdigest()
    assert again.header("idempotent-replayed") == "true"
    assert echo.calls["k"] == 1


@pytest.mark.parametrize("on_unknown", ["retry", "reject"])
async def test_timeout_is_504_then_per_route(
    echo: EchoApp, store: GatewayStore, on_unknown: str
) -> None:
    route = RoutePolicy(prefix="/", timeout=0.3, on_unknown=on_unknown)  # type: ignore[arg-type]
    app = gateway(echo, store, route)
    answer = await call(app, "POST", "/pay", headers=keyed("k"), query="delay_first=5")
    assert_problem(answer, 504, "upstream-timeout")
    again = await call(app, "POST", "/pay", headers=keyed("k"), query="delay_first=5")
    if on_unknown == "reject":
        unknown = assert_problem(again, 424, "outcome-unknown")
        assert (unknown["key"], unknown["reason"]) == ("k", "upstream_timeout")
        assert echo.calls["k"] == 1
    else:
        assert again.status == 200
        assert echo.calls["k"] == 2
        assert echo.seen_headers[-1]["idempotency-key"] == "k"


async def test_get_passes_through_without_a_key(echo: EchoApp, store: GatewayStore) -> None:
    app = gateway(echo, store)
    for _ in range(2):
        answer = await call(app, "GET", "/orders")
        assert answer.status == 200 and answer.header("idempotent-replayed") is None
    assert echo.calls[""] == 2


@pytest.mark.timeout(180)
async def test_100_concurrent_copies_of_a_new_key_run_once(
    echo: EchoApp, store: GatewayStore
) -> None:
    app = gateway(echo, store)
    answers = await asyncio.gather(
        *(
            call(app, "POST", "/pay", headers=keyed("one"), body=b"{}", query="delay=0.5")
            for _ in range(100)
        )
    )
    assert echo.calls["one"] == 1
    statuses = sorted({a.status for a in answers})
    assert set(statuses) <= {200, 409}, statuses
    assert sum(1 for a in answers if a.status == 200 and not a.header("idempotent-replayed")) == 1


async def reserved_by_a_dead_gateway(store: GatewayStore, key: str) -> DecideRequest:
    """A gateway reserved the key and died: once its lease has run out (waited for, by the
    database clock), nothing was recorded and the outcome is unknown."""
    dead = DecideRequest(
        tenant="default",
        key=key,
        fingerprint=request_fingerprint("POST", "/pay", "", b"{}"),
        entity=None,
        fence=None,
        owner="dead-gateway",
        lease_seconds=0.2,
        ttl_seconds=3600,
        retry_unknown=True,
    )
    assert (await store.decide(dead, timeout=30)).outcome is Outcome.RESERVED
    await wait_until(lambda: key_is_unknown(store, key), timeout=30)
    return dead


async def key_is_unknown(store: GatewayStore, key: str) -> bool:
    record = await store.get_key("default", key, timeout=30)
    return record is not None and record.unknown


async def test_expired_in_flight_key_is_unknown_and_not_forwarded_by_default(
    echo: EchoApp, store: GatewayStore
) -> None:
    await reserved_by_a_dead_gateway(store, "k")
    app = gateway(echo, store)
    for _ in range(2):
        answer = await call(app, "POST", "/pay", headers=keyed("k"), body=b"{}")
        unknown = assert_problem(answer, 424, "outcome-unknown")
        assert (unknown["key_state"], unknown["reason"]) == ("outcome_unknown", "lease_expired")
        assert unknown["since"] and unknown["attempt"] == 1
    assert echo.calls["k"] == 0


async def test_expired_in_flight_key_is_taken_over_where_the_route_retries(
    echo: EchoApp, store: GatewayStore
) -> None:
    dead = await reserved_by_a_dead_gateway(store, "k")
    app = gateway(echo, store, RoutePolicy(prefix="/", on_unknown="retry"))
    live = await call(app, "POST", "/pay", headers=keyed("k"), body=b"{}")
    assert live.status == 200
    assert echo.calls["k"] == 1
    assert echo.seen_headers[-1]["idempotency-key"] == "k"
    replay = await store.decide(dead, timeout=30)
    assert replay.outcome is Outcome.REPLAY and replay.attempt == 2


@pytest.mark.timeout(120)
async def test_gateway_renews_its_lease_while_the_upstream_is_slow(
    echo: EchoApp, store: GatewayStore
) -> None:
    app = gateway(echo, store, inflight_lease_seconds=1.5)
    first = asyncio.create_task(call(app, "POST", "/slow", headers=keyed("k"), query="delay=4"))
    await asyncio.wait_for(echo.started.wait(), 20)

    async def past_the_first_lease() -> bool:
        # By the database clock: from here on only the gateway's renewals keep the key.
        record = await store.get_key("default", "k", timeout=30)
        assert record is not None and record.reserved_at is not None
        return record.now > record.reserved_at + 1.5

    await wait_until(past_the_first_lease, timeout=30)
    second = await call(app, "POST", "/slow", headers=keyed("k"), query="delay=4")
    assert_problem(second, 409, "in-flight")
    assert (await first).status == 200
    assert echo.calls["k"] == 1


async def test_works_as_starlette_middleware(store: GatewayStore) -> None:
    executions = 0

    async def create(request: Request) -> JSONResponse:
        nonlocal executions
        executions += 1
        return JSONResponse({"created": await request.json(), "n": executions}, status_code=201)

    app = Starlette(routes=[Route("/cases", create, methods=["POST"])])
    app.add_middleware(FenceGateMiddleware, store=store, store_timeout=30.0)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        headers = {"Idempotency-Key": "case-1"}
        first = await client.post("/cases", json={"customer": "c-1"}, headers=headers)
        again = await client.post("/cases", json={"customer": "c-1"}, headers=headers)
        bad = await client.post("/cases", json={"customer": "c-2"}, headers=headers)
    assert first.status_code == again.status_code == 201
    assert again.json() == first.json() == {"created": {"customer": "c-1"}, "n": 1}
    assert again.headers["idempotent-replayed"] == "true"
    assert bad.status_code == 422 and bad.headers["content-type"] == PROBLEM
    assert executions == 1
