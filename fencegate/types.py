"""Types shared across fencegate: the ASGI aliases, the request the decision engine sees, and
the small protocols that join the gateway, the signature checks and the worker's client."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class IncomingRequest:
    """One HTTP request as received, independent of any framework.

    ``headers`` keeps every field line in order with lower-cased names, so repeated headers
    stay visible (a repeated fence header with different values is malformed).
    """

    method: str
    scheme: str
    authority: str  # host[:port] as the client addressed it
    path: str  # the path as sent (percent-encoded), without the query
    query_string: str  # raw query string, without "?"
    headers: tuple[tuple[str, str], ...]
    body: bytes
    # The path as the upstream reads it (percent-decoded; an encoded "/" stays "%2F"):
    # routes and path entities use it. None: the same as ``path``.
    decoded_path: str | None = None
    # The caller's X-Request-Id when it is a sane one, else one made up for this request:
    # it ties the decision log, the decision history and the upstream's logs together.
    request_id: str = ""
    # The target ended in "?" with nothing after it: forwarded so, byte for byte.
    empty_query: bool = False

    @property
    def route_path(self) -> str:
        return self.path if self.decoded_path is None else self.decoded_path

    @property
    def target(self) -> str:
        """The request target as sent: path and query."""
        if self.query_string or self.empty_query:
            return f"{self.path}?{self.query_string}"
        return self.path

    def header_values(self, name: str) -> list[str]:
        name = name.lower()
        return [v for k, v in self.headers if k == name]


class NonceStore(Protocol):
    async def remember_nonce(
        self, key_id: str, nonce: str, ttl_seconds: float, *, tenant: str, timeout: float
    ) -> bool:
        """Record a signature nonce; False when it was already seen within its window.
        ``tenant``: the key's tenant, whose rows the nonce is kept with."""
        ...


class Authenticator(Protocol):
    """Step 1 of the gateway's decision order: who sent this request.

    Returns the tenant that scopes every key and fence, or raises
    ``fencegate.problems.Problem`` (401). Must not store anything but the nonce.
    """

    async def authenticate(self, request: IncomingRequest, nonces: NonceStore) -> str: ...

    @property
    def stripped_headers(self) -> frozenset[str]:
        """Header names removed before forwarding once verified (lower case)."""
        ...


class RequestSigner(Protocol):
    """Worker side: adds signature headers to an outgoing request after the fence headers."""

    def sign(
        self, method: str, url: str, headers: MutableMapping[str, str], body: bytes
    ) -> None: ...
