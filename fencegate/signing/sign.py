"""The worker side: sign every outgoing request so the gateway knows who sent it."""

from __future__ import annotations

import datetime
import os
import secrets
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ed25519
from http_message_signatures import (
    ContentDigest,
    HTTPMessageSigner,
    HTTPSignatureAlgorithm,
    MappingKeyResolver,
    PreparedSignature,
    algorithms,
)

from fencegate.signing.keys import (
    ALGORITHMS,
    load_ed25519_private,
    load_hmac_secret,
)
from fencegate.signing.message import SignedMessage, normalize_url

SIGNATURE_LABEL = "sig1"
FENCE_HEADERS = ("idempotency-key", "x-execution-fence", "x-execution-entity")
BASE_COMPONENTS = ("@method", "@target-uri", "content-digest")

_ALGORITHM_CLASSES: dict[str, type[HTTPSignatureAlgorithm]] = {
    "hmac-sha256": algorithms.HMAC_SHA256,
    "ed25519": algorithms.ED25519,
}


class _Sha512Digest(ContentDigest):
    algorithm = "sha-512"


_DIGESTS: dict[str, type[ContentDigest]] = {"sha-256": ContentDigest, "sha-512": _Sha512Digest}


def covered_components(headers: Mapping[str, str]) -> tuple[str, ...]:
    """What a fencegate signature covers: method, target URI, body digest, and each of the
    key, fence and entity headers the request carries."""
    present = {name.lower() for name in headers}
    return BASE_COMPONENTS + tuple(name for name in FENCE_HEADERS if name in present)


class HttpSigner:
    """Adds ``Content-Digest``, ``Signature-Input`` and ``Signature`` to a request.

    >>> signer = HttpSigner(key_id="billing-2026-01", secret=b"...32 bytes or more...")
    >>> signer.sign("POST", "https://api.example.com/cases", headers, body)

    Call it last, after the key, fence and entity headers are set: it covers the ones present.
    """

    def __init__(
        self,
        *,
        key_id: str,
        secret: bytes | str | None = None,
        private_key: ed25519.Ed25519PrivateKey | bytes | str | None = None,
        alg: str | None = None,
        digest: str = "sha-256",
    ) -> None:
        if (secret is None) == (private_key is None):
            raise ValueError("give exactly one of secret= (hmac-sha256) or private_key= (ed25519)")
        alg = alg or ("hmac-sha256" if secret is not None else "ed25519")
        if alg not in ALGORITHMS:
            raise ValueError(f"alg must be one of {', '.join(ALGORITHMS)}, got {alg!r}")
        if digest not in _DIGESTS:
            raise ValueError(f"digest must be sha-256 or sha-512, got {digest!r}")
        key: bytes | ed25519.Ed25519PrivateKey
        if alg == "hmac-sha256":
            if secret is None:
                raise ValueError("hmac-sha256 signs with secret=, not private_key=")
            key = load_hmac_secret(secret.encode()) if isinstance(secret, str) else secret
            if len(key) < 32:
                raise ValueError("an hmac-sha256 secret must be at least 32 bytes")
        else:
            if private_key is None:
                raise ValueError("ed25519 signs with private_key=, not secret=")
            key = _private_key(private_key)
        self.key_id = key_id
        self.alg = alg
        self._signer = HTTPMessageSigner(
            signature_algorithm=_ALGORITHM_CLASSES[alg],
            key_resolver=MappingKeyResolver(public_keys={}, private_keys={key_id: key}),
        )
        self._signer.content_digest_class = _DIGESTS[digest]

    def __repr__(self) -> str:
        return f"HttpSigner(key_id={self.key_id!r}, alg={self.alg!r})"

    @classmethod
    def from_env(cls, *, prefix: str = "FENCEGATE_SIGNING_") -> HttpSigner:
        """From ``FENCEGATE_SIGNING_KEY_ID``, ``_ALG`` and ``_SECRET`` (base64 HMAC secret or
        Ed25519 seed/PEM) or ``_SECRET_FILE``."""
        env = os.environ
        key_id = env.get(prefix + "KEY_ID")
        if not key_id:
            raise ValueError(f"{prefix}KEY_ID is not set")
        alg = env.get(prefix + "ALG", "hmac-sha256")
        text = env.get(prefix + "SECRET")
        file = env.get(prefix + "SECRET_FILE")
        if (text is None) == (file is None):
            raise ValueError(f"set exactly one of {prefix}SECRET or {prefix}SECRET_FILE")
        material = text.encode() if text is not None else Path(str(file)).read_bytes()
        return cls.from_material(key_id=key_id, alg=alg, material=material)

    @classmethod
    def from_file(cls, path: Path | str, *, key_id: str, alg: str = "hmac-sha256") -> HttpSigner:
        """A secret (base64) or Ed25519 private key (PEM or base64 seed) kept in a file."""
        return cls.from_material(key_id=key_id, alg=alg, material=Path(path).read_bytes())

    @classmethod
    def from_material(
        cls, *, key_id: str, alg: str, material: bytes, digest: str = "sha-256"
    ) -> HttpSigner:
        if alg == "hmac-sha256":
            secret = load_hmac_secret(material)
            return cls(key_id=key_id, secret=secret, alg=alg, digest=digest)
        if alg == "ed25519":
            private_key = load_ed25519_private(material)
            return cls(key_id=key_id, private_key=private_key, alg=alg, digest=digest)
        raise ValueError(f"alg must be one of {', '.join(ALGORITHMS)}, got {alg!r}")

    def sign(self, method: str, url: str, headers: MutableMapping[str, str], body: bytes) -> None:
        self.prepare_and_sign(method, url, headers, body)

    def prepare_and_sign(
        self,
        method: str,
        url: str,
        headers: MutableMapping[str, str],
        body: bytes,
        *,
        created: datetime.datetime | None = None,
        nonce: str | None = None,
    ) -> PreparedSignature:
        """Sign in place and return what was signed (its ``signature_base`` is what another
        implementation must reproduce byte for byte)."""
        # A retried request reuses its headers: its digest and signature must be fresh.
        for name in list(headers):
            if name.lower() in ("content-digest", "signature-input", "signature"):
                del headers[name]
        message = SignedMessage(method=method.upper(), url=normalize_url(url), headers=headers)
        prepared = self._signer.prepare(
            message,
            key_id=self.key_id,
            created=created or datetime.datetime.now(datetime.UTC),
            nonce=nonce or secrets.token_urlsafe(18),
            label=SIGNATURE_LABEL,
            covered_component_ids=covered_components(headers),
            body=body,
        )
        assert self._signer.key_resolver is not None
        key = self._signer.key_resolver.resolve_private_key(self.key_id)
        signature = self._signer.signature_algorithm(private_key=key).sign(prepared.signature_base)
        self._signer.apply(message, prepared, signature)
        return prepared


def _private_key(value: ed25519.Ed25519PrivateKey | bytes | str) -> ed25519.Ed25519PrivateKey:
    if isinstance(value, ed25519.Ed25519PrivateKey):
        return value
    if isinstance(value, bytes) and len(value) == 32:
        return ed25519.Ed25519PrivateKey.from_private_bytes(value)
    return load_ed25519_private(value.encode() if isinstance(value, str) else value)
