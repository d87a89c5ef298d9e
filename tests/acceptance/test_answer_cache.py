"""The gateway's copies of completed answers (fencegate/gateway/answers.py), on real
`fencegate serve` processes and both stores: a replay without a fence is answered from the
copy (the metric counts it, the store is not asked, its history row still arrives), and
every guarantee of the decision order holds as without it: a stale fence is 412, another
request under the key is 422, another tenant sees nothing, a key expires on time, and what an
operator does from another process is never hidden behind a copy."""

from __future__ import annotations

import base64
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from fencegate.signing import HttpSigner
from tests.support.gateway import GatewayProcess
from tests.support.processes import fencegate
from tests.support.upstream import UpstreamProcess
from tests.support.waits import wait_until_sync

pytestmark = pytest.mark.timeout(120)

BODY = b'{"amount": 100}'


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamProcess]:
    with UpstreamProcess() as process:
        yield process


def metric(client: httpx.Client, name: str, labels: str = "") -> float:
    text = client.get("/metrics").text
    found = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


HITS = "fencegate_answer_cache_hits_total"
DECIDES = "fencegate_store_latency_seconds_count"


def history(url: str, key: str, tenant: str = "default") -> list[dict[str, Any]]:
    done = fencegate("keys", "show", key, "--tenant", tenant, "--database-url", url, "--json")
    assert done.returncode == 0, done.stderr
    return list(orjson.loads(done.stdout)["history"])


def test_replays_come_from_the_copy_and_keep_their_history(
    upstream: UpstreamProcess, store_url: str
) -> None:
    key = f"cache-{uuid.uuid4().hex[:8]}"
    with GatewayProcess(upstream=upstream.url, database_url=store_url) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            first = client.post("/x", content=BODY, headers={"Idempotency-Key": key})
            assert first.status_code == 200 and "idempotent-replayed" not in first.headers
            decides = metric(client, DECIDES, '{operation="decide"}')
            for _ in range(3):
                again = client.post("/x", content=BODY, headers={"Idempotency-Key": key})
                assert again.status_code == 200
                assert again.headers["idempotent-replayed"] == "true"
                assert again.content == first.content
            assert metric(client, HITS) == 3.0
            # The store was not asked: no decision went to it for the replays.
            assert metric(client, DECIDES, '{operation="decide"}') == decides
    assert upstream.count(key) == 1
    # Each replay's history row arrives, written in the background (and on the clean stop).
    rows = wait_until_sync(
        lambda: [r for r in history(store_url, key) if r["what"] == "replay"],
        timeout=20,
        what="the replays' history rows",
        interval=0.05,
    )
    assert len(rows) == 3


def test_another_request_under_the_key_is_still_refused(
    upstream: UpstreamProcess, store_url: str
) -> None:
    key = f"cache-{uuid.uuid4().hex[:8]}"
    with GatewayProcess(upstream=upstream.url, database_url=store_url) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            assert client.post("/x", content=BODY, headers={"Idempotency-Key": key}).is_success
            other = client.post("/x", content=b'{"amount": 999}', headers={"Idempotency-Key": key})
            assert other.status_code == 422
            assert other.json()["type"].endswith("/key-reused")
            elsewhere = client.post("/y", content=BODY, headers={"Idempotency-Key": key})
            assert elsewhere.status_code == 422
            assert metric(client, HITS) == 2.0
    assert upstream.count(key) == 1


def test_a_stale_fence_is_still_refused(upstream: UpstreamProcess, store_url: str) -> None:
    key = f"cache-{uuid.uuid4().hex[:8]}"
    entity = f"order:{key}"
    with GatewayProcess(upstream=upstream.url, database_url=store_url) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=30) as client:

            def send(fence: int | None, the_key: str = key) -> httpx.Response:
                headers = {"Idempotency-Key": the_key, "X-Execution-Entity": entity}
                if fence is not None:
                    headers["X-Execution-Fence"] = str(fence)
                return client.post("/x", content=BODY, headers=headers)

            assert send(5).status_code == 200
            assert send(None).headers["idempotent-replayed"] == "true"  # from the copy
            stale = send(3)
            assert stale.status_code == 412
            assert stale.json()["last_accepted_fence"] == 5
            # Another key raised the entity's fence: the same key with its old fence is stale.
            assert send(7, f"{key}-later").status_code == 200
            assert send(5).status_code == 412
            assert send(7).headers["idempotent-replayed"] == "true"
            assert metric(client, HITS) == 1.0
    assert upstream.count(key) == 1


def test_a_copy_ends_with_its_key(upstream: UpstreamProcess, store_url: str) -> None:
    key = f"cache-{uuid.uuid4().hex[:8]}"
    args = ["--key-ttl-seconds", "1"]
    with GatewayProcess(upstream=upstream.url, database_url=store_url, extra_args=args) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=30) as client:

            def send() -> httpx.Response:
                return client.post("/x", content=BODY, headers={"Idempotency-Key": key})

            first = send()
            assert "idempotent-replayed" not in first.headers
            assert send().headers["idempotent-replayed"] == "true"
            assert metric(client, HITS) == 1.0
            # Once the key expired the request runs again (the copy did not outlive it).
            wait_until_sync(
                lambda: "idempotent-replayed" not in send().headers,
                timeout=20,
                what="a second execution",
                interval=0.05,
            )
    assert upstream.count(key) == 2


SECRETS = {"acme": bytes(range(32)), "globex": bytes(range(64, 96))}


def test_another_tenant_sees_nothing(
    upstream: UpstreamProcess, store_url: str, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(
        "".join(
            f'[[keys]]\nid = "{tenant}-1"\ntenant = "{tenant}"\nalg = "hmac-sha256"\n'
            f'secret = "{base64.b64encode(secret).decode()}"\n\n'
            for tenant, secret in SECRETS.items()
        )
    )
    key = f"cache-{uuid.uuid4().hex[:8]}"
    args = ["--keys", str(keys)]
    with GatewayProcess(upstream=upstream.url, database_url=store_url, extra_args=args) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=30) as client:

            def send(tenant: str, body: bytes = BODY) -> httpx.Response:
                headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
                signer = HttpSigner(key_id=f"{tenant}-1", secret=SECRETS[tenant])
                signer.sign("POST", f"{gateway.url}/x", headers, body)
                return client.post("/x", content=body, headers=headers)

            assert "idempotent-replayed" not in send("acme").headers
            assert send("acme").headers["idempotent-replayed"] == "true"
            # The same key under another tenant is a new key: forwarded, not acme's answer.
            globex = send("globex")
            assert globex.status_code == 200 and "idempotent-replayed" not in globex.headers
            # And another request under it is globex's own business, not a 422 from acme's.
            assert send("globex").headers["idempotent-replayed"] == "true"
            assert metric(client, HITS) == 2.0
    assert upstream.count(key) == 2


def test_an_operator_in_another_process_is_never_hidden_by_a_copy(
    upstream: UpstreamProcess, store_url: str
) -> None:
    """What operators can do to a key from another process, and what a gateway holding copies
    answers afterwards: a completed key (the only kind copied) is left as it is by every
    action (resolve, forced or not, and purge); a key whose outcome is unknown, which is
    never copied, is answered as the operator settled it."""
    done_key = f"cache-{uuid.uuid4().hex[:8]}"
    unknown_key = f"cache-{uuid.uuid4().hex[:8]}"
    store = ["--database-url", store_url]
    args = ["--upstream-timeout", "0.5"]
    with GatewayProcess(upstream=upstream.url, database_url=store_url, extra_args=args) as gateway:
        with httpx.Client(base_url=gateway.url, timeout=30) as client:

            def send(key: str, **headers: str) -> httpx.Response:
                extra = {name.replace("_", "-"): value for name, value in headers.items()}
                return client.post("/x", content=BODY, headers={"Idempotency-Key": key, **extra})

            first = send(done_key)
            assert send(done_key).headers["idempotent-replayed"] == "true"
            before = history(store_url, done_key)
            for action in (
                ["keys", "resolve", done_key, "--release", "--force", *store],
                ["keys", "resolve", done_key, "--completed", "--status", "201", "--force", *store],
                ["keys", "resolve", done_key, "--release", *store],
                ["purge", *store],
            ):
                done = fencegate(*action)
                if action[0] == "purge":
                    assert done.returncode == 0, done.stderr
                else:  # refused: the key is completed, and left as it is
                    assert done.returncode == 2 and "is completed" in done.stderr, (action, done)
                shown = fencegate("keys", "show", done_key, *store, "--json")
                record = orjson.loads(shown.stdout)
                assert (record["state"], record["response_status"]) == ("completed", 200), action
                replayed = send(done_key)
                assert replayed.headers["idempotent-replayed"] == "true"
                assert replayed.content == first.content
            assert [r["what"] for r in history(store_url, done_key)][: len(before)] == [
                r["what"] for r in before
            ]

            # A key whose outcome is unknown: 504, then 424 until an operator settles it.
            assert send(unknown_key, X_Upstream_Delay="3").status_code == 504
            assert send(unknown_key).status_code == 424
            resolved = fencegate(
                "keys", "resolve", unknown_key, "--completed", "--status", "201",
                "--body", '{"settled": true}', "--force", *store,
            )  # fmt: skip
            assert resolved.returncode == 0, resolved.stderr
            settled = send(unknown_key)
            assert settled.status_code == 201 and settled.json() == {"settled": True}
            assert settled.headers["idempotent-replayed"] == "true"

            released_key = f"{unknown_key}-r"
            assert send(released_key, X_Upstream_Delay="3").status_code == 504
            released = fencegate("keys", "resolve", released_key, "--release", "--force", *store)
            assert released.returncode == 0, released.stderr
            again = send(released_key)
            assert again.status_code == 200 and "idempotent-replayed" not in again.headers
    assert upstream.count(done_key) == 1
    assert upstream.count(released_key) == 2
