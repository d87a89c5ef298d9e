"""RFC 9421 and RFC 9530 as they are written, not stricter: a request may carry several
signatures (the gateway checks the one for its own keys and ignores the others), and a
Content-Digest may list algorithms the gateway does not support (ignored, as long as one it
supports is there and matches)."""

from __future__ import annotations

import base64
import datetime

import pytest
from http_message_signatures import ContentDigest

from fencegate.signing import HttpSigner
from fencegate.store import GatewayStore
from tests.integration.test_signatures import (
    SECRET,
    URL,
    authenticator,
    fenced_headers,
    incoming,
    reject,
    signed,
)

PROXY_INPUT = 'proxy=("@method" "@target-uri");created={created};keyid="edge-proxy-7"'
PROXY_SIGNATURE = "proxy=:" + base64.b64encode(b"\x01" * 32).decode() + ":"
CRC32C = "crc32c=:AAAAAA==:"


def with_proxy_signature(headers: dict[str, str], *, first: bool) -> dict[str, str]:
    """What a proxy on the way adds: its own signature beside the worker's."""
    created = int(datetime.datetime.now(datetime.UTC).timestamp())
    theirs = (PROXY_INPUT.format(created=created), PROXY_SIGNATURE)
    ours = (headers["Signature-Input"], headers["Signature"])
    pairs = [theirs, ours] if first else [ours, theirs]
    headers["Signature-Input"] = ", ".join(p[0] for p in pairs)
    headers["Signature"] = ", ".join(p[1] for p in pairs)
    return headers


@pytest.mark.parametrize("proxy_first", [True, False], ids=["proxy-first", "proxy-last"])
async def test_the_gateways_signature_is_checked_and_another_ignored(
    store: GatewayStore, proxy_first: bool
) -> None:
    headers, body = signed(HttpSigner(key_id="acme-1", secret=SECRET))
    request = incoming("POST", URL, with_proxy_signature(headers, first=proxy_first), body)
    assert await authenticator().authenticate(request, store) == "acme"


async def test_beside_another_signature_a_forged_one_is_still_refused(
    store: GatewayStore,
) -> None:
    headers, body = signed(HttpSigner(key_id="acme-1", secret=SECRET))
    request = incoming(
        "POST", URL, with_proxy_signature(headers, first=True), b'{"title":"refund twice"}'
    )
    problem = await reject(authenticator(), request, store)
    assert problem.kind in ("signature-invalid", "digest-mismatch")
    assert body != request.body


async def test_several_signatures_none_for_this_gateway_is_unknown_key(
    store: GatewayStore,
) -> None:
    headers, body = signed(HttpSigner(key_id="nobody", secret=SECRET))
    request = incoming("POST", URL, with_proxy_signature(headers, first=False), body)
    problem = await reject(authenticator(), request, store)
    assert problem.kind == "unknown-key" and "edge-proxy" not in str(problem.extensions)


class _Sha256AndCrc32c(ContentDigest):
    """A sender that also lists crc32c (RFC 9530 registry; not supported by the gateway)."""

    @classmethod
    def create(cls, body: bytes) -> str:
        return f"{ContentDigest.create(body)}, {CRC32C}"


class _Crc32cOnly(ContentDigest):
    @classmethod
    def create(cls, body: bytes) -> str:
        return CRC32C


def digest_signer(digest: type[ContentDigest]) -> HttpSigner:
    signer = HttpSigner(key_id="acme-1", secret=SECRET)
    signer._signer.content_digest_class = digest
    return signer


async def test_an_unsupported_digest_beside_a_supported_one_is_ignored(
    store: GatewayStore,
) -> None:
    headers, body = signed(digest_signer(_Sha256AndCrc32c))
    assert CRC32C in headers["Content-Digest"]
    assert await authenticator().authenticate(incoming("POST", URL, headers, body), store) == "acme"


async def test_the_supported_digest_must_still_match(store: GatewayStore) -> None:
    headers, _ = signed(digest_signer(_Sha256AndCrc32c))
    request = incoming("POST", URL, headers, b'{"title":"refund twice"}')
    assert (await reject(authenticator(), request, store)).kind == "digest-mismatch"


async def test_a_digest_with_only_unsupported_algorithms_is_refused(store: GatewayStore) -> None:
    headers, body = signed(digest_signer(_Crc32cOnly), headers=fenced_headers())
    problem = await reject(authenticator(), incoming("POST", URL, headers, body), store)
    assert problem.kind == "digest-mismatch"
