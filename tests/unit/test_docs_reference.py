"""The reference pages are rendered from the code (docs/hooks/reference.py): every command,
option, setting, route field, key field and environment variable appears, each with what it
means, so that nothing the code accepts goes undocumented."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from fencegate.cli import SUBCOMMANDS
from fencegate.console.auth import TOKEN_FIELDS
from fencegate.gateway.config import GatewaySettings
from fencegate.gateway.routes import RoutePolicy
from fencegate.signing.keys import KeyEntry, SignatureSettings

HOOK = Path(__file__).resolve().parents[2] / "docs" / "hooks" / "reference.py"


@pytest.fixture(scope="module")
def reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_command_and_option_is_on_the_cli_page(reference: ModuleType) -> None:
    page = reference.render("cli")
    paths = [path for path, _ in reference.walk_commands(reference.command_parser())]
    assert {p.split()[1] for p in paths} == set(SUBCOMMANDS)
    assert "fencegate keys resolve" in paths and "fencegate jobs list" in paths
    for path, parser in reference.walk_commands(reference.command_parser()):
        assert f"`{path}`" in page
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert option in page, f"{path} {option}"


def test_the_page_does_not_show_the_builder_s_environment(
    reference: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FENCEGATE_TENANT", "someone-s-tenant")
    monkeypatch.setenv("FENCEGATE_DATABASE_URL", "postgresql://secret@db/prod")
    page = reference.render("cli")
    assert "someone-s-tenant" not in page and "secret@db" not in page


def test_every_gateway_setting_has_its_variable_and_a_meaning(reference: ModuleType) -> None:
    table = reference.render("gateway-settings")
    options = reference.serve_options()
    for name, field in GatewaySettings.model_fields.items():
        assert f"`FENCEGATE_{name.upper()}`" in table
        meaning = reference.setting_meaning(name, field, options.get(name))
        assert meaning, f"gateway setting {name}: give it an option help or a description="


def test_every_route_key_and_secret_field_has_a_description(reference: ModuleType) -> None:
    routes = reference.render("routes")
    for name, field in RoutePolicy.__pydantic_fields__.items():  # type: ignore[attr-defined]
        assert field.description, f"RoutePolicy.{name}: add Field(description=...)"
        assert f"`{reference.ROUTE_FILE_NAMES.get(name, name)}`" in routes
    assert "the gateway's `upstream_timeout`" in routes  # a route inherits its timeout
    for model in (KeyEntry, SignatureSettings):
        for name, field in model.model_fields.items():
            assert name == "keys" or field.description, f"{model.__name__}.{name}: description"
    tokens = reference.render("console-tokens")
    assert all(f"`{name}`" in tokens for name in TOKEN_FIELDS)


def test_every_variable_a_help_text_names_is_in_the_environment_table(
    reference: ModuleType,
) -> None:
    table = reference.render("environment")
    named = set()
    for _, parser in reference.walk_commands(reference.command_parser()):
        for action in parser._actions:
            named.update(re.findall(r"FENCEGATE_[A-Z_]+[A-Z]", action.help or ""))
    listed = set(re.findall(r"^\| `(FENCEGATE_[A-Z_]+)`", table, re.M))
    assert named <= listed
    assert {"FENCEGATE_STORE_POOL_SIZE", "FENCEGATE_CONSOLE_TOKENS_FILE"} <= listed
    assert "FENCEGATE_SERVE_OVERRIDES" not in listed  # internal: serve to its own workers


def test_a_page_asking_for_an_unknown_part_stops_the_build(reference: ModuleType) -> None:
    page = "# X\n\n<!-- reference: cli -->\n"
    assert "`fencegate serve`" in reference.on_page_markdown(page)
    with pytest.raises(ValueError, match="unknown reference part"):
        reference.on_page_markdown("<!-- reference: nothing -->\n")
