"""How a route finds out whether a request whose outcome is unknown ran upstream (DESIGN §8):
its ``reconcile`` option, either an HTTP probe of the route's upstream

    reconcile = { method = "GET", target = "/v1/charges/by-key/{key}",
                  executed = [200], not_executed = [404] }

or an async Python function named ``"package.module:function"``. Both are validated when the
configuration is read; the reconciler (`fencegate.gateway.reconciler`) runs them.

A function is given the stored request and returns one of `Executed` (with the upstream's
answer, which is stored and replayed), `NotExecuted` (the key is released) or `Unknown`
(tried again later; the note says why)::

    from fencegate.gateway.reconcile import Executed, NotExecuted, StoredRequest, Unknown

    async def check(request: StoredRequest) -> Executed | NotExecuted | Unknown: ...
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from fencegate.errors import FencegateError


@dataclass(frozen=True, slots=True)
class StoredRequest:
    """A request whose outcome is unknown, as the store kept it: the path without the query
    (never stored: it may carry secrets), the body only for routes that reconcile."""

    tenant: str
    key: str
    method: str
    target: str
    body: bytes
    entity: str | None
    fence: int | None
    attempt: int


@dataclass(frozen=True, slots=True)
class Executed:
    """The upstream ran the request; this answer is stored for the key and replayed."""

    status: int
    headers: Sequence[tuple[str, str]] = ()
    body: bytes = b""
    note: str = ""


@dataclass(frozen=True, slots=True)
class NotExecuted:
    """The upstream never ran the request: the key is released and the next request runs."""

    note: str = ""


@dataclass(frozen=True, slots=True)
class Unknown:
    """No answer either way: tried again after a backoff; the key stays for an operator."""

    note: str


ProbeResult = Executed | NotExecuted | Unknown
ReconcileFunction = Callable[[StoredRequest], Awaitable[ProbeResult]]

_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_NAME = re.compile(r"key|entity|fence|json(\.[^.{}]+)+")
_METHOD = re.compile(r"[A-Z]+")


class MissingValue(FencegateError):
    """A placeholder of the probe's target has no value in the stored request."""


class HttpProbe(BaseModel):
    """An HTTP request to the route's upstream that says whether the original request ran:
    its answer's status is looked up in ``executed`` and ``not_executed``; any other status
    (5xx included), a timeout or a refused connection is unknown."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = "GET"
    # The path (and query) to ask, with {key}, {entity}, {fence} and {json.<field>} filled
    # in from the stored request, each percent-encoded as one path segment.
    target: str
    executed: frozenset[int]
    not_executed: frozenset[int] = frozenset()
    # Sent with the probe (e.g. the upstream's credentials): the original request's headers
    # are never stored.
    headers: tuple[tuple[str, str], ...] = ()

    @field_validator("method", mode="before")
    @classmethod
    def _method(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.upper()
            if not _METHOD.fullmatch(value):
                raise ValueError(f"{value!r} is not an HTTP method")
        return value

    @field_validator("target")
    @classmethod
    def _target(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with '/'")
        if "#" in value or any(ord(c) < 0x21 or ord(c) > 0x7E for c in value):
            raise ValueError("must be a plain path and query: no spaces, '#' or non-ASCII")
        for name in _PLACEHOLDER.findall(value):
            if not _NAME.fullmatch(name):
                raise ValueError(
                    f"{{{name}}} is not a placeholder: use {{key}}, {{entity}}, {{fence}} "
                    f"or {{json.<field>}}"
                )
        if "{" in _PLACEHOLDER.sub("", value) or "}" in _PLACEHOLDER.sub("", value):
            raise ValueError("has an unbalanced '{' or '}'")
        return value

    @field_validator("executed")
    @classmethod
    def _some_executed(cls, value: frozenset[int]) -> frozenset[int]:
        if not value:
            raise ValueError("needs at least one status that says the request ran")
        return value

    @field_validator("executed", "not_executed")
    @classmethod
    def _statuses(cls, value: frozenset[int]) -> frozenset[int]:
        for status in sorted(value):
            if not 100 <= status <= 499:
                raise ValueError(
                    f"{status} cannot be listed: statuses from 100 to 499 only (a 5xx "
                    f"answer says nothing about the original request, it is unknown)"
                )
        return value

    @field_validator("headers", mode="before")
    @classmethod
    def _headers(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            return tuple((str(k).lower(), str(v)) for k, v in value.items())
        return value

    @model_validator(mode="after")
    def _disjoint(self) -> HttpProbe:
        both = sorted(self.executed & self.not_executed)
        if both:
            raise ValueError(f"{both[0]} is both executed and not_executed")
        return self

    def render(self, request: StoredRequest) -> str:
        """The probe's target for one stored request; `MissingValue` when a placeholder has
        no value in it."""

        def fill(match: re.Match[str]) -> str:
            return quote(placeholder_value(match.group(1), request), safe="")

        return _PLACEHOLDER.sub(fill, self.target)

    def judge(self, status: int) -> Literal["executed", "not_executed"] | None:
        if status in self.executed:
            return "executed"
        if status in self.not_executed:
            return "not_executed"
        return None

    def describe(self) -> str:
        return f"{self.method} {self.target}"


def placeholder_value(name: str, request: StoredRequest) -> str:
    if name == "key":
        return request.key
    if name == "entity":
        if request.entity is None:
            raise MissingValue("{entity}: the request named no entity")
        return request.entity
    if name == "fence":
        if request.fence is None:
            raise MissingValue("{fence}: the request carried no fence")
        return str(request.fence)
    path = name.split(".")[1:]
    if not request.body:
        raise MissingValue(f"{{{name}}}: no body was stored for the request")
    try:
        value: object = orjson.loads(request.body)
    except orjson.JSONDecodeError:
        raise MissingValue(f"{{{name}}}: the stored body is not JSON") from None
    for part in path:
        if not isinstance(value, dict):
            raise MissingValue(f"{{{name}}}: the stored body has no field {'.'.join(path)}")
        value = value.get(part)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    raise MissingValue(f"{{{name}}}: the stored body has no text or number at {'.'.join(path)}")


@dataclass(frozen=True, slots=True)
class CallableProbe:
    """An async function that says whether the original request ran."""

    spec: str  # "package.module:function", as configured
    function: ReconcileFunction = field(compare=False)

    @classmethod
    def load(cls, spec: str) -> CallableProbe:
        module_name, sep, attribute = spec.partition(":")
        if not sep or not module_name or not attribute:
            raise ValueError(
                f"{spec!r} is neither a probe table nor a function named 'package.module:function'"
            )
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"cannot import {module_name!r}: {exc}") from None
        target: Any = module
        for part in attribute.split("."):
            target = getattr(target, part, None)
            if target is None:
                raise ValueError(f"{module_name!r} has no {attribute!r}")
        return cls.of(target, spec=spec)

    @classmethod
    def of(cls, function: Any, *, spec: str | None = None) -> CallableProbe:
        module = getattr(function, "__module__", "?")
        name = spec or f"{module}:{getattr(function, '__qualname__', function)}"
        if not callable(function):
            raise ValueError(f"{name!r} is not callable")
        called = getattr(function, "__call__", None)  # noqa: B004 - an object with async __call__
        if not (inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(called)):
            raise ValueError(f"{name!r} is not an async function (async def)")
        return cls(name, function)

    def describe(self) -> str:
        return self.spec


ReconcileRule = HttpProbe | CallableProbe


def reconcile_rule(value: Any) -> Any:
    """A route's ``reconcile`` as configured (a table, a function's name, or in Python the
    function or a rule itself) as a rule; refused with one line saying why."""
    if value is None or isinstance(value, HttpProbe | CallableProbe):
        return value
    if isinstance(value, Mapping):
        try:
            return HttpProbe.model_validate(dict(value))
        except ValidationError as exc:
            raise ValueError(_probe_errors(exc)) from None
    if isinstance(value, str):
        return CallableProbe.load(value)
    if callable(value):
        return CallableProbe.of(value)
    raise ValueError(
        "must be a probe table {method, target, executed, not_executed} or 'module:function'"
    )


def _probe_errors(exc: ValidationError) -> str:
    """``executed: Field required``, one per error (the route's prefix comes from the caller)."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(loc) for loc in error["loc"] if not isinstance(loc, int))
        message = error["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)
