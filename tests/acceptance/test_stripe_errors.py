"""A route with ``error_format = "stripe"``: the real `stripe` SDK, through a real
`fencegate serve`, in front of a payments API that does not deduplicate, reads every gateway
error as the Stripe error it means (reused key → `IdempotencyError`, in flight → retried until
the first answer replays, outcome unknown → an error whose message says what happened, …)."""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import stripe
from stripe.params import ChargeCreateParams

from fencegate.gateway.config import ConfigError, load_config
from tests.support.gateway import GatewayProcess
from tests.support.net import TcpRelay
from tests.support.payments import LATE_SECONDS, PaymentsProcess
from tests.support.waits import wait_until_sync

PARAMS: ChargeCreateParams = {"amount": 1000, "currency": "usd", "source": "tok"}


def body_of(error: stripe.StripeError) -> dict[str, Any]:
    """The answer's JSON, as the SDK parsed it."""
    assert isinstance(error.json_body, dict), error.http_body
    return error.json_body


# The upstream answers within a second or the outcome is unknown.
ROUTES = '[[routes]]\nprefix = "/v1"\ntimeout = {timeout}\nerror_format = "stripe"\n'


@pytest.fixture(scope="module")
def payments() -> Iterator[PaymentsProcess]:
    with PaymentsProcess() as process:
        yield process


@pytest.fixture
def gateway(store_url: str, payments: PaymentsProcess, tmp_path: Path) -> Iterator[GatewayProcess]:
    routes = tmp_path / "routes.toml"
    routes.write_text(ROUTES.format(timeout=1), encoding="utf-8")
    with GatewayProcess(
        upstream=payments.url, database_url=store_url, config=routes, workdir=tmp_path
    ) as process:
        yield process


def client(base: str, *, retries: int = 3) -> stripe.StripeClient:
    return stripe.StripeClient(
        "sk_test_fencegate",
        base_addresses={"api": base},
        max_network_retries=retries,
        http_client=stripe.RequestsClient(),
    )


def decided(gateway: GatewayProcess, decision: str, expected: int) -> int:
    """How many decision-log lines say ``decision``, once ``expected`` of them are there (or
    the deadline passed): the log writes one event-loop turn's lines together, so a line can
    reach the file just after its answer reached the client."""

    def count() -> int:
        pattern = rf"fencegate\.decisions: decision decision={decision} "
        return len(re.findall(pattern, gateway.log_text()))

    try:
        wait_until_sync(lambda: count() >= expected, timeout=5, what=f"{expected} {decision}")
    except AssertionError:
        pass  # the caller's assertion says what was found instead
    return count()


def test_reused_key_raises_idempotency_error(
    gateway: GatewayProcess, payments: PaymentsProcess
) -> None:
    payments.set_mode("ok")
    key = f"reuse-{uuid.uuid4().hex}"
    sdk = client(gateway.url)
    sdk.v1.charges.create(params=PARAMS, options={"idempotency_key": key})
    before = payments.counts()
    with pytest.raises(stripe.IdempotencyError) as raised:
        other: ChargeCreateParams = {"amount": 2000, "currency": "usd", "source": "tok"}
        sdk.v1.charges.create(params=other, options={"idempotency_key": key})
    error = raised.value
    assert error.http_status == 400
    assert error.error is not None and error.error.code == "key_reused"
    assert error.request_id == error.headers["x-request-id"]  # type: ignore[index]
    assert error.headers is not None and error.headers["stripe-should-retry"] == "false"
    assert error.headers["content-type"] == "application/json"
    assert error.headers["x-request-id"]
    assert error.json_body is not None
    assert body_of(error)["error"]["type"] == "idempotency_error"
    assert body_of(error)["error"]["doc_url"].endswith("/problems/key-reused")
    assert "different method, path, query or body" in str(error.user_message)
    assert payments.counts() == before
    assert decided(gateway, "key_reused", 1) == 1  # not retried


@pytest.mark.parametrize("mode", ["drop", "late"])
def test_outcome_unknown_says_what_happened_and_charges_once(
    mode: str, gateway: GatewayProcess, payments: PaymentsProcess
) -> None:
    payments.set_mode(mode)
    before = payments.counts()
    with pytest.raises(stripe.APIError) as raised:
        client(gateway.url).v1.charges.create(params=PARAMS)
    after = payments.counts()
    assert after["charges"] - before["charges"] == 1
    assert after["attempts"] - before["attempts"] == 1
    error = raised.value
    # The SDK retried the 504 with the same key; the retry learnt the outcome is unknown.
    assert error.http_status == 424
    assert error.error is not None and error.error.code == "outcome_unknown"
    assert error.headers is not None and error.headers["stripe-should-retry"] == "false"
    assert error.json_body is not None
    body = body_of(error)["error"]
    assert body["type"] == "api_error" and body["reason"] == "upstream_timeout"
    message = str(error.user_message)
    assert "may have run upstream" in message and "fencegate keys resolve" in message
    assert decided(gateway, "outcome_unknown", 1) == 1


def test_in_flight_is_409_idempotency_error_and_the_sdk_gets_the_first_answer(
    store_url: str, payments: PaymentsProcess, tmp_path: Path
) -> None:
    payments.set_mode("late")
    routes = tmp_path / "routes.toml"
    routes.write_text(ROUTES.format(timeout=LATE_SECONDS + 7), encoding="utf-8")
    key = f"inflight-{uuid.uuid4().hex}"
    first: list[stripe.Charge] = []
    with GatewayProcess(
        upstream=payments.url, database_url=store_url, config=routes, workdir=tmp_path
    ) as gateway:
        before = payments.counts()
        sdk = client(gateway.url, retries=0)
        thread = threading.Thread(
            target=lambda: first.append(
                sdk.v1.charges.create(params=PARAMS, options={"idempotency_key": key})
            )
        )
        thread.start()
        wait_until_sync(
            lambda: payments.counts()["attempts"] != before["attempts"],
            timeout=10,
            what="the first request reaching the upstream",
        )

        conflict = httpx.post(
            gateway.url + "/v1/charges",
            content=b"amount=1000&currency=usd&source=tok",  # the SDK's own encoding
            headers={"Idempotency-Key": key},
            timeout=30,
        )
        # Stripe's SDK retries the 409 (as the header says) until the first answer replays.
        again = client(gateway.url, retries=8).v1.charges.create(
            params=PARAMS, options={"idempotency_key": key}
        )
        thread.join(timeout=LATE_SECONDS + 10)
    assert conflict.status_code == 409, conflict.text
    assert conflict.headers["content-type"] == "application/json"
    assert conflict.headers["stripe-should-retry"] == "true"
    assert int(conflict.headers["retry-after"]) >= 1
    error = conflict.json()["error"]
    assert (error["type"], error["code"]) == ("idempotency_error", "idempotency_key_in_use")
    assert first and again.id == first[0].id
    assert payments.counts()["charges"] - before["charges"] == 1


def test_invalid_request_and_stale_fence(
    gateway: GatewayProcess, payments: PaymentsProcess
) -> None:
    payments.set_mode("ok")
    sdk = client(gateway.url)
    with pytest.raises(stripe.InvalidRequestError) as raised:
        sdk.v1.charges.create(params=PARAMS, options={"headers": {"X-Execution-Fence": "-1"}})
    assert raised.value.http_status == 400
    invalid = raised.value.error
    assert invalid is not None and invalid.code == "invalid_header"
    assert invalid.param == "X-Execution-Fence"

    entity = {"X-Execution-Entity": f"invoice:{uuid.uuid4().hex}"}
    sdk.v1.charges.create(params=PARAMS, options={"headers": {"X-Execution-Fence": "7", **entity}})
    with pytest.raises(stripe.APIError) as stale:
        sdk.v1.charges.create(
            params=PARAMS, options={"headers": {"X-Execution-Fence": "6", **entity}}
        )
    assert stale.value.http_status == 412
    assert stale.value.error is not None and stale.value.error.code == "stale_fence"
    assert stale.value.json_body is not None
    assert body_of(stale.value)["error"]["last_accepted_fence"] == 7
    assert "a newer holder owns this work" in str(stale.value.user_message)


def through(relay: TcpRelay, url: str) -> str:
    parts = urlsplit(url)
    user = parts.netloc.rpartition("@")[0]
    netloc = f"{user}@127.0.0.1:{relay.port}" if user else f"127.0.0.1:{relay.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def test_store_unavailable_is_a_retried_api_error(
    pg_url: str, payments: PaymentsProcess, tmp_path: Path
) -> None:
    payments.set_mode("ok")
    routes = tmp_path / "routes.toml"
    routes.write_text(ROUTES.format(timeout=1), encoding="utf-8")
    parts = urlsplit(pg_url)
    with TcpRelay(parts.hostname or "127.0.0.1", parts.port or 5432) as relay:
        gateway = GatewayProcess(
            upstream=payments.url,
            database_url=through(relay, pg_url),
            config=routes,
            workdir=tmp_path,
            extra_args=["--store-timeout", "1"],
        )
        with gateway:
            before = payments.counts()
            relay.cut()
            with pytest.raises(stripe.APIError) as raised:
                client(gateway.url, retries=2).v1.charges.create(params=PARAMS)
            relay.heal()
            error = raised.value
            assert error.http_status == 503
            assert error.error is not None and error.error.code == "store_unavailable"
            assert error.headers is not None
            assert error.headers["stripe-should-retry"] == "true"
            assert error.headers["retry-after"] == "1"
            assert error.json_body is not None
            assert body_of(error)["error"]["type"] == "api_error"
            assert decided(gateway, "store_unavailable", 3) == 3  # the SDK retried twice
            assert payments.counts() == before  # nothing forwarded it could not record
            charge = client(gateway.url, retries=5).v1.charges.create(params=PARAMS)
            assert charge.object == "charge"


def test_a_route_without_error_format_answers_problems(tmp_path: Path) -> None:
    routes = tmp_path / "routes.toml"
    routes.write_text(ROUTES.format(timeout=1) + '\n[[routes]]\nprefix = "/p"\n')
    config = load_config({"config": routes, "upstream": "http://u"})
    assert [r.error_format for r in config.policies()] == ["stripe", "problem"]
    assert config.default_policy().error_format == "problem"
    routes.write_text('[[routes]]\nprefix = "/v1"\nerror_format = "xml"\n')
    refused = r"routes\[0\]\.error_format: Input should be 'problem' or 'stripe'"
    with pytest.raises(ConfigError, match=refused):
        load_config({"config": routes, "upstream": "http://u"})
