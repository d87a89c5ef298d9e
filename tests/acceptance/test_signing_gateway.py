"""Signed requests through a real `fencegate serve --keys` process in front of a real
upstream that counts what it executes."""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import datetime
import hashlib
import hmac
import os
import shlex
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from http_message_signatures import ContentDigest

from fencegate.commands import sign as sign_command
from fencegate.signing import HttpSigner
from tests.acceptance.lease.test_client import KEY as JOB_KEY
from tests.acceptance.lease.test_client import make_job
from tests.support.gateway import GatewayProcess
from tests.support.net import TcpRelay
from tests.support.upstream import UpstreamProcess

ACME_SECRET = bytes(range(32))
GLOBEX_SECRET = bytes(range(64, 96))
ACME_ED = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(128, 160)))
PATH = "/v1/cases"

ACME = HttpSigner(key_id="acme-2026-01", secret=ACME_SECRET)
ACME_NEW = HttpSigner(key_id="acme-2026-07", private_key=ACME_ED)
GLOBEX = HttpSigner(key_id="globex-1", secret=GLOBEX_SECRET)


def write_keys(directory: Path) -> Path:
    (directory / "acme.secret").write_text(base64.b64encode(ACME_SECRET).decode() + "\n")
    public = ACME_ED.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    (directory / "acme-2026-07.pub").write_bytes(public)
    keys = directory / "keys.toml"
    keys.write_text(
        f"""
[[keys]]
id = "acme-2026-01"
tenant = "acme"
alg = "hmac-sha256"
secret_file = "acme.secret"

[[keys]]
id = "acme-2026-07"
tenant = "acme"
alg = "ed25519"
public_key_file = "acme-2026-07.pub"

[[keys]]
id = "globex-1"
tenant = "globex"
alg = "hmac-sha256"
secret = "{base64.b64encode(GLOBEX_SECRET).decode()}"
"""
    )
    return keys


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamProcess]:
    with UpstreamProcess() as process:
        yield process


def start_gateway(upstream: UpstreamProcess, directory: Path, database_url: str) -> GatewayProcess:
    return GatewayProcess(
        upstream=upstream.url,
        database_url=database_url,
        extra_args=["--keys", str(write_keys(directory))],
    )


@pytest.fixture(scope="module")
def gateway(
    upstream: UpstreamProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    directory = tmp_path_factory.mktemp("signing-gateway")
    with start_gateway(upstream, directory, f"sqlite:///{directory / 'gateway.db'}") as process:
        yield process


@pytest.fixture
def client(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        yield http


def fence_headers(key: str, *, fence: int = 1, entity: str | None = None) -> dict[str, str]:
    # One entity per key unless a test shares one on purpose: the gateway is shared.
    return {
        "Idempotency-Key": key,
        "X-Execution-Fence": str(fence),
        "X-Execution-Entity": entity or f"entity:{key}",
        "Content-Type": "application/json",
    }


def send(
    client: httpx.Client,
    headers: dict[str, str],
    body: bytes,
    *,
    method: str = "POST",
    path: str = PATH,
) -> httpx.Response:
    return client.request(method, path, headers=headers, content=body)


def signed_send(
    client: httpx.Client,
    signer: HttpSigner,
    key: str,
    *,
    body: bytes = b'{"title":"refund"}',
    **fence: Any,
) -> httpx.Response:
    headers = fence_headers(key, **fence)
    signer.sign("POST", str(client.base_url) + PATH, headers, body)
    return send(client, headers, body)


def problem_kind(response: httpx.Response) -> str:
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert body["status"] == response.status_code
    return str(body["type"]).rsplit("/", 1)[-1]


@pytest.mark.parametrize("signer", [ACME, ACME_NEW], ids=["hmac-sha256", "ed25519"])
def test_round_trip_with_each_algorithm(
    client: httpx.Client, upstream: UpstreamProcess, signer: HttpSigner
) -> None:
    key = f"round-trip:{signer.alg}"
    response = signed_send(client, signer, key)
    assert response.status_code == 200, response.text
    assert upstream.count(key) == 1
    forwarded = {name for name, _ in response.json()["headers"]}
    # Verified signature headers are not forwarded; the digest and fence headers are.
    assert "signature" not in forwarded and "signature-input" not in forwarded
    assert {"content-digest", "idempotency-key", "x-execution-fence"} <= forwarded

    retried = signed_send(client, signer, key)  # a retry signs afresh: same key, new nonce
    assert retried.status_code == 200
    assert retried.headers.get("idempotent-replayed") == "true"
    assert upstream.count(key) == 1


Cheat = Callable[[str, dict[str, str], bytes], tuple[str, dict[str, str], bytes]]


def _sign(signer: HttpSigner, url: str, headers: dict[str, str], body: bytes, **kw: Any) -> None:
    signer.prepare_and_sign("POST", url, headers, body, **kw)


def _ago(seconds: float) -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=seconds)


def no_signature(
    url: str, headers: dict[str, str], body: bytes
) -> tuple[str, dict[str, str], bytes]:
    return url, headers, body


def wrong_secret(
    url: str, headers: dict[str, str], body: bytes
) -> tuple[str, dict[str, str], bytes]:
    _sign(HttpSigner(key_id=ACME.key_id, secret=GLOBEX_SECRET), url, headers, body)
    return url, headers, body


def unknown_key(
    url: str, headers: dict[str, str], body: bytes
) -> tuple[str, dict[str, str], bytes]:
    _sign(HttpSigner(key_id="acme-2025-01", secret=ACME_SECRET), url, headers, body)
    return url, headers, body


def body_changed(
    url: str, headers: dict[str, str], body: bytes
) -> tuple[str, dict[str, str], bytes]:
    _sign(ACME, url, headers, body)
    return url, headers, b'{"title":"refund","amount":1000000}'


def digest_header_changed(
    url: str, headers: dict[str, str], body: bytes
) -> tuple[str, dict[str, str], bytes]:
    _sign(ACME, url, headers, body)
    forged = b'{"title":"refund","amount":1000000}'
    headers["Content-Digest"] = ContentDigest.create(forged)
    return url, headers, forged


def fence_changed(
    url: str, headers: dict[str, str], body: bytes
) -> tuple[str, dict[str, str], bytes]:
    _sign(ACME, url, headers, body)
    headers["X-Execution-Fence"] = str(int(headers["X-Execution-Fence"]) + 1000)
    return url, headers, body


def entity_changed(
    url: str, headers: dict[str, str], body: bytes
) -> tuple[str, dict[str, str], bytes]:
    _sign(ACME, url, headers, body)
    headers["X-Execution-Entity"] = "customer:c-9999"
    return url, headers, body


def target_uri_changed(
    url: str, headers: dict[str, str], body: bytes
) -> tuple[str, dict[str, str], bytes]:
    _sign(ACME, url, headers, body)
    return url.replace(PATH, "/v1/refunds"), headers, body


def too_old(url: str, headers: dict[str, str], body: bytes) -> tuple[str, dict[str, str], bytes]:
    _sign(ACME, url, headers, body, created=_ago(120))
    return url, headers, body


def in_the_future(
    url: str, headers: dict[str, str], body: bytes
) -> tuple[str, dict[str, str], bytes]:
    _sign(ACME, url, headers, body, created=_ago(-60))
    return url, headers, body


def component_omitted(
    url: str, headers: dict[str, str], body: bytes
) -> tuple[str, dict[str, str], bytes]:
    fence = headers.pop("X-Execution-Fence")
    _sign(ACME, url, headers, body)
    headers["X-Execution-Fence"] = fence  # sent, but not covered by the signature
    return url, headers, body


@pytest.mark.parametrize(
    ("cheat", "kind"),
    [
        (no_signature, "signature-missing"),
        (wrong_secret, "signature-invalid"),
        (unknown_key, "unknown-key"),
        (body_changed, "digest-mismatch"),
        (digest_header_changed, "signature-invalid"),
        (fence_changed, "signature-invalid"),
        (entity_changed, "signature-invalid"),
        (target_uri_changed, "signature-invalid"),
        (too_old, "signature-expired"),
        (in_the_future, "signature-expired"),
        (component_omitted, "component-missing"),
    ],
    ids=lambda value: getattr(value, "__name__", value),
)
def test_each_way_to_cheat_is_refused_before_the_upstream(
    client: httpx.Client, upstream: UpstreamProcess, cheat: Cheat, kind: str
) -> None:
    key = f"cheat:{kind}:{cheat.__name__}"
    before = upstream.total_requests()
    url, headers, body = cheat(
        str(client.base_url) + PATH, fence_headers(key, fence=7), b'{"title":"refund"}'
    )
    response = client.post(url, headers=headers, content=body)
    assert response.status_code == 401, response.text
    assert problem_kind(response) == kind
    assert upstream.total_requests() == before
    assert upstream.count(key) == 0
    # Nothing was stored either: the honest request with the same key runs once, now.
    honest = signed_send(client, ACME, key, fence=7)
    assert honest.status_code == 200, honest.text
    assert "idempotent-replayed" not in honest.headers
    assert upstream.count(key) == 1


def test_the_same_signed_request_sent_twice_is_refused(
    client: httpx.Client, upstream: UpstreamProcess
) -> None:
    key = "cheat:replay"
    headers = fence_headers(key)
    body = b'{"title":"refund"}'
    ACME.sign("POST", str(client.base_url) + PATH, headers, body)
    assert send(client, headers, body).status_code == 200
    before = upstream.total_requests()
    replay = send(client, dict(headers), body)
    assert replay.status_code == 401
    assert problem_kind(replay) == "nonce-replayed"
    assert upstream.total_requests() == before


def test_tenants_with_the_same_key_and_entity_are_independent(
    client: httpx.Client, upstream: UpstreamProcess
) -> None:
    key, entity = "tool-job:shared:create_case", "customer:shared"
    first = signed_send(client, ACME, key, fence=50, entity=entity)
    assert first.status_code == 200, first.text
    assert first.json()["execution"] == 1
    # Globex's own request, same key and entity, lower fence: neither a replay nor stale.
    other = signed_send(client, GLOBEX, key, fence=5, entity=entity)
    assert other.status_code == 200, other.text
    assert "idempotent-replayed" not in other.headers
    assert other.json()["execution"] == 2
    assert upstream.count(key) == 2
    # Acme's own fence still holds for acme ...
    stale = signed_send(client, ACME, key + ":next", fence=5, entity=entity)
    assert stale.status_code == 412
    assert problem_kind(stale) == "stale-fence"
    # ... and globex keeps its own lineage, replays included.
    assert signed_send(client, GLOBEX, key + ":next", fence=6, entity=entity).status_code == 200
    replay = signed_send(client, GLOBEX, key, fence=6, entity=entity)
    assert replay.headers.get("idempotent-replayed") == "true"
    assert replay.json()["execution"] == 2
    assert upstream.count(key) == 2


def test_rotation_old_and_new_key_are_one_tenant(
    client: httpx.Client, upstream: UpstreamProcess
) -> None:
    key = "rotation:create_case"
    old = signed_send(client, ACME, key, fence=3, entity="rotation")
    assert old.status_code == 200, old.text
    new = signed_send(client, ACME_NEW, key, fence=3, entity="rotation")
    assert new.status_code == 200, new.text
    # The new key speaks for the same tenant: it sees the old key's record.
    assert new.headers.get("idempotent-replayed") == "true"
    assert upstream.count(key) == 1
    stale = signed_send(client, ACME_NEW, "rotation:other", fence=2, entity="rotation")
    assert stale.status_code == 412


async def test_round_trip_and_replay_on_postgresql(
    pg_url: str, upstream: UpstreamProcess, tmp_path: Path
) -> None:
    with start_gateway(upstream, tmp_path, pg_url) as gateway:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            headers = fence_headers("pg:round-trip")
            body = b'{"title":"refund"}'
            ACME_NEW.sign("POST", gateway.url + PATH, headers, body)
            first = await http.post(PATH, headers=headers, content=body)
            assert first.status_code == 200, first.text
            again = await http.post(PATH, headers=headers, content=body)
            assert again.status_code == 401
            assert problem_kind(again) == "nonce-replayed"
    assert upstream.count("pg:round-trip") == 1


async def test_worker_clients_sign_automatically(
    gateway: GatewayProcess, upstream: UpstreamProcess
) -> None:
    """The job's aiohttp and httpx clients sign what they send; the gateway accepts it."""
    async with aiohttp.ClientSession() as session:
        job = make_job(session, signer=ACME_NEW)
        path = "/v1/cases/c-1048/notes?lang=en&tag=a%20b"
        response = await job.http(entity="worker:aiohttp").post(
            gateway.url + path, json={"note": "called back"}, step="aiohttp"
        )
        assert response.status == 200, await response.text()
        async with httpx.AsyncClient(auth=job.httpx_auth(entity="worker:httpx")) as client:
            answer = await client.post(
                gateway.url + path, json={"note": "x"}, extensions={"fencegate_step": "httpx"}
            )
        assert answer.status_code == 200, answer.text
    assert upstream.count(f"{JOB_KEY}:aiohttp") == 1
    assert upstream.count(f"{JOB_KEY}:httpx") == 1


def test_a_signer_written_from_the_documented_recipe_is_accepted(
    client: httpx.Client, upstream: UpstreamProcess
) -> None:
    """What another language does: build the base by hand, HMAC it with the standard library."""
    created, nonce = int(time.time()), "doc-recipe-" + os.urandom(6).hex()
    body = b'{"title":"refund"}'
    digest = "sha-256=:" + base64.b64encode(hashlib.sha256(body).digest()).decode() + ":"
    target = f"{client.base_url}".rstrip("/") + PATH + "?source=go"
    components = (
        '("@method" "@target-uri" "content-digest" '
        '"idempotency-key" "x-execution-fence" "x-execution-entity")'
    )
    params = (
        f'{components};created={created};keyid="{ACME.key_id}";alg="hmac-sha256";nonce="{nonce}"'
    )
    base = (
        '"@method": POST\n'
        f'"@target-uri": {target}\n'
        f'"content-digest": {digest}\n'
        '"idempotency-key": recipe:1\n'
        '"x-execution-fence": 9\n'
        '"x-execution-entity": invoice:inv-1042\n'
        f'"@signature-params": {params}'
    )
    mac = hmac.new(ACME_SECRET, base.encode("ascii"), hashlib.sha256).digest()
    headers = {
        "Idempotency-Key": "recipe:1",
        "X-Execution-Fence": "9",
        "X-Execution-Entity": "invoice:inv-1042",
        "Content-Digest": digest,
        "Signature-Input": f"sig1={params}",
        "Signature": f"sig1=:{base64.b64encode(mac).decode()}:",
    }
    response = client.post(PATH + "?source=go", headers=headers, content=body)
    assert response.status_code == 200, response.text
    assert upstream.count("recipe:1") == 1


def test_secrets_never_reach_the_gateway_log(gateway: GatewayProcess) -> None:
    log = gateway.log_text()
    assert "signatures required: 3 keys for 2 tenants" in log
    for secret in (ACME_SECRET, GLOBEX_SECRET):
        assert base64.b64encode(secret).decode() not in log


def test_the_curl_line_from_fencegate_sign_goes_through(
    client: httpx.Client,
    upstream: UpstreamProcess,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    secret = tmp_path / "acme.secret"
    secret.write_text(base64.b64encode(ACME_SECRET).decode())
    url = f"{client.base_url}".rstrip("/") + PATH
    parser = argparse.ArgumentParser()
    sign_command.add_arguments(parser)
    argv = ["--key-id", ACME.key_id, "--secret-file", str(secret), "-d", '{"via":"curl"}']
    argv += ["--idempotency-key", "curl:1", "--fence", "1", "--entity", "curl", "--curl", url]
    assert sign_command.run(parser.parse_args(argv)) == 0
    words = shlex.split(capsys.readouterr().out)
    # Replay the printed command line word for word (curl -X M -H ... --data-binary D URL).
    method = words[words.index("-X") + 1]
    headers = [
        (name, value)
        for i, w in enumerate(words)
        if w == "-H"
        for name, _, value in [words[i + 1].partition(": ")]
    ]
    data = words[words.index("--data-binary") + 1].encode()
    response = client.request(method, words[-1], headers=headers, content=data)
    assert response.status_code == 200, response.text
    assert upstream.count("curl:1") == 1


async def test_a_nonce_that_cannot_be_recorded_is_never_forwarded(
    pg_url: str, upstream: UpstreamProcess, tmp_path: Path
) -> None:
    parts = urlsplit(pg_url)
    with TcpRelay(parts.hostname or "127.0.0.1", parts.port or 5432) as relay:
        relayed = pg_url.replace(f"{parts.hostname}:{parts.port}", f"127.0.0.1:{relay.port}")
        with start_gateway(upstream, tmp_path, relayed) as gateway:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
                body = b'{"title":"refund"}'
                headers = fence_headers("pg:cut:before")
                ACME.sign("POST", gateway.url + PATH, headers, body)
                assert (await http.post(PATH, headers=headers, content=body)).status_code == 200
                relay.cut()
                headers = fence_headers("pg:cut:after")
                ACME.sign("POST", gateway.url + PATH, headers, body)
                response = await http.post(PATH, headers=headers, content=body)
    assert response.status_code == 503, response.text
    assert problem_kind(response) == "store-unavailable"
    assert upstream.count("pg:cut:after") == 0


async def test_a_captured_request_raced_in_parallel_runs_once(
    gateway: GatewayProcess, upstream: UpstreamProcess
) -> None:
    key = "cheat:race"
    headers = fence_headers(key)
    body = b'{"title":"refund"}'
    ACME.sign("POST", gateway.url + PATH, headers, body)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        answers = await asyncio.gather(
            *(http.post(PATH, headers=headers, content=body) for _ in range(8))
        )
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200] + [401] * 7
    assert {problem_kind(a) for a in answers if a.status_code == 401} == {"nonce-replayed"}
    assert upstream.count(key) == 1


@pytest.mark.parametrize("form", ["FENCEGATE_KEYS inline", "[keys] in --config"])
def test_keys_from_the_environment_or_the_config_file(
    upstream: UpstreamProcess, tmp_path: Path, form: str
) -> None:
    secret = base64.b64encode(GLOBEX_SECRET).decode()
    entry = f'id = "globex-1"\ntenant = "globex"\nalg = "hmac-sha256"\nsecret = "{secret}"\n'
    env: dict[str, str] = {}
    config: Path | None = None
    if form == "FENCEGATE_KEYS inline":
        env["FENCEGATE_KEYS"] = "[[keys]]\n" + entry
    else:
        (tmp_path / "keys.toml").write_text("[[keys]]\n" + entry)
        config = tmp_path / "fencegate.toml"
        config.write_text('[keys]\nfile = "keys.toml"\n')
    database = f"sqlite:///{tmp_path / 'gateway.db'}"
    with GatewayProcess(upstream=upstream.url, database_url=database, config=config, env=env) as gw:
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            key = f"keys-form:{form}"
            assert signed_send(http, GLOBEX, key).status_code == 200
            unsigned = send(http, fence_headers(key + ":unsigned"), b"{}")
            assert unsigned.status_code == 401
    assert upstream.count(key) == 1


@dataclasses.dataclass
class LibraryRequest:
    """What ``http_message_signatures`` signs: a method, a URL and the headers."""

    method: str
    url: str
    headers: dict[str, str]


def library_signed(url: str, key: str, body: bytes) -> dict[str, str]:
    """Headers signed by the RFC 9421 library itself (not fencegate's signer): it takes
    ``@target-uri`` from the URL as given."""
    from http_message_signatures import HTTPMessageSigner, MappingKeyResolver, algorithms

    headers = fence_headers(key)
    signer = HTTPMessageSigner(
        signature_algorithm=algorithms.HMAC_SHA256,
        key_resolver=MappingKeyResolver(public_keys={}, private_keys={ACME.key_id: ACME_SECRET}),
    )
    signer.sign(
        LibraryRequest("POST", url, headers),
        key_id=ACME.key_id,
        created=datetime.datetime.now(datetime.UTC),
        nonce="lib-" + os.urandom(8).hex(),
        covered_component_ids=(
            "@method",
            "@target-uri",
            "content-digest",
            "idempotency-key",
            "x-execution-fence",
            "x-execution-entity",
        ),
        body=body,  # the library adds Content-Digest
    )
    return headers


@pytest.mark.parametrize(
    ("signed", "sent", "status"),
    [("/v1/q?", "/v1/q?", 200), ("/v1/q?", "/v1/q", 401), ("/v1/q", "/v1/q?", 401)],
)
def test_an_independent_signer_signs_a_lone_question_mark_as_sent(
    gateway: GatewayProcess, upstream: UpstreamProcess, signed: str, sent: str, status: int
) -> None:
    """``/v1/q?`` is forwarded with its "?" and verified with it: a request signed by the
    RFC 9421 library for ``/v1/q?`` goes through; a signature for one target does not pass
    for the other."""
    key = f"lone-question-mark:{uuid.uuid4().hex[:8]}"
    body = b'{"title":"refund"}'
    headers = library_signed(gateway.url + signed, key, body)
    with httpx.Client(timeout=30) as http:
        response = http.post(gateway.url + sent, headers=headers, content=body)
    assert response.status_code == status, response.text
    if status == 401:
        assert problem_kind(response) == "signature-invalid"
    assert upstream.count(key) == (1 if status == 200 else 0)


def test_fencegate_signer_signs_a_lone_question_mark_as_httpx_sends_it(
    gateway: GatewayProcess, upstream: UpstreamProcess
) -> None:
    """httpx sends ``/v1/q?`` as given; fencegate's own signer keeps the "?" too."""
    key = f"own-question-mark:{uuid.uuid4().hex[:8]}"
    body = b'{"title":"refund"}'
    headers = fence_headers(key)
    url = gateway.url + "/v1/q?"
    ACME.sign("POST", url, headers, body)
    with httpx.Client(timeout=30) as http:
        request = http.build_request("POST", url, headers=headers, content=body)
        assert request.url.raw_path == b"/v1/q?"
        response = http.send(request)
    assert response.status_code == 200, response.text
    assert upstream.count(key) == 1
