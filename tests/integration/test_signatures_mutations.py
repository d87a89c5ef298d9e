"""Property: whatever one changes in a signed request after signing, the gateway refuses it."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fencegate.problems import Problem
from fencegate.signing import HttpSigner, SignatureAuthenticator, load_authenticator
from fencegate.store import open_gateway_store
from fencegate.store.migrations import migrate
from fencegate.types import IncomingRequest

SECRET = bytes(range(7, 39))
AUTH = load_authenticator(
    [
        {
            "id": "k1",
            "tenant": "acme",
            "alg": "hmac-sha256",
            "secret": base64.b64encode(SECRET).decode(),
        }
    ]
)
SIGNER = HttpSigner(key_id="k1", secret=SECRET)

token = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_:", min_size=1, max_size=20)
printable = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=30
)


@st.composite
def signed_requests(draw: st.DrawFn) -> IncomingRequest:
    method = draw(st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE"]))
    path = "/" + "/".join(draw(st.lists(token, min_size=1, max_size=3)))
    query = draw(st.sampled_from(["", "a=1", "customer=c-1048&x=y"]))
    headers: dict[str, str] = {"content-type": "application/json"}
    if draw(st.booleans()):
        headers["idempotency-key"] = draw(printable)
    if draw(st.booleans()):
        headers["x-execution-fence"] = str(draw(st.integers(0, 2**63 - 1)))
    if draw(st.booleans()):
        headers["x-execution-entity"] = draw(printable)
    body = draw(st.binary(max_size=64))
    url = f"http://127.0.0.1:8080{path}" + (f"?{query}" if query else "")
    SIGNER.sign(method, url, headers, body)
    return IncomingRequest(
        method=method,
        scheme="http",
        authority="127.0.0.1:8080",
        path=path,
        query_string=query,
        headers=tuple((k.lower(), v) for k, v in headers.items()),
        body=body,
    )


def _set_header(request: IncomingRequest, name: str, value: str | None) -> IncomingRequest:
    # Replace in place: a header's position is not part of what is signed.
    headers = [(k, value if k == name else v) for k, v in request.headers]
    kept = [(k, v) for k, v in headers if v is not None]
    if value is not None and name not in dict(request.headers):
        kept.append((name, value))
    return dataclasses.replace(request, headers=tuple(kept))


def _flip(text: str, position: int) -> str:
    index = position % len(text)
    replacement = "A" if text[index] != "A" else "B"
    return text[:index] + replacement + text[index + 1 :]


@st.composite
def mutations(draw: st.DrawFn, request: IncomingRequest) -> IncomingRequest:
    kind = draw(
        st.sampled_from(
            [
                "method",
                "path",
                "query",
                "authority",
                "scheme",
                "body",
                "covered-header",
                "drop-covered-header",
                "add-fence-header",
                "signature-bytes",
                "signature-input",
            ]
        )
    )
    header = dict(request.headers)
    if kind == "method":
        other = draw(st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE"]))
        return dataclasses.replace(request, method=other)
    if kind == "path":
        return dataclasses.replace(
            request, path=request.path + draw(st.sampled_from(["x", "/", "/.."]))
        )
    if kind == "query":
        return dataclasses.replace(request, query_string=draw(st.sampled_from(["", "a=2", "b=1"])))
    if kind == "authority":
        return dataclasses.replace(
            request, authority=draw(st.sampled_from(["127.0.0.1:8081", "evil.example"]))
        )
    if kind == "scheme":
        return dataclasses.replace(request, scheme="https")
    if kind == "body":
        return dataclasses.replace(request, body=draw(st.binary(max_size=64)))
    covered = [
        h
        for h in ("idempotency-key", "x-execution-fence", "x-execution-entity", "content-digest")
        if h in header
    ]
    if kind == "covered-header":
        name = draw(st.sampled_from(covered))
        return _set_header(request, name, draw(printable))
    if kind == "drop-covered-header":
        return _set_header(request, draw(st.sampled_from(covered)), None)
    if kind == "add-fence-header":
        missing = [
            h
            for h in ("idempotency-key", "x-execution-fence", "x-execution-entity")
            if h not in header
        ]
        assume(missing)
        return _set_header(request, draw(st.sampled_from(missing)), "1")
    if kind == "signature-bytes":
        value = header["signature"]
        raw = bytearray(base64.b64decode(value.split(":")[1]))
        raw[draw(st.integers(0, len(raw) - 1))] ^= 1 << draw(st.integers(0, 7))
        return _set_header(request, "signature", f"sig1=:{base64.b64encode(bytes(raw)).decode()}:")
    value = header["signature-input"]
    params_at = value.index(")") + 1
    return _set_header(
        request,
        "signature-input",
        value[:params_at] + _flip(value[params_at:], draw(st.integers(0, 200))),
    )


def test_every_mutation_of_a_signed_request_is_refused(tmp_path: Path) -> None:
    assert isinstance(AUTH, SignatureAuthenticator)
    url = f"sqlite:///{tmp_path / 'nonces.db'}"
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(migrate(url))
        store = loop.run_until_complete(open_gateway_store(url, run_migrations=False))

        @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(data=st.data())
        def check(data: st.DataObject) -> None:
            original = data.draw(signed_requests())
            mutated = data.draw(mutations(original))
            assume(mutated != original)
            with pytest.raises(Problem) as caught:
                loop.run_until_complete(AUTH.authenticate(mutated, store))
            assert caught.value.status == 401
            # The untouched request still passes: the refusal was the mutation's doing.
            assert loop.run_until_complete(AUTH.authenticate(original, store)) == "acme"

        check()
        loop.run_until_complete(store.close())
    finally:
        loop.close()
