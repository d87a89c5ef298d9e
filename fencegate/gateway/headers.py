"""The three protocol headers, parsed strictly: a malformed one is a 400, never a guess."""

from __future__ import annotations

import re
from typing import Any

import http_sf

from fencegate.problems import Problem

IDEMPOTENCY_KEY = "idempotency-key"
EXECUTION_FENCE = "x-execution-fence"
EXECUTION_ENTITY = "x-execution-entity"

MAX_FENCE = 2**63 - 1
MAX_TOKEN_LENGTH = 255

_PRINTABLE = re.compile(r"[\x20-\x7e]+")
_DIGITS = re.compile(r"[0-9]{1,40}")


def invalid_header(name: str, detail: str) -> Problem:
    return Problem(400, "invalid-header", "Malformed request header", detail, header=_display(name))


def _display(name: str) -> str:
    return "-".join(part.capitalize() for part in name.split("-"))


def single_value(name: str, values: list[str]) -> str | None:
    """The one value of a header; identical repeats are fine, different ones are not."""
    if not values:
        return None
    first = values[0]
    for other in values[1:]:
        if other != first:
            raise invalid_header(name, f"{_display(name)} is repeated with different values")
    return first


def _sf_string(name: str, value: str) -> str:
    """An RFC 8941 Item whose bare item is an sf-string (``"..."``, ``\\"`` and ``\\\\`` the
    only escapes), as the Idempotency-Key draft defines the header. Parameters (``;v=1``) are
    allowed by RFC 8941 and carry nothing the gateway uses: they are ignored."""
    try:
        parsed: Any = http_sf.parse(value.encode("ascii"), tltype="item")
    except http_sf.StructuredFieldError as exc:
        detail = f"{_display(name)} is not a valid quoted string: {exc}"
        raise invalid_header(name, detail) from None
    item = parsed[0]  # (bare item, parameters)
    if not isinstance(item, str):
        raise invalid_header(name, f"{_display(name)} is not a quoted string")
    return item


def _token(name: str, values: list[str]) -> str | None:
    raw = single_value(name, values)
    if raw is None:
        return None
    value = raw.strip(" \t")
    if not _PRINTABLE.fullmatch(value):
        raise invalid_header(name, f"{_display(name)} must be 1 to 255 printable ASCII characters")
    if value.startswith('"'):
        value = _sf_string(name, value)
    if not 1 <= len(value) <= MAX_TOKEN_LENGTH or not _PRINTABLE.fullmatch(value):
        raise invalid_header(name, f"{_display(name)} must be 1 to 255 printable ASCII characters")
    return value


def parse_idempotency_key(values: list[str]) -> str | None:
    return _token(IDEMPOTENCY_KEY, values)


def parse_entity(values: list[str]) -> str | None:
    return _token(EXECUTION_ENTITY, values)


def parse_fence(values: list[str]) -> int | None:
    raw = single_value(EXECUTION_FENCE, values)
    if raw is None:
        return None
    # HTTP parsers strip surrounding whitespace already; anything left is not a number.
    if not _DIGITS.fullmatch(raw) or int(raw) > MAX_FENCE:
        raise invalid_header(
            EXECUTION_FENCE,
            "X-Execution-Fence must be a decimal integer from 0 to 9223372036854775807, "
            "without sign or spaces",
        )
    return int(raw)


HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Never replayed: per-connection, per-moment or per-user state of the first answer.
NOT_REPLAYED = HOP_BY_HOP | {"set-cookie", "date", "content-length"}
