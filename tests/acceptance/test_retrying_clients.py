"""Real retrying clients through `fencegate serve`, in front of a payments API that does not
deduplicate by itself: whatever the upstream does (charges and drops the connection, answers
after the route's timeout, fails once with a 500), the charge runs exactly once, and the
caller's final answer says what happened. A client polling a key whose first request is a slow
outlier is told to wait longer each time, and gets the answer. On SQLite and on PostgreSQL,
default settings."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import requests
import stripe
import urllib3
from requests.adapters import HTTPAdapter
from stripe.params import ChargeCreateParams
from urllib3.util.retry import Retry

from tests.support.gateway import GatewayProcess
from tests.support.payments import PaymentsProcess
from tests.support.upstream import UpstreamProcess
from tests.support.waits import wait_until_sync


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


def test_urllib3_polling_a_slow_outlier_is_told_to_wait_longer_and_gets_the_answer(
    store_url: str, tmp_path: Path
) -> None:
    """A route whose requests take milliseconds; one request takes 8 s. A second client sends
    the same key with urllib3's ``Retry(total=5, respect_retry_after_header=True)`` retrying
    409s: each 409 in-flight asks it to wait longer than the last once the request has
    outlived the route's usual time, so its five retries reach the answer (a replay) instead
    of giving up after about five seconds of ``Retry-After: 1``."""
    waits: list[float] = []

    class NotingRetry(Retry):
        def sleep_for_retry(self, response: urllib3.BaseHTTPResponse) -> bool:
            waits.append(self.get_retry_after(response) or 0.0)
            return super().sleep_for_retry(response)

    key = f"outlier-{uuid.uuid4().hex}"
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    with (
        UpstreamProcess() as upstream,
        GatewayProcess(upstream=upstream.url, database_url=store_url, workdir=tmp_path) as gw,
        ThreadPoolExecutor(1) as pool,
    ):
        with httpx.Client(base_url=gw.url, timeout=10) as client:
            for n in range(5):  # what the route usually takes
                warm = client.post("/charges", headers={"Idempotency-Key": f"{key}-{n}"}, json={})
                assert warm.status_code == 200, warm.text

        def slow() -> httpx.Response:
            with httpx.Client(base_url=gw.url, timeout=30) as client:
                return client.post("/charges?delay=8", headers=headers, content=b"{}")

        first = pool.submit(slow)
        wait_until_sync(lambda: upstream.count(key) == 1, timeout=10, what="the slow request")
        started = time.monotonic()
        retry = NotingRetry(
            total=5,
            status_forcelist=[409],
            allowed_methods=None,  # POST too: it carries an Idempotency-Key
            respect_retry_after_header=True,
        )
        with urllib3.PoolManager(retries=retry) as http:
            polled = http.request(
                "POST", gw.url + "/charges?delay=8", body=b"{}", headers=headers, timeout=30
            )
        waited = time.monotonic() - started
        assert first.result(timeout=30).status_code == 200
        executed = upstream.count(key)
    assert polled.status == 200, polled.data
    assert polled.headers["idempotent-replayed"] == "true"
    assert executed == 1
    assert 2 <= len(waits) <= 5, waits
    assert waits == sorted(waits) and waits[-1] >= 4, waits  # longer as the request ages
    assert waited < 2 * 8 + 2, (waited, waits)  # and not for much longer than it took
