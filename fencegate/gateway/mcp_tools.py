"""What an MCP route (``protocol = "mcp"``) says about one of its tools: the
``[[routes.tools]]`` tables of a config file, or `McpTool` in Python. A tool not listed
passes through untouched."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass


def check_arguments_path(value: str | None) -> str | None:
    """``arguments.<field>`` or ``arguments.<field>.<field>…``: a field of the call's
    arguments, as the entity's ``json:`` rule names a field of a JSON body."""
    if value is None:
        return None
    head, _, rest = value.partition(".")
    if head != "arguments" or not rest or not all(rest.split(".")):
        raise ValueError('must name a field of the arguments, e.g. "arguments.order_id"')
    return value


def argument_path(spec: str) -> tuple[str, ...]:
    return tuple(spec.split(".")[1:])


ArgumentsPath = Annotated[str | None, AfterValidator(check_arguments_path)]


@pydantic_dataclass(frozen=True, slots=True, config=ConfigDict(extra="forbid"))
class McpTool:
    name: Annotated[str, Field(min_length=1, description="the tool's name, as in tools/call")]
    require_key: Annotated[
        bool,
        Field(
            description="a call without an idempotency key (in _meta, the Idempotency-Key "
            "header or key_from) is refused (JSON-RPC error, data: 400 key-required)"
        ),
    ] = True
    require_fence: Annotated[
        bool,
        Field(
            description="a call without a fence (in _meta or X-Execution-Fence) is refused "
            "(JSON-RPC error, data: 428 fence-required)"
        ),
    ] = False
    on_unknown: Annotated[
        Literal["retry", "reject"] | None,
        Field(description="as for HTTP routes; unset: the route's"),
    ] = None
    timeout: Annotated[
        float | None,
        Field(gt=0, description="the tool's deadline upstream, seconds; unset: the route's"),
    ] = None
    key_from: Annotated[
        ArgumentsPath,
        Field(
            description='derive the key from an argument, "arguments.<field>": key '
            "<tool>:<value>; unset: the route's"
        ),
    ] = None
    entity_from: Annotated[
        ArgumentsPath,
        Field(
            description='derive the entity from an argument, "arguments.<field>": entity '
            "<field>:<value>; unset: the route's"
        ),
    ] = None
