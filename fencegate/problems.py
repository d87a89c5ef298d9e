"""RFC 9457 problem details: every error fencegate answers over HTTP is one of these."""

from __future__ import annotations

from typing import Any

import orjson

from fencegate.errors import FencegateError

PROBLEM_CONTENT_TYPE = "application/problem+json"
PROBLEM_TYPE_BASE = "https://fencegate.dev/problems/"


class Problem(FencegateError):
    """An error answer. `kind` is the short problem type, e.g. ``stale-fence``."""

    def __init__(
        self,
        status: int,
        kind: str,
        title: str,
        detail: str,
        *,
        headers: dict[str, str] | None = None,
        **extensions: Any,
    ) -> None:
        super().__init__(f"{status} {kind}: {detail}")
        self.status = status
        self.kind = kind
        self.title = title
        self.detail = detail
        self.headers = headers or {}
        self.extensions = extensions

    @property
    def type_uri(self) -> str:
        return PROBLEM_TYPE_BASE + self.kind

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": self.type_uri,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        body.update(self.extensions)
        return body

    def body(self) -> bytes:
        return orjson.dumps(self.to_dict())

    def response_headers(self) -> list[tuple[str, str]]:
        headers = [("content-type", PROBLEM_CONTENT_TYPE)]
        headers.extend((k.lower(), v) for k, v in self.headers.items())
        return headers
