"""The request as the signature library reads it, built the same way on both sides.

Signer and gateway must derive ``@target-uri`` from the same string. RFC 9421 signs the
target as sent, and the gateway forwards it byte for byte, so the path and the query enter
the signature base exactly as they are on the wire (``%2F`` and ``/`` are different targets,
and so are ``/q?`` and ``/q``: an empty query is kept, as RFC 3986 and independent RFC 9421
signers keep it). Only the origin is normalised, since the gateway knows it from the Host it
was addressed by:

- scheme and host in lower case, the scheme's default port removed;
- an empty path is ``/`` (what a client sends for it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableMapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from fencegate.types import IncomingRequest

_DEFAULT_PORTS = {"http": "80", "https": "443"}


def normalize_path(path: str) -> str:
    return path or "/"


def normalize_origin(scheme: str, authority: str) -> str:
    scheme = scheme.lower()
    if authority.startswith("["):  # IPv6 literal: the port, if any, follows "]:"
        end = authority.find("]") + 1
        host, port = authority[:end], authority[end + 1 :]
    else:
        host, _, port = authority.partition(":")
    if port and port == _DEFAULT_PORTS.get(scheme):
        port = ""
    host = host.lower()
    return f"{scheme}://{host}:{port}" if port else f"{scheme}://{host}"


def normalize_url(url: str) -> str:
    """The ``@target-uri`` a signer signs for ``url``."""
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        raise ValueError(f"an absolute http(s) URL is required, got {url!r}")
    authority = parts.netloc.rpartition("@")[2]  # credentials never reach the target URI
    # urlsplit gives "" for "/q?" and "/q" alike; a client sends the "?" it was given.
    empty_query = not parts.query and url.partition("#")[0].endswith("?")
    query = f"?{parts.query}" if parts.query or empty_query else ""
    return normalize_origin(parts.scheme, authority) + normalize_path(parts.path) + query


def incoming_target_uri(request: IncomingRequest, *, public_base_url: str | None) -> str:
    """The ``@target-uri`` of a received request.

    Behind a TLS-terminating proxy the gateway is addressed as ``http://gateway:8080`` while
    the worker signed ``https://api.example.com``; ``public_base_url`` restores the latter.
    """
    query = f"?{request.query_string}" if request.query_string or request.empty_query else ""
    path = normalize_path(request.path)
    if public_base_url:
        base = urlsplit(public_base_url)
        prefix = base.path.rstrip("/")
        return normalize_origin(base.scheme, base.netloc) + prefix + path + query
    return normalize_origin(request.scheme, request.authority) + path + query


class ReadOnlyHeaders:
    """Every field line in order, as the library's resolver expects (names lower case)."""

    def __init__(self, fields: Iterable[tuple[str, str]]) -> None:
        self._fields = tuple(fields)

    def items(self) -> Iterable[tuple[str, str]]:
        return self._fields

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(name for name, _ in self._fields))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and any(k == name.lower() for k, _ in self._fields)

    def __setitem__(self, name: str, value: str) -> None:
        raise TypeError("a received request is read-only")

    def __delitem__(self, name: str) -> None:
        raise TypeError("a received request is read-only")


@dataclass
class SignedMessage:
    """The request-like object ``http_message_signatures`` works on."""

    method: str
    url: str
    headers: MutableMapping[str, str] | ReadOnlyHeaders


def from_incoming(request: IncomingRequest, *, public_base_url: str | None) -> SignedMessage:
    return SignedMessage(
        method=request.method.upper(),
        url=incoming_target_uri(request, public_base_url=public_base_url),
        headers=ReadOnlyHeaders(request.headers),
    )
