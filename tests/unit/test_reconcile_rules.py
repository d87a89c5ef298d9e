"""A route's ``reconcile`` option: the probe's target filled in from the stored request (each
value percent-encoded as one path segment), what its statuses mean, a function's result held
to the contract, and a bad option refused at start with the field named."""

from __future__ import annotations

import hashlib
from pathlib import Path

import orjson
import pytest

from fencegate.gateway.config import ConfigError, load_config
from fencegate.gateway.reconcile import (
    CallableProbe,
    Executed,
    HttpProbe,
    MissingValue,
    NotExecuted,
    StoredRequest,
    Unknown,
)
from fencegate.gateway.reconciler import checked_result, probe_request, probe_scope, stored_answer
from fencegate.gateway.routes import RoutePolicy
from tests.support import reconcile_probes

REQUEST = StoredRequest(
    tenant="acme",
    key="order 42/a?b#c%",
    method="POST",
    target="/v1/charges",
    body=orjson.dumps({"customer": {"id": "cus/1 x", "tier": 3}, "amount": 1250, "ok": True}),
    entity="invoice_id:inv-7",
    fence=17,
    attempt=2,
)


def probe(target: str, **more: object) -> HttpProbe:
    return HttpProbe.model_validate({"target": target, "executed": [200], **more})


@pytest.mark.parametrize(
    ("target", "rendered"),
    [
        ("/v1/charges/by-key/{key}", "/v1/charges/by-key/order%2042%2Fa%3Fb%23c%25"),
        ("/v1/invoices/{entity}/fence/{fence}", "/v1/invoices/invoice_id%3Ainv-7/fence/17"),
        ("/v1/customers/{json.customer.id}/charges", "/v1/customers/cus%2F1%20x/charges"),
        ("/t/{json.customer.tier}/{json.amount}/{json.ok}", "/t/3/1250/true"),
        ("/v1/charges?idempotency_key={key}&x=1",
         "/v1/charges?idempotency_key=order%2042%2Fa%3Fb%23c%25&x=1"),
        ("/v1/plain", "/v1/plain"),
    ],
)  # fmt: skip
def test_placeholders_are_filled_each_as_one_encoded_segment(target: str, rendered: str) -> None:
    assert probe(target).render(REQUEST) == rendered


@pytest.mark.parametrize(
    ("target", "request_", "why"),
    [
        ("/e/{entity}", StoredRequest("t", "k", "POST", "/", b"", None, 1, 1), "named no entity"),
        ("/f/{fence}", StoredRequest("t", "k", "POST", "/", b"", "e", None, 1), "no fence"),
        ("/j/{json.id}", StoredRequest("t", "k", "POST", "/", b"amount=1", None, None, 1),
         "not JSON"),
        ("/j/{json.id}", StoredRequest("t", "k", "POST", "/", b"", None, None, 1),
         "no body was stored"),
        ("/j/{json.customer.name}", REQUEST, "no text or number at customer.name"),
        ("/j/{json.customer}", REQUEST, "no text or number at customer"),
        ("/j/{json.amount.cents}", REQUEST, "no field amount.cents"),
    ],
)  # fmt: skip
def test_a_placeholder_without_a_value_says_which(
    target: str, request_: StoredRequest, why: str
) -> None:
    with pytest.raises(MissingValue, match=why):
        probe(target).render(request_)


def test_statuses_say_executed_not_executed_or_nothing() -> None:
    rule = probe("/x", executed=[200, 201], not_executed=[404, 410])
    assert [rule.judge(s) for s in (200, 201, 404, 410, 409, 500, 503, 302)] == [
        "executed", "executed", "not_executed", "not_executed", None, None, None, None,
    ]  # fmt: skip


def test_the_probe_table_defaults_and_normalises() -> None:
    rule = probe("/x/{key}", method="head", headers={"Authorization": "Bearer t"})
    assert rule.method == "HEAD"
    assert rule.not_executed == frozenset()
    assert rule.headers == (("authorization", "Bearer t"),)
    assert rule.describe() == "HEAD /x/{key}"
    # Hashable like the rest of a route (policies are frozen).
    assert hash(RoutePolicy(reconcile=rule))


def test_the_probe_goes_to_the_routes_upstream_as_a_request() -> None:
    policy = RoutePolicy(prefix="/v1", upstream="https://pay.example:8443", reconcile=probe("/x"))
    rule = probe("/x", headers={"Authorization": "Bearer t"})
    request = probe_request(policy, rule, "/v1/charges/by-key/a%2Fb?expand=1")
    assert (request.method, request.scheme, request.authority) == (
        "GET",
        "https",
        "pay.example:8443",
    )
    assert (request.path, request.query_string, request.body) == (
        "/v1/charges/by-key/a%2Fb",
        "expand=1",
        b"",
    )
    assert request.headers == (("authorization", "Bearer t"),)
    scope = probe_scope(request)
    assert (
        scope["raw_path"] == b"/v1/charges/by-key/a%2Fb"
        and scope["path"] == "/v1/charges/by-key/a/b"
    )
    assert scope["query_string"] == b"expand=1" and scope["server"] == ("pay.example", 8443)
    assert scope["headers"] == [(b"authorization", b"Bearer t")]  # fmt: skip


def test_an_executed_answer_is_stored_as_the_engine_stores_one() -> None:
    policy = RoutePolicy(max_stored_body_bytes=8)
    headers = [("Content-Type", "application/json"), ("Set-Cookie", "s=1"), ("Date", "x"),
               ("Content-Length", "2"), ("X-Charge", "ch_1")]  # fmt: skip
    small = stored_answer(Executed(200, headers, b"{}"), policy)
    assert small.status == 200 and small.body == b"{}"
    assert small.headers == [("Content-Type", "application/json"), ("X-Charge", "ch_1")]
    assert small.sha256 == hashlib.sha256(b"{}").hexdigest()
    large = stored_answer(Executed(200, headers, b"x" * 9), policy)
    assert large.body is None and large.sha256 == hashlib.sha256(b"x" * 9).hexdigest()


def test_a_functions_result_is_held_to_the_contract() -> None:
    spec = "m:f"
    assert checked_result(NotExecuted("no"), spec) == NotExecuted("no")
    assert checked_result(Unknown("later"), spec) == Unknown("later")
    ran = checked_result(Executed(201, (("a", "b"),), "é"), spec)  # type: ignore[arg-type]
    assert ran == Executed(201, [("a", "b")], "é".encode(), note="m:f")
    for bad, why in [
        (None, "returned NoneType, not Executed"),
        ({"status": 200}, "returned dict"),
        (Executed(700), "status 700"),
        (Executed(True), "status True"),
        (Executed(200, body=3), "a body of int"),  # type: ignore[arg-type]
    ]:
        result = checked_result(bad, spec)
        assert isinstance(result, Unknown) and why in result.note, (bad, result)


def test_a_function_is_loaded_by_name_and_must_be_async() -> None:
    loaded = CallableProbe.load("tests.support.reconcile_probes:charges_by_key")
    assert loaded.function is reconcile_probes.charges_by_key
    assert loaded.describe() == "tests.support.reconcile_probes:charges_by_key"
    given = RoutePolicy(reconcile=CallableProbe.of(reconcile_probes.always_executed)).reconcile
    assert isinstance(given, CallableProbe) and given.function is reconcile_probes.always_executed
    assert given.describe() == "tests.support.reconcile_probes:always_executed"
    with pytest.raises(ValueError, match="not an async function"):
        CallableProbe.of(reconcile_probes.not_async)


def write(tmp_path: Path, route: str) -> Path:
    path = tmp_path / "routes.toml"
    path.write_text(
        f'[gateway]\nupstream = "http://127.0.0.1:9"\n\n[[routes]]\nprefix = "/v1"\n{route}\n'
    )
    return path


def test_a_config_file_declares_either_kind(tmp_path: Path) -> None:
    table = (
        'reconcile = { target = "/v1/charges/by-key/{key}", executed = [200], '
        "not_executed = [404] }"
    )
    [route] = load_config({"config": write(tmp_path, table)}).policies()
    assert isinstance(route.reconcile, HttpProbe)
    assert route.reconcile.render(REQUEST).startswith("/v1/charges/by-key/order%2042")
    named = 'reconcile = "tests.support.reconcile_probes:charges_by_key"'
    [route] = load_config({"config": write(tmp_path, named)}).policies()
    assert isinstance(route.reconcile, CallableProbe)
    [route] = load_config({"config": write(tmp_path, "")}).policies()
    assert route.reconcile is None


@pytest.mark.parametrize(
    ("route", "message"),
    [
        ('reconcile = { target = "/x" }', "routes[0].reconcile: executed: Field required"),
        ('reconcile = { target = "x/{key}", executed = [200] }',
         "routes[0].reconcile: target: must start with '/'"),
        ('reconcile = { target = "/x/{id}", executed = [200] }',
         "routes[0].reconcile: target: {id} is not a placeholder"),
        ('reconcile = { target = "/x/{json.}", executed = [200] }', "{json.} is not a placeholder"),
        ('reconcile = { target = "/x/{key", executed = [200] }', "unbalanced"),
        ('reconcile = { target = "/x", executed = [] }', "executed: needs at least one status"),
        ('reconcile = { target = "/x", executed = [200], not_executed = [503] }',
         "not_executed: 503 cannot be listed"),
        ('reconcile = { target = "/x", executed = [200, 404], not_executed = [404] }',
         "404 is both executed and not_executed"),
        ('reconcile = { target = "/x", executed = [200], method = "G T" }', "not an HTTP method"),
        ('reconcile = { target = "/x", executed = [200], retries = 3 }',
         "retries: Extra inputs are not permitted"),
        ('reconcile = "no_such_module_here:check"',
         "routes[0].reconcile: cannot import 'no_such_module_here'"),
        ('reconcile = "tests.support.reconcile_probes:missing"', "has no 'missing'"),
        ('reconcile = "tests.support.reconcile_probes:not_async"', "is not an async function"),
        ('reconcile = "check_it"', "neither a probe table nor a function named"),
        ("reconcile = 3", "must be a probe table"),
    ],
)  # fmt: skip
def test_a_bad_reconcile_option_is_refused_with_the_field_named(
    tmp_path: Path, route: str, message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config({"config": write(tmp_path, route)})
    assert message in str(refused.value), str(refused.value)


def test_release_margin_and_reconcile_interval_are_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FENCEGATE_RELEASE_MARGIN", "5")
    config = load_config({"config": write(tmp_path, ""), "reconcile_interval": 0.25})
    assert config.settings.release_margin == 5 and config.settings.reconcile_interval == 0.25
    monkeypatch.delenv("FENCEGATE_RELEASE_MARGIN")
    defaults = load_config({})
    assert defaults.settings.release_margin == 30 and defaults.settings.reconcile_interval == 1
    with pytest.raises(ConfigError, match="release_margin: Input should be greater than or equal"):
        load_config({"release_margin": -1})
