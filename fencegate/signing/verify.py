"""Step 1 of the gateway's decision order: check the RFC 9421 signature, return the tenant.

The checks run cheapest and least stateful first, and the nonce is remembered only once
everything else has passed, so a forged request can never burn a genuine worker's nonce.
Every failure is a 401 whose problem type names the check that failed.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from dataclasses import dataclass
from typing import Any

import http_sf
from http_message_signatures import (
    ContentDigest,
    HTTPMessageSignaturesException,
    HTTPMessageVerifier,
    HTTPSignatureKeyResolver,
    InvalidSignature,
    algorithms,
)

from fencegate.problems import Problem
from fencegate.signing.keys import KeyRing, VerificationKey
from fencegate.signing.message import from_incoming
from fencegate.signing.sign import BASE_COMPONENTS, FENCE_HEADERS
from fencegate.types import IncomingRequest, NonceStore

STRIPPED_HEADERS = frozenset({"signature-input", "signature"})
MAX_NONCE_LENGTH = 255
NONCE_TTL_MARGIN_SECONDS = 60.0

_VERIFIER_ALGORITHMS = {"hmac-sha256": algorithms.HMAC_SHA256, "ed25519": algorithms.ED25519}


def _unauthorized(kind: str, title: str, detail: str, **extensions: Any) -> Problem:
    return Problem(
        401,
        kind,
        title,
        detail[:1].upper() + detail[1:],
        headers={"WWW-Authenticate": 'Signature realm="fencegate"'},
        **extensions,
    )


@dataclass(frozen=True, slots=True)
class _SignatureInput:
    label: str
    components: tuple[tuple[str, frozenset[tuple[str, Any]]], ...]
    params: dict[str, Any]


class _OneKey(HTTPSignatureKeyResolver):
    def __init__(self, key: VerificationKey) -> None:
        self._key = key

    def resolve_public_key(self, key_id: str) -> Any:
        return self._key.material if key_id == self._key.key_id else None

    def resolve_private_key(self, key_id: str) -> Any:
        raise KeyError("the gateway never signs")


def _parse_dictionary(header: str, values: list[str]) -> dict[str, Any]:
    def reject_duplicate(name: str, context: str) -> None:
        raise ValueError(f"duplicate {context} member {name!r}")

    try:
        parsed: Any = http_sf.parse(
            ", ".join(values).encode("ascii"),
            tltype="dictionary",
            on_duplicate_key=reject_duplicate,
        )
    except (ValueError, TypeError, UnicodeEncodeError):
        raise _unauthorized(
            "signature-invalid",
            "Signature invalid",
            f"{header} is not a valid structured field dictionary.",
        ) from None
    assert isinstance(parsed, dict)
    return parsed


def _signature_inputs(values: list[str]) -> list[_SignatureInput]:
    """Every signature the request carries (RFC 9421 §4.3 allows several, e.g. one added
    by a proxy on the way), in the order sent."""
    found: list[_SignatureInput] = []
    for label, (members, params) in _parse_dictionary("Signature-Input", values).items():
        if not isinstance(members, list):
            raise _unauthorized(
                "signature-invalid",
                "Signature invalid",
                f"Signature-Input member {label!r} must be an inner list of components.",
            )
        components = tuple(
            (str(value), frozenset(item_params.items())) for value, item_params in members
        )
        found.append(_SignatureInput(label, components, dict(params)))
    if not found:
        raise _unauthorized("signature-invalid", "Signature invalid", "Signature-Input is empty.")
    return found


def _only(request: IncomingRequest, chosen: str, inputs: dict[str, Any]) -> IncomingRequest:
    """The request as the signature library should see it: the chosen signature alone in
    Signature-Input and Signature (the others are someone else's to check)."""
    signatures = _parse_dictionary("Signature", request.header_values("signature"))
    if chosen not in signatures:
        raise _unauthorized(
            "signature-invalid", "Signature invalid", f"Signature has no member {chosen!r}."
        )
    lines = [(k, v) for k, v in request.headers if k not in STRIPPED_HEADERS]
    lines.append(("signature-input", http_sf.ser({chosen: inputs[chosen]})))
    lines.append(("signature", http_sf.ser({chosen: signatures[chosen]})))
    return dataclasses.replace(request, headers=tuple(lines))


class SignatureAuthenticator:
    """Verifies fencegate's RFC 9421 profile and maps the key to its tenant."""

    def __init__(
        self,
        keys: KeyRing,
        *,
        skew_past: float = 60.0,
        skew_future: float = 5.0,
        public_base_url: str | None = None,
        store_timeout: float = 5.0,
    ) -> None:
        if skew_past <= 0 or skew_future < 0:
            raise ValueError("skew_past must be > 0 and skew_future >= 0")
        self.keys = keys
        self.skew_past = float(skew_past)
        self.skew_future = float(skew_future)
        self.public_base_url = public_base_url
        self.store_timeout = store_timeout
        self._verifiers = {key.key_id: self._verifier(key) for key in keys}

    def _verifier(self, key: VerificationKey) -> HTTPMessageVerifier:
        verifier = HTTPMessageVerifier(
            signature_algorithm=_VERIFIER_ALGORITHMS[key.alg], key_resolver=_OneKey(key)
        )
        # Our own window check runs first and names its problem; the library's is a backstop.
        verifier.max_clock_skew = datetime.timedelta(seconds=self.skew_future + 1)
        return verifier

    @property
    def stripped_headers(self) -> frozenset[str]:
        return STRIPPED_HEADERS

    @property
    def nonce_ttl_seconds(self) -> float:
        # A replay is possible while `created` is inside the window: past + future from now
        # covers every moment this gateway could still accept it. The margin covers other
        # gateway hosts whose clocks differ from this one (the row expires by the database
        # clock, the window is judged by each host's clock).
        return self.skew_past + self.skew_future + NONCE_TTL_MARGIN_SECONDS

    def __repr__(self) -> str:
        return (
            f"SignatureAuthenticator({self.keys!r}, skew_past={self.skew_past}, "
            f"skew_future={self.skew_future}, public_base_url={self.public_base_url!r})"
        )

    async def authenticate(self, request: IncomingRequest, nonces: NonceStore) -> str:
        input_values = request.header_values("signature-input")
        signature_values = request.header_values("signature")
        if not input_values and not signature_values:
            raise _unauthorized(
                "signature-missing",
                "Signature missing",
                "This gateway requires an RFC 9421 signature (Signature-Input and Signature).",
            )
        if not input_values or not signature_values:
            missing = "Signature-Input" if not input_values else "Signature"
            raise _unauthorized(
                "signature-invalid", "Signature invalid", f"the {missing} header is missing."
            )
        sig_input, request = self._select(input_values, request)
        key = self._key_for(sig_input)
        self._check_coverage(sig_input, request)
        self._check_window(sig_input)
        nonce = self._nonce(sig_input)
        covered = self._verify(key, request)
        self._check_digest(covered, request.body)
        if not await nonces.remember_nonce(
            key.key_id,
            nonce,
            self.nonce_ttl_seconds,
            tenant=key.tenant,
            timeout=self.store_timeout,
        ):
            raise _unauthorized(
                "nonce-replayed",
                "Signature replayed",
                "This signature's nonce was already used; sign every request afresh.",
            )
        return key.tenant

    def _select(
        self, input_values: list[str], request: IncomingRequest
    ) -> tuple[_SignatureInput, IncomingRequest]:
        """The signature this gateway's profile checks: the first whose ``keyid`` is one of
        its keys. Other signatures are ignored; with no signature for one of its keys, the
        request is refused as before (``unknown-key``)."""
        candidates = _signature_inputs(input_values)
        if len(candidates) == 1:
            return candidates[0], request
        ours = [c for c in candidates if self.keys.get(str(c.params.get("keyid"))) is not None]
        if not ours:
            raise _unauthorized(
                "unknown-key",
                "Unknown signing key",
                f"none of the {len(candidates)} signatures "
                f"({', '.join(c.label for c in candidates)}) uses a key configured on this "
                "gateway.",
            )
        chosen = ours[0]
        inputs = _parse_dictionary("Signature-Input", input_values)
        return chosen, _only(request, chosen.label, inputs)

    def _key_for(self, sig_input: _SignatureInput) -> VerificationKey:
        key_id = sig_input.params.get("keyid")
        if not isinstance(key_id, str):
            raise _unauthorized(
                "signature-invalid",
                "Signature invalid",
                'the signature has no "keyid" string parameter.',
            )
        key = self.keys.get(key_id)
        if key is None:
            raise _unauthorized(
                "unknown-key",
                "Unknown signing key",
                f"no key with id {key_id!r} is configured on this gateway.",
                keyid=key_id,
            )
        alg = sig_input.params.get("alg")
        if alg is not None and alg != key.alg:
            raise _unauthorized(
                "signature-invalid",
                "Signature invalid",
                f"key {key_id!r} is an {key.alg} key, the signature says alg={alg!r}.",
            )
        return key

    def _check_coverage(self, sig_input: _SignatureInput, request: IncomingRequest) -> None:
        # Components must be covered plainly: a `;sf` or `;key=` variant signs a different
        # value than the one the gateway acts on.
        covered = {name for name, params in sig_input.components if not params}
        required = list(BASE_COMPONENTS)
        required += [name for name in FENCE_HEADERS if request.header_values(name)]
        missing = [name for name in required if name not in covered]
        if missing:
            raise _unauthorized(
                "component-missing",
                "Signature does not cover a required component",
                f"the signature must cover {', '.join(required)}; it does not cover "
                f"{', '.join(missing)}.",
                missing_components=missing,
            )
        for param in ("created", "nonce"):
            if param not in sig_input.params:
                raise _unauthorized(
                    "component-missing",
                    "Signature does not cover a required component",
                    f'the signature parameters must include "{param}".',
                    missing_components=[param],
                )

    def _check_window(self, sig_input: _SignatureInput) -> None:
        created = sig_input.params["created"]
        if type(created) is not int:
            raise _unauthorized(
                "signature-invalid", "Signature invalid", '"created" must be an integer.'
            )
        now = time.time()
        if created < now - self.skew_past:
            raise _unauthorized(
                "signature-expired",
                "Signature expired",
                f"the signature was created {int(now - created)} s ago; this gateway accepts "
                f"signatures up to {self.skew_past:g} s old.",
                created=created,
            )
        if created > now + self.skew_future:
            raise _unauthorized(
                "signature-expired",
                "Signature not yet valid",
                f"the signature was created {int(created - now)} s in the future; this gateway "
                f"tolerates {self.skew_future:g} s of clock skew. Check the signer's clock.",
                created=created,
            )
        expires = sig_input.params.get("expires")
        if expires is not None and (type(expires) is not int or expires < now):
            raise _unauthorized(
                "signature-expired", "Signature expired", 'the signature\'s "expires" has passed.'
            )

    @staticmethod
    def _nonce(sig_input: _SignatureInput) -> str:
        nonce = sig_input.params["nonce"]
        if not isinstance(nonce, str) or not 1 <= len(nonce) <= MAX_NONCE_LENGTH:
            raise _unauthorized(
                "signature-invalid",
                "Signature invalid",
                f'"nonce" must be a string of 1 to {MAX_NONCE_LENGTH} characters.',
            )
        return nonce

    def _verify(self, key: VerificationKey, request: IncomingRequest) -> dict[str, str]:
        message = from_incoming(request, public_base_url=self.public_base_url)
        verifier = self._verifiers[key.key_id]
        try:
            [result] = verifier.verify(
                message,
                max_age=datetime.timedelta(seconds=self.skew_past),
                require_components=BASE_COMPONENTS,
            )
        except (HTTPMessageSignaturesException, ValueError) as exc:
            raise _unauthorized(
                "signature-invalid",
                "Signature invalid",
                "the signature does not match this request (wrong key, or the method, URL "
                "or a covered header changed after signing).",
                reason=_reason(exc),
            ) from None
        return result.covered_components

    @staticmethod
    def _check_digest(covered: dict[str, str], body: bytes) -> None:
        try:
            checked = ContentDigest.verify_components(
                {name: _supported_digests(name, value) for name, value in covered.items()}, body
            )
        except InvalidSignature as exc:
            raise _unauthorized(
                "digest-mismatch",
                "Content-Digest mismatch",
                "the body received does not match the signed Content-Digest (RFC 9530; "
                "sha-256 and sha-512 are accepted).",
                reason=str(exc),
            ) from None
        if not checked:  # unreachable while coverage is enforced; fail closed all the same
            raise _unauthorized(
                "component-missing",
                "Signature does not cover a required component",
                "the signature must cover content-digest.",
                missing_components=["content-digest"],
            )


SUPPORTED_DIGESTS = ("sha-256", "sha-512")


def _supported_digests(component: str, value: str) -> str:
    """A Content-Digest with the algorithms the gateway does not support left out: RFC 9530
    §2 lets a recipient ignore those (a sender may add crc32c for its own reasons). What is
    left must still match the body; if nothing is left, the library refuses it."""
    if not component.startswith('"content-digest"'):
        return value
    try:
        members: Any = http_sf.parse(value.encode("ascii"), tltype="dictionary")
    except (ValueError, TypeError, UnicodeEncodeError):
        return value  # malformed: the library's own check names it
    kept = {name: member for name, member in members.items() if name in SUPPORTED_DIGESTS}
    return http_sf.ser(kept) if kept else value


def _reason(exc: Exception) -> str:
    # The library's messages name the failing check; none of them contains key material.
    text = str(exc) or type(exc).__name__
    return text[:200]
