"""Who is looking: console tokens, the signed session cookie, and the CSRF token it carries.

Tokens come from a TOML document (``--tokens FILE`` or ``FENCEGATE_CONSOLE_TOKENS``)::

    [[tokens]]
    name = "night-op"          # who, in the audit records
    token_sha256 = "9f86d0…"   # or: token = "…" (a file readable only by the console)
    role = "operator"          # viewer: read only; operator: may act
    tenant = "acme"            # optional: sees only this tenant's keys, fences and decisions

Only digests are kept in memory, and a presented token is compared with every one of them in
constant time, so neither timing nor an early exit tells how close a guess was.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from fencegate.errors import FencegateError

ROLES = ("viewer", "operator")
TOKENS_ENV = "FENCEGATE_CONSOLE_TOKENS"
# The fields of a [[tokens]] entry, and what each means (the documentation prints this).
TOKEN_FIELDS: dict[str, str] = {
    "name": "who, in the audit log (as console:<name>); unique",
    "token": "the token itself, at least 16 characters (keep the file readable only by the "
    "console); or:",
    "token_sha256": "the SHA-256 of the token, 64 hex digits",
    "role": "viewer: read only; operator: may also resolve keys, retry and cancel jobs",
    "tenant": "optional: the token sees only this tenant's keys, fences, decisions and traces, "
    "and no job pages (jobs carry no tenant)",
}


class TokenConfigError(FencegateError, ValueError):
    """The console's tokens are missing or malformed: it does not start."""


@dataclass(frozen=True, slots=True)
class ConsoleToken:
    name: str
    sha256: bytes
    role: str
    tenant: str | None = None

    @property
    def can_act(self) -> bool:
        return self.role == "operator"

    @property
    def sees_jobs(self) -> bool:
        # Jobs carry no tenant: a token limited to one would see every tenant's work.
        return self.tenant is None

    @classmethod
    def from_secret(
        cls, name: str, secret: str, *, role: str, tenant: str | None = None
    ) -> ConsoleToken:
        return cls(name, hashlib.sha256(secret.encode()).digest(), role, tenant)


def parse_tokens(text: str, *, source: str) -> list[ConsoleToken]:
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TokenConfigError(f"{source}: not TOML ({exc})") from None
    entries = document.get("tokens")
    if not isinstance(entries, list) or not entries:
        raise TokenConfigError(f"{source}: no [[tokens]] entries")
    tokens = [_token(entry, source=source, index=i) for i, entry in enumerate(entries, 1)]
    names = [t.name for t in tokens]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise TokenConfigError(f"{source}: token names must be unique: {', '.join(duplicates)}")
    return tokens


def _token(entry: Any, *, source: str, index: int) -> ConsoleToken:
    where = f"{source}: token #{index}"
    if not isinstance(entry, dict):
        raise TokenConfigError(f"{where} is not a table")
    unknown = set(entry) - set(TOKEN_FIELDS)
    if unknown:
        raise TokenConfigError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    name, role, tenant = entry.get("name"), entry.get("role"), entry.get("tenant")
    if not isinstance(name, str) or not name.strip():
        raise TokenConfigError(f"{where}: needs a name")
    if role not in ROLES:
        raise TokenConfigError(f"{where} ({name}): role must be one of {', '.join(ROLES)}")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise TokenConfigError(f"{where} ({name}): tenant must be a non-empty string")
    secret, digest = entry.get("token"), entry.get("token_sha256")
    if (secret is None) == (digest is None):
        raise TokenConfigError(f"{where} ({name}): give exactly one of token, token_sha256")
    if secret is not None:
        if not isinstance(secret, str) or len(secret) < 16:
            raise TokenConfigError(f"{where} ({name}): token must be at least 16 characters")
        return ConsoleToken.from_secret(name, secret, role=role, tenant=tenant)
    try:
        raw = bytes.fromhex(digest) if isinstance(digest, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise TokenConfigError(f"{where} ({name}): token_sha256 must be 64 hex digits")
    return ConsoleToken(name, raw, role, tenant)


def load_tokens(path: str | None, env: Mapping[str, str]) -> list[ConsoleToken]:
    """The tokens from ``path``, else from the environment; none at all is an error."""
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise TokenConfigError(f"cannot read tokens file {path!r}: {exc.strerror}") from None
        return parse_tokens(text, source=path)
    if env.get(TOKENS_ENV, "").strip():
        return parse_tokens(env[TOKENS_ENV], source=TOKENS_ENV)
    raise TokenConfigError(
        f"no console tokens: give --tokens FILE or set {TOKENS_ENV} (a [[tokens]] TOML document)"
    )


class TokenSet:
    def __init__(self, tokens: Sequence[ConsoleToken]) -> None:
        if not tokens:
            raise TokenConfigError("no console tokens configured")
        self._tokens = tuple(tokens)
        self._by_name = {t.name: t for t in tokens}

    def match(self, presented: str) -> ConsoleToken | None:
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for token in self._tokens:  # no early exit: every comparison is made
            if hmac.compare_digest(token.sha256, digest):
                found = token
        return found

    def by_name(self, name: str) -> ConsoleToken | None:
        return self._by_name.get(name)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class Session:
    csrf: str
    name: str | None = None  # signed in as this token
    token_tag: str | None = None  # part of its digest: a replaced token ends the session

    @classmethod
    def fresh(cls, token: ConsoleToken | None = None) -> Session:
        csrf = secrets.token_urlsafe(32)
        if token is None:
            return cls(csrf)
        return cls(csrf, token.name, token.sha256.hex()[:16])


class SessionSigner:
    """An HMAC-signed cookie value with an expiry; the secret lives only in this process
    unless one is given, so a restart signs everyone out."""

    def __init__(self, secret: bytes, *, max_age: float) -> None:
        self._secret = secret
        self.max_age = max_age

    def dumps(self, session: Session) -> str:
        data = {"c": session.csrf, "n": session.name, "t": session.token_tag,
                "e": time.time() + self.max_age}  # fmt: skip
        body = _b64(orjson.dumps(data))
        return f"{body}.{self._sign(body)}"

    def loads(self, value: str) -> Session | None:
        body, _, signature = value.partition(".")
        if not hmac.compare_digest(signature, self._sign(body)):
            return None
        try:
            data = orjson.loads(_unb64(body))
        except (ValueError, binascii.Error):
            return None
        if not isinstance(data, dict) or float(data.get("e", 0)) < time.time():
            return None
        return Session(str(data["c"]), data.get("n"), data.get("t"))

    def _sign(self, body: str) -> str:
        return _b64(hmac.new(self._secret, body.encode(), hashlib.sha256).digest())
