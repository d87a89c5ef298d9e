"""The signature check on its own, against the real gateway store (SQLite and PostgreSQL)."""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import os
from typing import Any, cast
from urllib.parse import urlsplit

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from http_message_signatures import ContentDigest

from fencegate.gateway.middleware import FenceGateMiddleware
from fencegate.problems import Problem
from fencegate.signing import HttpSigner, SignatureAuthenticator, load_authenticator
from fencegate.store import GatewayStore
from fencegate.types import IncomingRequest, Receive, Scope, Send

SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(1, 33))
ED_KEY = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(100, 132)))
URL = "http://127.0.0.1:8080/v1/cases?customer=c-1048"


def ed_public_b64(key: ed25519.Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


KEYS = [
    {"id": "acme-1", "tenant": "acme", "alg": "hmac-sha256", "secret": base64.b64encode(SECRET)},
    {"id": "acme-ed", "tenant": "acme", "alg": "ed25519", "public_key": ed_public_b64(ED_KEY)},
    {
        "id": "globex-1",
        "tenant": "globex",
        "alg": "hmac-sha256",
        "secret": base64.b64encode(OTHER_SECRET),
    },
]
KEYS = [
    {k: v.decode() if isinstance(v, bytes) else v for k, v in entry.items()}
    for entry in cast(list[dict[str, Any]], KEYS)
]


def authenticator(**kwargs: object) -> SignatureAuthenticator:
    auth = load_authenticator(KEYS, **kwargs)  # type: ignore[arg-type]
    assert isinstance(auth, SignatureAuthenticator)
    return auth


def incoming(method: str, url: str, headers: dict[str, str], body: bytes) -> IncomingRequest:
    parts = urlsplit(url)
    return IncomingRequest(
        method=method,
        scheme=parts.scheme,
        authority=parts.netloc,
        path=parts.path or "/",
        query_string=parts.query,
        headers=tuple((k.lower(), v) for k, v in headers.items()),
        body=body,
    )


def fenced_headers() -> dict[str, str]:
    return {
        "Idempotency-Key": "tool-job:8f1b7c3d:create_case",
        "X-Execution-Fence": "42",
        "X-Execution-Entity": "customer:c-1048",
        "Content-Type": "application/json",
    }


def signed(
    signer: HttpSigner,
    *,
    method: str = "POST",
    url: str = URL,
    headers: dict[str, str] | None = None,
    body: bytes = b'{"title":"refund"}',
    created: datetime.datetime | None = None,
) -> tuple[dict[str, str], bytes]:
    headers = fenced_headers() if headers is None else headers
    signer.prepare_and_sign(method, url, headers, body, created=created)
    return headers, body


async def reject(
    auth: SignatureAuthenticator, request: IncomingRequest, store: GatewayStore
) -> Problem:
    with pytest.raises(Problem) as caught:
        await auth.authenticate(request, store)
    assert caught.value.status == 401
    return caught.value


@pytest.mark.parametrize(
    ("signer", "tenant"),
    [
        (HttpSigner(key_id="acme-1", secret=SECRET), "acme"),
        (HttpSigner(key_id="acme-ed", private_key=ED_KEY), "acme"),
        (HttpSigner(key_id="globex-1", secret=OTHER_SECRET), "globex"),
        (HttpSigner(key_id="acme-1", secret=SECRET, digest="sha-512"), "acme"),
    ],
    ids=["hmac", "ed25519", "other-tenant", "sha-512-digest"],
)
async def test_a_signed_request_names_its_tenant(
    store: GatewayStore, signer: HttpSigner, tenant: str
) -> None:
    headers, body = signed(signer)
    assert await authenticator().authenticate(incoming("POST", URL, headers, body), store) == tenant


async def test_the_same_signed_request_twice_is_a_replay(store: GatewayStore) -> None:
    auth = authenticator()
    headers, body = signed(HttpSigner(key_id="acme-1", secret=SECRET))
    request = incoming("POST", URL, headers, body)
    assert await auth.authenticate(request, store) == "acme"
    problem = await reject(auth, request, store)
    assert problem.kind == "nonce-replayed"


async def test_a_rejected_forgery_does_not_burn_the_genuine_nonce(store: GatewayStore) -> None:
    auth = authenticator()
    headers, body = signed(HttpSigner(key_id="acme-1", secret=SECRET))
    forged = incoming("POST", URL, headers, body + b" ")
    assert (await reject(auth, forged, store)).kind == "digest-mismatch"
    assert await auth.authenticate(incoming("POST", URL, headers, body), store) == "acme"


@pytest.mark.parametrize(
    ("case", "kind"),
    [
        ("no-signature", "signature-missing"),
        ("wrong-secret", "signature-invalid"),
        ("unknown-key", "unknown-key"),
        ("body-changed", "digest-mismatch"),
        ("digest-header-changed", "signature-invalid"),
        ("fence-changed", "signature-invalid"),
        ("entity-changed", "signature-invalid"),
        ("key-changed", "signature-invalid"),
        ("target-uri-changed", "signature-invalid"),
        ("method-changed", "signature-invalid"),
        ("too-old", "signature-expired"),
        ("in-the-future", "signature-expired"),
        ("fence-not-covered", "component-missing"),
        ("signature-header-only", "signature-invalid"),
        ("alg-mismatch", "signature-invalid"),
    ],
)
async def test_each_way_to_cheat_is_refused(store: GatewayStore, case: str, kind: str) -> None:
    auth = authenticator()
    signer = HttpSigner(key_id="acme-1", secret=SECRET)
    method, url, body = "POST", URL, b'{"title":"refund"}'
    created = None
    if case == "too-old":
        created = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=120)
    if case == "in-the-future":
        created = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=60)
    if case == "wrong-secret":
        signer = HttpSigner(key_id="acme-1", secret=OTHER_SECRET)
    if case == "unknown-key":
        signer = HttpSigner(key_id="nobody", secret=SECRET)
    if case == "alg-mismatch":
        signer = HttpSigner(key_id="acme-1", private_key=ED_KEY)
    headers = fenced_headers()
    if case == "fence-not-covered":
        del headers["X-Execution-Fence"]
    signer.prepare_and_sign(method, url, headers, body, created=created)
    if case == "no-signature":
        del headers["Signature"], headers["Signature-Input"]
    elif case == "signature-header-only":
        del headers["Signature-Input"]
    elif case == "body-changed":
        body = b'{"title":"refund twice"}'
    elif case == "digest-header-changed":
        headers["Content-Digest"] = ContentDigest.create(b'{"title":"refund twice"}')
    elif case == "fence-changed":
        headers["X-Execution-Fence"] = "43"
    elif case == "entity-changed":
        headers["X-Execution-Entity"] = "customer:c-9999"
    elif case == "key-changed":
        headers["Idempotency-Key"] = "tool-job:8f1b7c3d:create_case2"
    elif case == "target-uri-changed":
        url = URL.replace("c-1048", "c-1049")
    elif case == "method-changed":
        method = "PUT"
    elif case == "fence-not-covered":
        headers["X-Execution-Fence"] = "9"
    problem = await reject(auth, incoming(method, url, headers, body), store)
    assert problem.kind == kind, problem.detail
    body_json = problem.to_dict()
    assert body_json["type"].endswith("/" + kind)
    assert base64.b64encode(SECRET).decode() not in repr(body_json)


async def test_a_signature_without_nonce_is_refused(store: GatewayStore) -> None:
    from http_message_signatures import HTTPMessageSigner, MappingKeyResolver, algorithms

    from fencegate.signing.message import SignedMessage

    headers = fenced_headers()
    body = b"{}"
    signer = HTTPMessageSigner(
        signature_algorithm=algorithms.HMAC_SHA256,
        key_resolver=MappingKeyResolver(public_keys={}, private_keys={"acme-1": SECRET}),
    )
    signer.sign(
        SignedMessage("POST", URL, headers),
        key_id="acme-1",
        created=datetime.datetime.now(datetime.UTC),
        covered_component_ids=(
            "@method",
            "@target-uri",
            "idempotency-key",
            "x-execution-fence",
            "x-execution-entity",
        ),
        body=body,
    )
    problem = await reject(authenticator(), incoming("POST", URL, headers, body), store)
    assert problem.kind == "component-missing"
    assert "nonce" in problem.detail


async def test_rotation_accepts_old_and_new_key_of_a_tenant(store: GatewayStore) -> None:
    auth = authenticator()
    for signer in (
        HttpSigner(key_id="acme-1", secret=SECRET),
        HttpSigner(key_id="acme-ed", private_key=ED_KEY),
    ):
        headers, body = signed(signer)
        assert await auth.authenticate(incoming("POST", URL, headers, body), store) == "acme"


async def test_public_base_url_restores_the_address_the_worker_signed(store: GatewayStore) -> None:
    public = "https://api.example.com/billing"
    headers, body = signed(
        HttpSigner(key_id="acme-1", secret=SECRET), url=public + "/v1/cases?customer=c-1048"
    )
    # What the gateway sees behind the TLS-terminating proxy that strips /billing:
    behind = incoming("POST", URL, headers, body)
    assert (await reject(authenticator(), behind, store)).kind == "signature-invalid"
    auth = authenticator(public_base_url=public)
    assert await auth.authenticate(behind, store) == "acme"


async def test_skew_window_is_configurable(store: GatewayStore) -> None:
    created = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=90)
    headers, body = signed(HttpSigner(key_id="acme-1", secret=SECRET), created=created)
    request = incoming("POST", URL, headers, body)
    assert (await reject(authenticator(), request, store)).kind == "signature-expired"
    assert await authenticator(skew_past=300).authenticate(request, store) == "acme"


async def test_the_nonce_is_remembered_for_the_whole_window(store: GatewayStore) -> None:
    auth = authenticator(skew_past=60, skew_future=5)
    assert auth.nonce_ttl_seconds >= 65
    assert await store.remember_nonce(
        "acme-1", "n-1", auth.nonce_ttl_seconds, tenant="acme", timeout=10
    )
    assert not await store.remember_nonce(
        "acme-1", "n-1", auth.nonce_ttl_seconds, tenant="acme", timeout=10
    )


def test_secrets_stay_out_of_reprs() -> None:
    auth = authenticator()
    signer = HttpSigner(key_id="acme-1", secret=SECRET)
    text = repr(auth) + repr(signer) + repr(list(auth.keys))
    for secret in (SECRET, OTHER_SECRET):
        assert base64.b64encode(secret).decode() not in text
        assert repr(secret) not in text
    assert "acme-1" in repr(signer)


def test_signer_adds_exactly_the_signature_headers() -> None:
    headers = fenced_headers()
    HttpSigner(key_id="acme-1", secret=SECRET).sign("POST", URL, headers, b"{}")
    assert set(headers) - set(fenced_headers()) == {
        "Content-Digest",
        "Signature-Input",
        "Signature",
    }
    assert headers["Signature-Input"].startswith(
        'sig1=("@method" "@target-uri" "content-digest" "idempotency-key" '
        '"x-execution-fence" "x-execution-entity");created='
    )
    assert 'keyid="acme-1"' in headers["Signature-Input"]
    assert 'alg="hmac-sha256"' in headers["Signature-Input"]
    assert ';nonce="' in headers["Signature-Input"]


def test_signing_twice_replaces_the_old_signature() -> None:
    signer = HttpSigner(key_id="acme-1", secret=SECRET)
    headers = fenced_headers()
    signer.sign("POST", URL, headers, b"one")
    first = dict(headers)
    signer.sign("POST", URL, headers, b"two")
    assert headers["Content-Digest"] != first["Content-Digest"]
    assert headers["Signature"] != first["Signature"]
    assert len([k for k in headers if k.lower() == "signature"]) == 1


def test_signing_key_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FENCEGATE_SIGNING_KEY_ID", "acme-1")
    monkeypatch.setenv("FENCEGATE_SIGNING_SECRET", base64.b64encode(SECRET).decode())
    monkeypatch.delenv("FENCEGATE_SIGNING_SECRET_FILE", raising=False)
    monkeypatch.delenv("FENCEGATE_SIGNING_ALG", raising=False)
    signer = HttpSigner.from_env()
    assert (signer.key_id, signer.alg) == ("acme-1", "hmac-sha256")


def test_short_hmac_secrets_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 32 bytes"):
        HttpSigner(key_id="k", secret=os.urandom(16))


# The test vector printed in docs/guides/signing.md for implementers in other languages.
VECTOR_BODY = b'{"customer_id":"c-1048","subject":"refund"}'
VECTOR_BASE = (
    '"@method": POST\n'
    '"@target-uri": https://api.example.com/v1/cases?notify=false\n'
    '"content-digest": sha-256=:1Ro28gPIrvv9OQQxtuOTiYuNcdMilPfoIbvcDZt3r34=:\n'
    '"idempotency-key": tool-job:8f1b7c3d:create_case\n'
    '"x-execution-fence": 42\n'
    '"x-execution-entity": customer:c-1048\n'
    '"@signature-params": ("@method" "@target-uri" "content-digest" "idempotency-key" '
    '"x-execution-fence" "x-execution-entity");created=1767225600;keyid="acme-2026-01";'
    'alg="hmac-sha256";nonce="c2f0b1c8e4a94f0e"'
)
VECTOR_SIGNATURE = "sig1=:jjcees7bUC4LuPFQL049IGk+2noAVSLmMPgLZneMmKc=:"
VECTOR_ED25519_SIGNATURE = (
    "sig1=:qznTCp+iZV3jhOY5iT9xGdMP3Vs5lqBsclY9SFQg5LnJ"
    "O5zBtvmUh72/qnKeTuVJLux23mqkOGNoSv7oHsp9Bw==:"
)


def vector_headers() -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "Idempotency-Key": "tool-job:8f1b7c3d:create_case",
        "X-Execution-Fence": "42",
        "X-Execution-Entity": "customer:c-1048",
    }


@pytest.mark.parametrize(
    ("signer", "expected"),
    [
        (HttpSigner(key_id="acme-2026-01", secret=bytes(range(32))), VECTOR_SIGNATURE),
        (
            HttpSigner(
                key_id="acme-2026-01",
                private_key=ed25519.Ed25519PrivateKey.from_private_bytes(bytes(range(32, 64))),
            ),
            VECTOR_ED25519_SIGNATURE,
        ),
    ],
    ids=["hmac-sha256", "ed25519"],
)
def test_documented_test_vector(signer: HttpSigner, expected: str) -> None:
    headers = vector_headers()
    prepared = signer.prepare_and_sign(
        "POST",
        "https://API.example.com:443/v1/cases?notify=false",  # normalised before signing
        headers,
        VECTOR_BODY,
        created=datetime.datetime.fromtimestamp(1767225600, datetime.UTC),
        nonce="c2f0b1c8e4a94f0e",
    )
    assert prepared.signature_base.decode() == VECTOR_BASE.replace(
        'alg="hmac-sha256"', f'alg="{signer.alg}"'
    )
    assert headers["Signature"] == expected
    if signer.alg == "hmac-sha256":
        # Nothing but the standard library, as a Go or Node signer would do it.
        mac = hmac.new(bytes(range(32)), VECTOR_BASE.encode("ascii"), hashlib.sha256).digest()
        assert expected == f"sig1=:{base64.b64encode(mac).decode()}:"


async def test_the_test_vector_verifies_at_the_gateway(store: GatewayStore) -> None:
    auth = load_authenticator(
        [
            {
                "id": "acme-2026-01",
                "tenant": "acme",
                "alg": "hmac-sha256",
                "secret": base64.b64encode(bytes(range(32))).decode(),
            }
        ],
        skew_past=10**10,  # the vector's `created` is fixed in the past
        public_base_url="https://api.example.com",
    )
    assert auth is not None
    headers = vector_headers()
    headers["Content-Digest"] = "sha-256=:1Ro28gPIrvv9OQQxtuOTiYuNcdMilPfoIbvcDZt3r34=:"
    headers["Signature-Input"] = "sig1=" + VECTOR_BASE.rsplit('"@signature-params": ', 1)[1]
    headers["Signature"] = VECTOR_SIGNATURE
    request = incoming("POST", "http://127.0.0.1:8080/v1/cases?notify=false", headers, VECTOR_BODY)
    assert await auth.authenticate(request, store) == "acme"


async def test_middleware_in_process_service(store: GatewayStore) -> None:
    """FenceGateMiddleware with this authenticator: the wrapped app only sees verified calls."""
    seen: list[dict[str, str]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"created"})

    wrapped = FenceGateMiddleware(app, store=store, authenticator=authenticator())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=wrapped), base_url="http://service.internal"
    ) as client:
        body = b'{"title":"refund"}'
        headers = fenced_headers()
        HttpSigner(key_id="acme-1", secret=SECRET).sign(
            "POST", "http://service.internal/v1/cases", headers, body
        )
        assert (await client.post("/v1/cases", headers=headers, content=body)).status_code == 201
        unsigned = await client.post("/v1/cases", headers=fenced_headers(), content=body)
    assert unsigned.status_code == 401
    assert unsigned.json()["type"].endswith("/signature-missing")
    assert len(seen) == 1
    assert "signature" not in seen[0] and "signature-input" not in seen[0]
    assert seen[0]["idempotency-key"] == "tool-job:8f1b7c3d:create_case"
