"""Reference pages rendered from the code at build time, so that they cannot drift from it:
every command and option from the argparse parsers of ``fencegate.cli``, every configuration
field from the pydantic models that read it, every environment variable from both.

``mkdocs.yml`` names this file under ``hooks:``. A page asks for a part with a line of its
own, ``<!-- reference: NAME -->``; an unknown name stops the build.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import annotated_types
from pydantic.fields import FieldInfo

MARKER = re.compile(r"^<!-- reference: ([a-z-]+) -->$", re.MULTILINE)
ENV_NAME = re.compile(r"\bFENCEGATE_[A-Z][A-Z_]*[A-Z]\b")
# A help text names its variable at the end ("...; env FENCEGATE_X"); the table has a column.
ENV_SUFFIX = re.compile(r"[;,]?\s*(?:else )?env FENCEGATE_[A-Z_]+(?: or FENCEGATE_[A-Z_]+)*\)?$")
# What the config file calls a RoutePolicy field, where the names differ (config.route_policy).
ROUTE_FILE_NAMES = {"key_methods": "methods"}
NONE = "\N{EN DASH}"  # a table cell with nothing to say
WIDTH = 100  # usage lines, as a terminal of this width would show them


def on_page_markdown(markdown: str, **_: Any) -> str:
    """The MkDocs hook: each marker line becomes the part it names."""
    return MARKER.sub(lambda match: render(match.group(1)), markdown)


def render(name: str) -> str:
    try:
        renderer = RENDERERS[name]
    except KeyError:
        raise ValueError(f"unknown reference part {name!r}; known: {sorted(RENDERERS)}") from None
    return renderer()


# ---------------------------------------------------------------------------------------
# The command line


@contextlib.contextmanager
def _clean_environment() -> Iterator[None]:
    """Some options take their default from the environment: build the parsers without it,
    so that the page shows what every user gets, not the builder's settings."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("FENCEGATE_")}
    for name in saved:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(saved)


def command_parser() -> argparse.ArgumentParser:
    from fencegate.cli import build_parser

    with _clean_environment():
        return build_parser()


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    found: list[tuple[str, argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.extend((name, child) for name, child in action.choices.items())
    return found


def walk_commands(
    parser: argparse.ArgumentParser, prefix: str = "fencegate"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command below ``parser``, depth first: ("fencegate keys", …), ("fencegate keys
    list", …)."""
    for name, child in _subcommands(parser):
        path = f"{prefix} {name}"
        yield path, child
        yield from walk_commands(child, path)


def _inline(text: str) -> str:
    """A help text as one table cell: pipes and angle brackets escaped, options, variables
    and TOML tables as code."""
    text = " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")
    text = ENV_NAME.sub(lambda m: f"`{m.group(0)}`", text)
    text = re.sub(r"(?<![\w`\[])(\[\[?[a-z]+\]\]?)", r"`\1`", text)
    return re.sub(r"(?<![\w`-])(--[a-z][a-z0-9-]*)", r"`\1`", text)


def _sentence(text: str) -> str:
    text = text.strip()
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def _arguments_table(parser: argparse.ArgumentParser) -> list[str]:
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        invocation = formatter._format_action_invocation(action)
        meaning = formatter._expand_help(action) if action.help else ""
        rows.append(f"| `{invocation}` | {_inline(meaning)} |")
    if not rows:
        return []
    return ["| argument | meaning |", "|---|---|", *rows, ""]


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, "")
    return formatter.format_help().strip()


def render_cli() -> str:
    root = command_parser()
    lines = [f"```text\n{_usage(root)}\n```", ""]
    for path, parser in walk_commands(root):
        level = "#" * (path.count(" ") + 1)  # fencegate keys: ##, fencegate keys list: ###
        lines += [f"{level} `{path}`", ""]
        if parser.description:
            lines += [_inline(_sentence(parser.description)), ""]
        lines += [f"```text\n{_usage(parser)}\n```", ""]
        lines += _arguments_table(parser)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Configuration


def _toml(value: Any) -> str:
    """A default as it would be written in TOML."""
    if value is None:
        return NONE
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        return f"`{value}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, frozenset | set | list | tuple):
        return (
            "`["
            + ", ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in sorted(value))
            + "]`"
        )
    spec = getattr(value, "spec", None)  # an EntityRule
    if isinstance(spec, str):
        return f'`"{spec}"`'
    return f"`{value}`"


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " or ".join(f'`"{a}"`' for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names)
    if origin in (frozenset, set, list, tuple):
        return f"list of {_type_name(args[0])}s" if args else "list"
    simple: dict[Any, str] = {
        str: "string", int: "integer", float: "number", bool: "boolean", Path: "path",
    }  # fmt: skip
    if annotation in simple:
        return simple[annotation]
    if getattr(annotation, "__name__", "") == "SecretStr":
        return "string (secret)"
    if getattr(annotation, "__name__", "") == "EntityRule":
        return "string"
    if getattr(annotation, "__name__", "") == "HttpProbe":
        return "table"  # a route's reconcile probe
    if getattr(annotation, "__name__", "") == "CallableProbe":
        return 'string ("package.module:function")'
    return str(getattr(annotation, "__name__", annotation))


def _constraints(field: FieldInfo) -> str:
    words = []
    for item in field.metadata:
        if isinstance(item, annotated_types.Gt):
            words.append(f"> {item.gt}")
        elif isinstance(item, annotated_types.Ge):
            words.append(f"≥ {item.ge}")
        elif isinstance(item, annotated_types.Lt):
            words.append(f"< {item.lt}")
        elif isinstance(item, annotated_types.Le):
            words.append(f"≤ {item.le}")
    return ", ".join(words)


def _kind(field: FieldInfo) -> str:
    limits = _constraints(field)
    name = _type_name(field.annotation)
    return f"{name}, {limits}" if limits else name


def _default(field: FieldInfo) -> Any:
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return None if field.is_required() else field.default


def serve_options() -> dict[str, argparse.Action]:
    """The options of ``fencegate serve`` by the settings field they set."""
    parser = dict(_subcommands(command_parser()))["serve"]
    return {action.dest: action for action in parser._actions if action.option_strings}


def setting_meaning(name: str, field: FieldInfo, option: argparse.Action | None) -> str:
    """A field's own description, else the help of the option that sets it."""
    if field.description:
        return field.description
    if option is not None and option.help:
        return ENV_SUFFIX.sub("", option.help.strip())
    return ""


def render_gateway_settings() -> str:
    from fencegate.gateway.config import GatewaySettings

    options = serve_options()
    prefix = str(GatewaySettings.model_config.get("env_prefix", ""))
    lines = [
        "| `[gateway]` key | command line | environment | type | default | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for name, field in GatewaySettings.model_fields.items():
        option = options.get(name)
        flags = " / ".join(f"`{o}`" for o in option.option_strings) if option else NONE
        env = f"`{prefix}{name.upper()}`"
        meaning = _inline(setting_meaning(name, field, option))
        default = _toml(_default(field))
        lines.append(f"| `{name}` | {flags} | {env} | {_kind(field)} | {default} | {meaning} |")
    return "\n".join(lines) + "\n"


def inherited_route_fields() -> dict[str, str]:
    """Route fields whose default is a gateway-wide setting: {route field: settings field}.
    Found by building a route from two different gateway settings and seeing what moves."""
    from fencegate.gateway.config import GatewaySettings, route_policy

    distinct: dict[str, Any] = {
        "upstream": "http://inherited.invalid", "upstream_timeout": 7001.0,
        "max_body_bytes": 7002, "key_ttl_seconds": 7003.0, "store_timeout": 7004.0,
        "inflight_lease_seconds": 7005.0, "fence_ttl_seconds": 7006.0,
    }  # fmt: skip
    with _clean_environment():
        plain = route_policy({}, GatewaySettings())
        marked = route_policy({}, GatewaySettings(**distinct))
    found = {}
    for name in type(plain).__pydantic_fields__:  # type: ignore[attr-defined]
        value = getattr(marked, name)
        if value != getattr(plain, name):
            source = [k for k, v in distinct.items() if v == value]
            found[name] = source[0] if source else "?"
    return found


def render_routes() -> str:
    from fencegate.gateway.routes import RoutePolicy

    inherited = inherited_route_fields()
    fields: dict[str, FieldInfo] = RoutePolicy.__pydantic_fields__  # type: ignore[attr-defined]
    lines = ["| `[[routes]]` key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in fields.items():
        default = (
            f"the gateway's `{inherited[name]}`" if name in inherited else _toml(_default(field))
        )
        toml_name = ROUTE_FILE_NAMES.get(name, name)
        lines.append(
            f"| `{toml_name}` | {_kind(field)} | {default} | {_inline(field.description or '')} |"
        )
    return "\n".join(lines) + "\n"


def _model_table(model: Any, heading: str, skip: frozenset[str] = frozenset()) -> str:
    lines = [f"| {heading} | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        default = "required" if field.is_required() else _toml(_default(field))
        lines.append(
            f"| `{name}` | {_kind(field)} | {default} | {_inline(field.description or '')} |"
        )
    return "\n".join(lines) + "\n"


def render_keys() -> str:
    from fencegate.signing.keys import KeyEntry

    return _model_table(KeyEntry, "`[[keys]]` key")


def render_key_settings() -> str:
    from fencegate.signing.keys import SignatureSettings

    return _model_table(SignatureSettings, "key", skip=frozenset({"keys"}))


def render_console_tokens() -> str:
    from fencegate.console.auth import TOKEN_FIELDS

    lines = ["| `[[tokens]]` key | meaning |", "|---|---|"]
    lines += [f"| `{name}` | {_inline(meaning)} |" for name, meaning in TOKEN_FIELDS.items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# Environment variables


# A variable's place: (the command, as "fencegate keys list", and the option, or None).
Place = tuple[str, str | None]
READS_ENVIRONMENT = re.compile(r"environ(?:\.get\(|\[)\s*\"(FENCEGATE_[A-Z_]+)\"")


def environment_variables() -> dict[str, list[Place]]:
    """Every FENCEGATE_* variable a user may set, and where it is read: the options whose
    help names it, the settings of `fencegate serve`, and what a command reads by itself."""
    import importlib
    import inspect

    from fencegate.cli import SUBCOMMANDS
    from fencegate.gateway.config import GatewaySettings
    from fencegate.signing.sign import HttpSigner

    found: dict[str, list[Place]] = {}

    def add(name: str, place: Place) -> None:
        places = found.setdefault(name, [])
        command, option = place
        # A command's own read adds nothing when one of its options already names the variable.
        if option is None and any(p[0].startswith(command) for p in places):
            return
        if place not in places:
            places.append(place)

    for path, parser in walk_commands(command_parser()):
        for action in parser._actions:
            for name in ENV_NAME.findall(action.help or ""):
                add(name, (path, action.option_strings[0] if action.option_strings else None))
    prefix = str(GatewaySettings.model_config.get("env_prefix", ""))
    options = serve_options()
    for name in GatewaySettings.model_fields:
        option = options.get(name)
        add(
            f"{prefix}{name.upper()}",
            ("fencegate serve", option.option_strings[0] if option else None),
        )
    for command, (module_name, _) in SUBCOMMANDS.items():
        source = inspect.getsource(importlib.import_module(module_name))
        for name in READS_ENVIRONMENT.findall(source):
            add(name, (f"fencegate {command}", None))
    signer_prefix = HttpSigner.from_env.__kwdefaults__["prefix"]  # type: ignore[index]
    for name in list(found):
        if name.startswith(signer_prefix):
            add(name, ("HttpSigner.from_env()", None))
    return found


def _command_link(path: str) -> str:
    if not path.startswith("fencegate "):
        return f"`{path}`"
    anchor = path.replace(" ", "-")
    return f"[`{path.removeprefix('fencegate ')}`](cli.md#{anchor})"


def render_environment() -> str:
    lines = ["| variable | read by |", "|---|---|"]
    for name, places in sorted(environment_variables().items()):
        by_option: dict[str | None, list[str]] = {}
        for path, option in places:
            by_option.setdefault(option, []).append(_command_link(path))
        parts = [
            (f"`{option}` of " if option else "") + ", ".join(commands)
            for option, commands in by_option.items()
        ]
        lines.append(f"| `{name}` | {'; '.join(parts)} |")
    return "\n".join(lines) + "\n"


RENDERERS: dict[str, Callable[[], str]] = {
    "cli": render_cli,
    "gateway-settings": render_gateway_settings,
    "routes": render_routes,
    "keys": render_keys,
    "key-settings": render_key_settings,
    "console-tokens": render_console_tokens,
    "environment": render_environment,
}
