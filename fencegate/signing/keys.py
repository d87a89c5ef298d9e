"""Signing keys: the `[[keys]]` file the gateway trusts and the key material behind it.

A key file is TOML (or JSON) with one ``[[keys]]`` table per key::

    [[keys]]
    id = "billing-2026-01"          # the signature's keyid
    tenant = "billing"              # scopes every idempotency key and fence
    alg = "hmac-sha256"             # or "ed25519"
    secret = "base64…"              # hmac: inline; or secret_file = "path"
                                    # ed25519: public_key = "base64 or PEM", or public_key_file

Several ids may share a tenant so that a key can be rotated without downtime.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from fencegate.errors import FencegateError

Algorithm = Literal["hmac-sha256", "ed25519"]
ALGORITHMS: tuple[str, ...] = ("hmac-sha256", "ed25519")

# RFC 2104 advises a key at least as long as the hash output.
MIN_HMAC_SECRET_BYTES = 32
_KEY_ID_PATTERN = r"^[\x21-\x7e]{1,255}$"


class KeyConfigError(FencegateError, ValueError):
    """A key file or key entry that cannot be trusted; the message names entry and field."""


class KeyEntry(BaseModel):
    """One trusted key. Secrets stay in SecretStr so that no repr or error prints them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(
        pattern=_KEY_ID_PATTERN, description="the signature's keyid: 1-255 printable characters"
    )
    tenant: str = Field(
        pattern=r"^[\x20-\x7e]{1,255}$",
        description="the tenant this key speaks for; it scopes every key and fence",
    )
    alg: Algorithm = Field(description="hmac-sha256 (a shared secret) or ed25519")
    secret: SecretStr | None = Field(
        default=None, description="hmac-sha256: the secret, base64, at least 32 bytes"
    )
    secret_file: Path | None = Field(
        default=None,
        description="hmac-sha256: a file holding the secret (relative to the keys file)",
    )
    public_key: str | None = Field(
        default=None, description="ed25519: the public key, raw 32 bytes in base64, or PEM"
    )
    public_key_file: Path | None = Field(
        default=None,
        description="ed25519: a file holding the public key (relative to the keys file)",
    )

    @model_validator(mode="after")
    def _one_source(self) -> KeyEntry:
        if self.alg == "hmac-sha256":
            wanted, other = ("secret", "secret_file"), ("public_key", "public_key_file")
        else:
            wanted, other = ("public_key", "public_key_file"), ("secret", "secret_file")
        given = [name for name in wanted if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"{self.alg} needs exactly one of {wanted[0]} or {wanted[1]}")
        for name in other:
            if getattr(self, name) is not None:
                raise ValueError(f"{name} does not apply to {self.alg}")
        return self


class SignatureSettings(BaseModel):
    """Settings that may sit next to the keys in the same document."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: list[dict[str, Any]] = Field(default_factory=list)
    file: Path | None = Field(
        default=None,
        description="in the gateway's config file: read the keys from this file instead",
    )
    public_base_url: str | None = Field(
        default=None,
        description="the scheme and host clients sign for, behind a TLS-terminating proxy",
    )
    skew_past_seconds: float | None = Field(
        default=None, gt=0, description="how old a signature's created may be (default 60)"
    )
    skew_future_seconds: float | None = Field(
        default=None,
        ge=0,
        description="how far ahead of the gateway a signer's clock may be (default 5)",
    )


@dataclass(frozen=True, slots=True)
class VerificationKey:
    """A key the gateway verifies with. ``material`` is never part of the repr."""

    key_id: str
    tenant: str
    alg: str
    material: bytes | ed25519.Ed25519PublicKey = field(repr=False, compare=False)


class KeyRing:
    """The trusted keys by id."""

    def __init__(self, keys: Iterable[VerificationKey]) -> None:
        self._keys: dict[str, VerificationKey] = {}
        for key in keys:
            if key.key_id in self._keys:
                raise KeyConfigError(f"key id {key.key_id!r} is configured twice")
            self._keys[key.key_id] = key

    def get(self, key_id: str) -> VerificationKey | None:
        return self._keys.get(key_id)

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[VerificationKey]:
        return iter(self._keys.values())

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(k.tenant for k in self._keys.values())

    def __repr__(self) -> str:
        return f"KeyRing({len(self._keys)} keys, tenants={sorted(self.tenants)})"


@dataclass(frozen=True)
class LoadedKeys:
    ring: KeyRing
    public_base_url: str | None = None
    skew_past_seconds: float | None = None
    skew_future_seconds: float | None = None


def decode_base64(text: str) -> bytes:
    """Standard or URL-safe base64, padding optional (what other languages emit by default)."""
    cleaned = "".join(text.split())
    cleaned += "=" * (-len(cleaned) % 4)
    altchars = b"-_" if ("-" in cleaned or "_" in cleaned) else None
    try:
        return base64.b64decode(cleaned, altchars=altchars, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError("is not valid base64") from exc


def load_ed25519_public(text: bytes) -> ed25519.Ed25519PublicKey:
    """PEM (SubjectPublicKeyInfo) or the raw 32-byte key in base64."""
    if text.lstrip().startswith(b"-----BEGIN"):
        try:
            key = serialization.load_pem_public_key(text)
        except ValueError as exc:
            raise ValueError("is not a PEM public key") from exc
        if not isinstance(key, ed25519.Ed25519PublicKey):
            raise ValueError("is a PEM public key but not an Ed25519 one")
        return key
    raw = decode_base64(text.decode("ascii", errors="replace"))
    if len(raw) != 32:
        raise ValueError("must be 32 bytes (base64) or PEM")
    return ed25519.Ed25519PublicKey.from_public_bytes(raw)


def load_ed25519_private(text: bytes) -> ed25519.Ed25519PrivateKey:
    """PEM (PKCS#8, unencrypted) or the raw 32-byte seed in base64."""
    if text.lstrip().startswith(b"-----BEGIN"):
        try:
            key = serialization.load_pem_private_key(text, password=None)
        except (ValueError, TypeError) as exc:
            raise ValueError("is not an unencrypted PEM private key") from exc
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise ValueError("is a PEM private key but not an Ed25519 one")
        return key
    raw = decode_base64(text.decode("ascii", errors="replace"))
    if len(raw) != 32:
        raise ValueError("must be a 32-byte seed (base64) or PEM")
    return ed25519.Ed25519PrivateKey.from_private_bytes(raw)


def load_hmac_secret(text: bytes) -> bytes:
    secret = decode_base64(text.decode("ascii", errors="replace"))
    if len(secret) < MIN_HMAC_SECRET_BYTES:
        raise ValueError(f"must decode to at least {MIN_HMAC_SECRET_BYTES} bytes")
    return secret


def _read(path: Path, base_dir: Path | None) -> bytes:
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot be read ({exc.strerror or type(exc).__name__}: {path})") from exc


def _material(entry: KeyEntry, base_dir: Path | None) -> bytes | ed25519.Ed25519PublicKey:
    if entry.alg == "hmac-sha256":
        name = "secret" if entry.secret is not None else "secret_file"
        try:
            if entry.secret is not None:
                return load_hmac_secret(entry.secret.get_secret_value().encode())
            assert entry.secret_file is not None
            return load_hmac_secret(_read(entry.secret_file, base_dir))
        except ValueError as exc:
            raise _FieldError(name, str(exc)) from None
    name = "public_key" if entry.public_key is not None else "public_key_file"
    try:
        if entry.public_key is not None:
            return load_ed25519_public(entry.public_key.encode())
        assert entry.public_key_file is not None
        return load_ed25519_public(_read(entry.public_key_file, base_dir))
    except ValueError as exc:
        raise _FieldError(name, str(exc)) from None


class _FieldError(Exception):
    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field_name = field_name


def _entry_label(index: int, raw: object) -> str:
    key_id = raw.get("id") if isinstance(raw, Mapping) else None
    label = f"entry {index + 1}"
    return f"{label} (id {key_id!r})" if isinstance(key_id, str) else label


def _describe(error: ValidationError) -> str:
    # Never include pydantic's `input` in a message: it may be a secret.
    parts = []
    for err in error.errors(include_input=False, include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        parts.append(f"field {loc!r}: {message}" if loc else message)
    return "; ".join(parts)


def parse_entries(
    raw_entries: object, *, source: str, base_dir: Path | None = None
) -> list[VerificationKey]:
    if not isinstance(raw_entries, list):
        raise KeyConfigError(f"{source}: 'keys' must be a list of tables ([[keys]])")
    keys: list[VerificationKey] = []
    seen: dict[str, int] = {}
    for index, raw in enumerate(raw_entries):
        label = _entry_label(index, raw)
        if not isinstance(raw, Mapping):
            raise KeyConfigError(f"{source}: {label}: must be a table with id, tenant, alg")
        try:
            entry = KeyEntry.model_validate(dict(raw))
        except ValidationError as exc:
            raise KeyConfigError(f"{source}: {label}: {_describe(exc)}") from None
        try:
            material = _material(entry, base_dir)
        except _FieldError as exc:
            raise KeyConfigError(f"{source}: {label}: field {exc.field_name!r} {exc}") from None
        if entry.id in seen:
            raise KeyConfigError(
                f"{source}: {label}: field 'id' repeats entry {seen[entry.id] + 1}; "
                "every key id must be unique"
            )
        seen[entry.id] = index
        keys.append(VerificationKey(entry.id, entry.tenant, entry.alg, material))
    return keys


def _parse_document(text: str, *, source: str) -> object:
    stripped = text.lstrip()
    if stripped.startswith(("{", "[")):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass  # `[[keys]]` is TOML, not JSON
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KeyConfigError(f"{source}: not valid TOML or JSON ({exc})") from None


def _from_document(document: object, *, source: str, base_dir: Path | None) -> LoadedKeys:
    if isinstance(document, list):
        document = {"keys": document}
    if not isinstance(document, Mapping):
        raise KeyConfigError(f"{source}: expected [[keys]] tables or a list of keys")
    raw_keys = document.get("keys", [])
    try:
        settings = SignatureSettings.model_validate({**document, "keys": []})
    except ValidationError as exc:
        raise KeyConfigError(f"{source}: {_describe(exc)}") from None
    if settings.file is not None:
        if raw_keys:
            raise KeyConfigError(f"{source}: give either 'file' or 'keys', not both")
        path = settings.file if base_dir is None else base_dir / settings.file
        inner = load_key_file(path)
        return LoadedKeys(
            inner.ring,
            settings.public_base_url or inner.public_base_url,
            settings.skew_past_seconds or inner.skew_past_seconds,
            settings.skew_future_seconds
            if settings.skew_future_seconds is not None
            else inner.skew_future_seconds,
        )
    entries = parse_entries(raw_keys, source=source, base_dir=base_dir)
    return LoadedKeys(
        KeyRing(entries),
        settings.public_base_url,
        settings.skew_past_seconds,
        settings.skew_future_seconds,
    )


def load_key_file(path: Path | str) -> LoadedKeys:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KeyConfigError(f"key file {path}: {exc.strerror or exc}") from None
    document = _parse_document(text, source=f"key file {path}")
    return _from_document(document, source=f"key file {path}", base_dir=path.parent)


def load_keys(
    spec: str | os.PathLike[str] | Mapping[str, Any] | list[Any],
    *,
    base_dir: Path | None = None,
) -> LoadedKeys:
    """Read keys from a path, an inline TOML/JSON document, a parsed mapping or a list.

    A string is inline when it starts with ``{`` or ``[`` or spans several lines;
    otherwise it is a path. ``base_dir`` resolves relative file names in a parsed mapping
    or list (the directory of the config file it came from).
    """
    if isinstance(spec, os.PathLike):
        return load_key_file(Path(spec))
    if isinstance(spec, str):
        if spec.lstrip().startswith(("{", "[")) or "\n" in spec.strip():
            document = _parse_document(spec, source="inline keys")
            return _from_document(document, source="inline keys", base_dir=None)
        return load_key_file(Path(spec.strip()))
    if isinstance(spec, list | Mapping):
        return _from_document(spec, source="[keys]", base_dir=base_dir)
    raise KeyConfigError(
        f"keys: expected a path, a TOML/JSON document, a table or a list, got {type(spec).__name__}"
    )
