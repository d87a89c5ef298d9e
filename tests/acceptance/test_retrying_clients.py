"""Real retrying clients through `fencegate serve`, in front of a payments API that does not
deduplicate by itself: whatever the upstream does (charges and drops the connection, answers
after the route's timeout, fails once with a 500), the charge runs exactly once, and the
caller's final answer says what happened. On SQLite and on PostgreSQL, default settings."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import stripe
from requests.adapters import HTTPAdapter
from stripe.params import ChargeCreateParams
from urllib3.util.retry import Retry

from tests.support.gateway import GatewayProcess
from tests.support.payments import PaymentsProcess


@pytest.fixture(scope="module")
def payments() -> Iterator[PaymentsProcess]:
    with PaymentsProcess() as process:
        yield process


@pytest.fixture
def gateway(store_url: str, payments: PaymentsProcess, tmp_path: Path) -> Iterator[str]:
    # Only the route's timeout is set (1 s, below the fake's late answer); on_unknown is the
    # default.
    routes = tmp_path / "routes.toml"
    routes.write_text('[[routes]]\nprefix = "/v1"\ntimeout = 1\n', encoding="utf-8")
    with GatewayProcess(
        upstream=payments.url, database_url=store_url, config=routes, workdir=tmp_path
    ) as process:
        yield process.url


def stripe_client(base: str) -> stripe.StripeClient:
    return stripe.StripeClient(
        "sk_test_fencegate",
        base_addresses={"api": base},
        max_network_retries=3,  # the SDK adds an Idempotency-Key and reuses it on retries
        http_client=stripe.RequestsClient(),
    )


def charge(client: stripe.StripeClient) -> stripe.Charge:
    return client.v1.charges.create(params={"amount": 1000, "currency": "usd", "source": "tok"})


@pytest.mark.parametrize("mode", ["drop", "late"])
def test_stripe_sdk_gets_one_charge_and_outcome_unknown_when_the_answer_is_lost(
    mode: str, gateway: str, payments: PaymentsProcess
) -> None:
    payments.set_mode(mode)
    before = payments.counts()
    with pytest.raises(stripe.StripeError) as raised:
        charge(stripe_client(gateway))
    after = payments.counts()
    # The SDK retried the 504 with the same key; the gateway forwarded nothing again.
    assert after["charges"] - before["charges"] == 1
    assert after["attempts"] - before["attempts"] == 1
    error = raised.value
    assert error.http_status == 424, error.http_body
    body = error.json_body
    assert isinstance(body, dict), error.http_body
    assert body["type"].endswith("/outcome-unknown")
    assert body["reason"] == "upstream_timeout"
    assert "fencegate keys resolve" in body["detail"]


def test_stripe_sdk_charges_once_when_the_upstream_fails_once(
    gateway: str, payments: PaymentsProcess
) -> None:
    payments.set_mode("fail_once")
    before = payments.counts()
    result = charge(stripe_client(gateway))
    after = payments.counts()
    assert result.object == "charge" and result.amount == 1000
    # The 500 charged nothing and was not stored: the SDK's retry ran the one charge.
    assert after["charges"] - before["charges"] == 1
    assert after["attempts"] - before["attempts"] == 2


def test_stripe_sdk_replays_a_recorded_charge(gateway: str, payments: PaymentsProcess) -> None:
    payments.set_mode("ok")
    key = f"charge-{uuid.uuid4().hex}"
    client = stripe_client(gateway)
    params: ChargeCreateParams = {"amount": 1000, "currency": "usd", "source": "tok"}
    first = client.v1.charges.create(params=params, options={"idempotency_key": key})
    before = payments.counts()
    again = client.v1.charges.create(params=params, options={"idempotency_key": key})
    assert again.id == first.id
    assert payments.counts() == before


@pytest.mark.parametrize("mode", ["drop", "late"])
def test_urllib3_retries_get_one_charge_and_a_final_424(
    mode: str, gateway: str, payments: PaymentsProcess
) -> None:
    payments.set_mode(mode)
    retry = Retry(
        total=4,
        allowed_methods=None,  # POST too: the caller sends an Idempotency-Key
        status_forcelist=[500, 502, 503, 504],
        backoff_factor=0.05,
        raise_on_status=False,
    )
    session = requests.Session()
    session.mount("http://", HTTPAdapter(max_retries=retry))
    before = payments.counts()
    answer = session.post(
        gateway + "/v1/charges",
        data={"amount": "500"},
        headers={"Idempotency-Key": f"urllib3-{uuid.uuid4().hex}"},
        timeout=30,
    )
    after = payments.counts()
    assert after["charges"] - before["charges"] == 1
    assert answer.status_code == 424, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["type"].endswith("/outcome-unknown")
