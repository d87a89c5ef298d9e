"""Route policies: what the gateway demands of the requests under one path prefix, and how
it finds the entity a fence protects."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

import orjson
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from fencegate.gateway.mcp_tools import ArgumentsPath, McpTool
from fencegate.gateway.reconcile import ReconcileRule, reconcile_rule
from fencegate.problems import Problem

DEFAULT_KEY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})

_TEMPLATE_VAR = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True, slots=True)
class EntityRule:
    """``header`` (X-Execution-Entity), a path template such as
    ``/invoices/{invoice_id}/capture``, or ``json:field.path`` (a field of the JSON body)."""

    spec: str = "header"
    kind: Literal["header", "path", "json"] = field(init=False)
    _pattern: re.Pattern[str] | None = field(init=False, default=None)
    _json_path: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        spec = self.spec
        if spec == "header":
            object.__setattr__(self, "kind", "header")
        elif spec.startswith("json:"):
            path = tuple(spec[len("json:") :].split("."))
            if not all(path):
                raise ValueError("json entity rule needs a field path, e.g. json:invoice.id")
            object.__setattr__(self, "kind", "json")
            object.__setattr__(self, "_json_path", path)
        elif spec.startswith("/"):
            names = _TEMPLATE_VAR.findall(spec)
            if not names:
                raise ValueError(
                    "a path entity rule needs at least one {name}, e.g. /invoices/{invoice_id}"
                )
            if len(set(names)) != len(names):
                raise ValueError("a path entity rule names each {variable} once")
            regex = ""
            pos = 0
            for match in _TEMPLATE_VAR.finditer(spec):
                regex += re.escape(spec[pos : match.start()])
                regex += f"(?P<{match.group(1)}>[^/]+)"
                pos = match.end()
            regex += re.escape(spec[pos:])
            object.__setattr__(self, "kind", "path")
            object.__setattr__(self, "_pattern", re.compile(regex))
        else:
            raise ValueError(
                "entity must be 'header', a path template starting with '/' or 'json:field.path'"
            )

    def derive(self, path: str, body: bytes, header_value: str | None) -> str | None:
        """The entity of one request, or None when it names none."""
        if self.kind == "header":
            return header_value
        if self.kind == "path":
            assert self._pattern is not None
            match = self._pattern.fullmatch(path)
            if match is None:
                return None
            # Named after the variables, so two routes on one invoice share one fence.
            return "/".join(f"{k}:{v}" for k, v in match.groupdict().items())
        return self._from_json(body)

    def _from_json(self, body: bytes) -> str | None:
        try:
            value: object = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            return None
        for name in self._json_path:
            if not isinstance(value, dict):
                return None
            value = value.get(name)
        if isinstance(value, bool) or not isinstance(value, str | int):
            return None
        text = str(value)
        if not 1 <= len(text) <= 255 or not text.isascii() or not text.isprintable():
            return None
        return f"{self._json_path[-1]}:{text}"


def _entity_rule(value: object) -> object:
    return EntityRule(value) if isinstance(value, str) else value


def _upper_methods(value: object) -> object:
    if isinstance(value, list | tuple | set | frozenset):
        methods = frozenset(str(m).upper() for m in value)
        for method in methods:
            if not method.isalpha():
                raise ValueError(f"{method!r} is not an HTTP method")
        return methods
    return value


def check_upstream(value: str | None) -> str | None:
    if value is None:
        return None
    if not value.startswith(("http://", "https://")):
        raise ValueError("must be an http:// or https:// URL")
    return value.rstrip("/") or None


def _check_prefix(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError("must start with '/'")
    return value


def _check_statuses(value: frozenset[int] | None) -> frozenset[int] | None:
    for status in value or ():
        if not 100 <= status <= 599:
            raise ValueError(f"{status} is not an HTTP status")
    return value


# The one definition of a route: built by the middleware's users in Python, and validated
# from the ``[[routes]]`` tables of a config file (which say ``methods`` for key_methods).
# Each field's description is what the configuration reference prints.
@pydantic_dataclass(
    frozen=True,
    slots=True,
    config=ConfigDict(extra="forbid", arbitrary_types_allowed=True),
)
class RoutePolicy:
    prefix: Annotated[
        str,
        AfterValidator(_check_prefix),
        Field(description="the path prefix the route covers; the longest matching prefix wins"),
    ] = "/"
    upstream: Annotated[
        str | None,
        AfterValidator(check_upstream),
        Field(description="the base URL to forward to (http:// or https://)"),
    ] = None
    key_methods: Annotated[
        frozenset[str],
        BeforeValidator(_upper_methods),
        Field(
            description="the methods that go through the key and fence checks; the others "
            "pass straight through"
        ),
    ] = DEFAULT_KEY_METHODS
    key_required: Annotated[
        bool, Field(description="a guarded request without a key is 400 key-required")
    ] = True
    fence_required: Annotated[
        bool, Field(description="a guarded request without a fence is 428 fence-required")
    ] = False
    entity: Annotated[
        EntityRule,
        BeforeValidator(_entity_rule),
        Field(
            description='what a fence protects: "header" (X-Execution-Entity), a path template '
            'such as "/invoices/{invoice_id}/capture" (entity invoice_id:inv-1), or '
            '"json:customer.id" (a field of the JSON body; entity id:<value>)'
        ),
    ] = field(default_factory=EntityRule)
    timeout: Annotated[
        float, Field(gt=0, description="the upstream's deadline, seconds; then 504")
    ] = 30.0
    stored_statuses: Annotated[
        frozenset[int] | None,
        AfterValidator(_check_statuses),
        Field(
            description="the statuses whose answers are stored and replayed; unset: every "
            "status below 500 (and 5xx too with store_5xx)"
        ),
    ] = None
    store_5xx: Annotated[
        bool,
        Field(description="store 5xx answers too; by default a 5xx releases the key"),
    ] = False
    on_unknown: Annotated[
        Literal["retry", "reject"],
        Field(
            description="reject: a key whose outcome is unknown is never forwarded again "
            "(424 outcome-unknown until it is resolved; safe for any upstream); retry: "
            "forwarded again with the same key, only for upstreams that deduplicate by it"
        ),
    ] = "reject"
    allow_encoded_slashes: Annotated[
        bool,
        Field(
            description='accept "%2F" in a path, for an upstream that reads it as data '
            "(else 400 invalid-target)"
        ),
    ] = False
    max_body_bytes: Annotated[
        int, Field(gt=0, description="the largest request body; larger is 413 body-too-large")
    ] = 10 * 1024 * 1024
    max_stored_body_bytes: Annotated[
        int,
        Field(
            ge=0,
            description="the largest answer body stored for replay; a replay of a larger one "
            "is 410 response-not-stored",
        ),
    ] = 1024 * 1024
    key_ttl_seconds: Annotated[
        float, Field(gt=0, description="how long a key is kept, counted from its reservation")
    ] = 24 * 3600.0
    error_format: Annotated[
        Literal["problem", "stripe"],
        Field(
            description="the gateway's own error answers: problem (RFC 9457 problem details) "
            "or stripe (Stripe's error object, for clients written against Stripe's API)"
        ),
    ] = "problem"
    reconcile: Annotated[
        ReconcileRule | None,
        BeforeValidator(reconcile_rule),
        Field(
            description="how fencegate asks the upstream whether a request whose outcome is "
            "unknown ran, instead of waiting for an operator: a probe table { method, target, "
            "executed, not_executed, headers } (target placeholders {key}, {entity}, {fence}, "
            '{json.<field>}) or an async function "package.module:function"; unset: an '
            "operator settles such keys (see the reconciliation guide)"
        ),
    ] = None
    protocol: Annotated[
        Literal["http", "mcp"],
        Field(
            description="http: every request as the HTTP contract says; mcp: the body is "
            "JSON-RPC (the Model Context Protocol's streamable HTTP transport), tools/call of "
            "a listed tool is the keyed operation, everything else passes through untouched"
        ),
    ] = "http"
    tools: Annotated[
        tuple[McpTool, ...],
        Field(
            description="an mcp route's guarded tools ([[routes.tools]]: name, require_key, "
            "require_fence, on_unknown, timeout, key_from, entity_from); tools not listed "
            "pass through"
        ),
    ] = ()
    key_from: Annotated[
        ArgumentsPath,
        Field(
            description="an mcp route: the key of a call that names none, from an argument "
            '("arguments.<field>": key <tool>:<value>)'
        ),
    ] = None
    entity_from: Annotated[
        ArgumentsPath,
        Field(
            description="an mcp route: the entity of a call that names none, from an argument "
            '("arguments.<field>": entity <field>:<value>)'
        ),
    ] = None

    def __post_init__(self) -> None:
        if self.protocol == "mcp":
            if self.reconcile is not None:
                raise ValueError("reconcile is not available on an mcp route")
            if self.error_format != "problem":
                raise ValueError("an mcp route answers JSON-RPC errors: leave error_format unset")
            names = [tool.name for tool in self.tools]
            if len(set(names)) != len(names):
                raise ValueError("an mcp route lists each tool once")
        elif self.tools or self.key_from is not None or self.entity_from is not None:
            raise ValueError('tools, key_from and entity_from need protocol = "mcp"')

    def stores(self, status: int) -> bool:
        if self.stored_statuses is not None:
            return status in self.stored_statuses
        return status < 500 or self.store_5xx

    def guards(self, method: str) -> bool:
        """Whether requests with this method go through the key and fence checks."""
        return method in self.key_methods

    def matches(self, path: str) -> bool:
        prefix = self.prefix
        if prefix == "/" or path == prefix:
            return True
        return path.startswith(prefix if prefix.endswith("/") else prefix + "/")


class RouteTable:
    """Longest prefix wins; a path under no route gets the default policy."""

    def __init__(self, routes: Iterable[RoutePolicy], *, default: RoutePolicy) -> None:
        self.routes: Sequence[RoutePolicy] = sorted(
            routes, key=lambda r: len(r.prefix), reverse=True
        )
        self.default = default

    def match(self, path: str) -> RoutePolicy:
        for route in self.routes:
            if route.matches(path):
                return route
        return self.default


def entity_missing(rule: EntityRule) -> Problem:
    where = {
        "header": "the X-Execution-Entity header",
        "path": f"a path matching {rule.spec}",
        "json": f"the JSON body field {rule.spec[len('json:') :]}",
    }[rule.kind]
    return Problem(
        400,
        "entity-required",
        "Fence without an entity",
        f"a fenced request must name the entity it protects: {where}",
    )
