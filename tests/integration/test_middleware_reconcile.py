"""The middleware reconciles too: its probes go to the wrapped app itself (past the
middleware), on SQLite and on PostgreSQL."""

from __future__ import annotations

import uuid

import pytest
from opentelemetry.sdk.trace import ReadableSpan

from fencegate import FencegateMiddleware, tracing
from fencegate.gateway import reconciler as reconciler_module
from fencegate.gateway.reconcile import HttpProbe
from fencegate.gateway.routes import RoutePolicy
from fencegate.store import GatewayStore
from tests.support.asgi import Answer, call
from tests.support.charges import ChargesApp
from tests.support.waits import wait_until

ROUTE = RoutePolicy(
    prefix="/v1",
    timeout=0.5,
    reconcile=HttpProbe(
        target="/v1/charges/by-key/{key}",
        executed=frozenset({200}),
        not_executed=frozenset({404}),
    ),
)


async def post(app: FencegateMiddleware, key: str, *extra: tuple[str, str]) -> Answer:
    headers = [("idempotency-key", key), ("content-type", "application/json"), *extra]
    return await call(app, "POST", "/v1/charges", headers=headers, body=b'{"amount": 7}')


@pytest.mark.parametrize("interval", [0.05, 0.0], ids=["reconciling", "reconciler-off"])
async def test_the_middleware_settles_unknown_outcomes_by_asking_its_app(
    store: GatewayStore, interval: float
) -> None:
    charges = ChargesApp()
    app = FencegateMiddleware(
        charges,
        store=store,
        routes=[ROUTE],
        store_timeout=30.0,
        release_margin=0.2,
        reconcile_interval=interval,
    )
    ran, never = f"ran-{uuid.uuid4().hex[:8]}", f"never-{uuid.uuid4().hex[:8]}"
    try:
        assert (await post(app, ran, ("x-upstream-delay", "3"))).status == 504
        assert (await post(app, never, ("x-upstream-stall", "3"))).status == 504
        assert charges.executions == {ran: 1}
        if interval == 0:
            assert app.reconciler is None
            assert (await post(app, ran)).status == 424  # an operator's to settle
            return

        async def answered(key: str) -> Answer | None:
            answer = await post(app, key)
            return answer if answer.status not in (409, 424, 503) else None

        done = await wait_until(lambda: answered(ran), timeout=30, what="reconciled")
        assert done is not None
        assert done.status == 200 and done.body == charges.answers[ran]
        assert done.header("idempotent-replayed") == "true"
        again = await wait_until(lambda: answered(never), timeout=30, what="released")
        assert again is not None
        assert again.status == 200 and again.header("idempotent-replayed") is None
        assert charges.executions == {ran: 1, never: 1}
    finally:
        await app.close()
    assert app.reconciler is None  # stopped with the middleware


async def test_each_key_asked_about_is_a_span_when_traces_are_on(
    store: GatewayStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    monkeypatch.setattr(tracing, "TRACER", provider.get_tracer("test"))
    charges = ChargesApp()
    app = FencegateMiddleware(
        charges, store=store, routes=[ROUTE], store_timeout=30.0, release_margin=0.2,
        reconcile_interval=0.05,
    )  # fmt: skip
    key = f"traced-{uuid.uuid4().hex[:8]}"
    try:
        assert (await post(app, key, ("x-upstream-delay", "3"))).status == 504

        def reconciled() -> list[ReadableSpan]:
            return [s for s in exported.get_finished_spans() if s.name == "reconcile POST /v1"]

        [span] = await wait_until(reconciled, timeout=30, what="a reconcile span")
    finally:
        await app.close()
    attributes = dict(span.attributes or {})
    assert attributes["fencegate.idempotency_key"] == key
    assert attributes["fencegate.reconcile.result"] == "completed"
    assert attributes["http.response.status_code"] == 200
    assert "answered 200" in str(attributes["fencegate.reconcile.note"])


async def test_a_bug_in_the_reconciler_is_an_internal_error_and_the_key_stays(
    store: GatewayStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*_: object) -> None:
        raise KeyError("status")

    monkeypatch.setattr(reconciler_module, "stored_answer", broken)
    app = FencegateMiddleware(
        ChargesApp(), store=store, routes=[ROUTE], store_timeout=30.0, release_margin=0.2,
        reconcile_interval=0.05,
    )  # fmt: skip
    key = f"bug-{uuid.uuid4().hex[:8]}"
    try:
        assert (await post(app, key, ("x-upstream-delay", "3"))).status == 504

        def counted() -> bool:
            return b'fencegate_internal_errors_total{where="reconcile"}' in app.metrics.render()

        await wait_until(counted, timeout=30, what="the fault counted")
        assert (await post(app, key)).status == 424  # left as it was, for another try
    finally:
        await app.close()
    faults = [r for r in caplog.records if "internal error in reconcile: builtins.KeyError" in
              r.getMessage()]  # fmt: skip
    assert faults and faults[0].exc_info is not None  # the traceback, the first time
