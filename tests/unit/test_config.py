"""Configuration: environment, command line and TOML file; bad values are refused at start
with the field named."""

from __future__ import annotations

from pathlib import Path

import pytest

from fencegate.gateway.config import ConfigError, load_config
from fencegate.gateway.routes import EntityRule


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "routes.toml"
    path.write_text(text)
    return path


GOOD = """
[gateway]
upstream = "http://127.0.0.1:9000"
inflight_lease_seconds = 12
store_timeout = 1.5

[[routes]]
prefix = "/invoices"
fence_required = true
entity = "/invoices/{invoice_id}/capture"
timeout = 5
on_unknown = "reject"
stored_statuses = [200, 201]

[[routes]]
prefix = "/reports"
upstream = "http://127.0.0.1:9100/"
methods = ["post"]
key_required = false
max_stored_body_bytes = 0

[keys]
path = "keys.toml"
"""


def test_good_file_builds_policies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FENCEGATE_UPSTREAM", raising=False)
    config = load_config({"config": write(tmp_path, GOOD)})
    assert config.settings.inflight_lease_seconds == 12
    assert config.settings.store_timeout == 1.5
    invoices, reports = config.policies()
    assert invoices.upstream == "http://127.0.0.1:9000"
    assert invoices.fence_required and invoices.on_unknown == "reject"
    assert invoices.entity == EntityRule("/invoices/{invoice_id}/capture")
    assert invoices.stores(201) and not invoices.stores(404)
    assert reports.upstream == "http://127.0.0.1:9100"
    assert reports.key_methods == frozenset({"POST"}) and not reports.key_required
    assert config.keys_table == {"path": "keys.toml"}
    assert config.authenticator_spec() == {"path": "keys.toml"}


def test_precedence_is_command_line_then_environment_then_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, GOOD)
    monkeypatch.setenv("FENCEGATE_INFLIGHT_LEASE_SECONDS", "20")
    monkeypatch.setenv("FENCEGATE_STORE_TIMEOUT", "3")
    config = load_config({"config": path, "store_timeout": 4.0})
    assert config.settings.inflight_lease_seconds == 20  # env over file
    assert config.settings.store_timeout == 4.0  # command line over env
    assert config.settings.upstream == "http://127.0.0.1:9000"  # file over default


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[routes]]\non_unknown = "maybe"',
         "routes[0].on_unknown: Input should be 'retry' or 'reject'"),
        ('[[routes]]\nprefix = "/a"\n[[routes]]\ntimeout = -1',
         "routes[1].timeout: Input should be greater than 0"),
        ('[[routes]]\nfence = true', "routes[0].fence: Extra inputs are not permitted"),
        ('[[routes]]\nentity = "body"', "routes[0].entity: entity must be 'header'"),
        ('[[routes]]\nprefix = "api"', "routes[0].prefix: must start with '/'"),
        ('[[routes]]\nstored_statuses = [200, 700]', "routes[0].stored_statuses: 700 is not"),
        ('[gateway]\nstore_timeout = "soon"', "gateway.store_timeout: Input should be a valid"),
        ('[gateway]\nlisten = 1', "gateway.listen: Extra inputs are not permitted"),
        ('[server]\nport = 1', "server: Extra inputs are not permitted"),
        # A typo gets the closest real name.
        ('[[routes]]\non_unknwon = "retry"',
         "routes[0].on_unknwon: Extra inputs are not permitted; did you mean 'on_unknown'?"),
        ('[[routes]]\nmethod = ["POST"]',
         "routes[0].method: Extra inputs are not permitted; did you mean 'methods'?"),
        ('[gateway]\nstore_timout = 2',
         "gateway.store_timout: Extra inputs are not permitted; did you mean 'store_timeout'?"),
        ('[rotues]\nprefix = "/"',
         "rotues: Extra inputs are not permitted; did you mean 'routes'?"),
        ("[[routes]\n", "not valid TOML"),
    ],
)  # fmt: skip
def test_bad_file_is_refused_naming_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config({"config": path, "upstream": "http://127.0.0.1:9000"})
    assert message in str(caught.value)
    assert str(path) in str(caught.value)


def test_bad_environment_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FENCEGATE_INFLIGHT_LEASE_SECONDS", "0")
    with pytest.raises(ConfigError, match="inflight_lease_seconds: Input should be greater"):
        load_config({})


def test_routes_inherit_the_gateway_wide_limits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FENCEGATE_UPSTREAM_TIMEOUT", "7")
    monkeypatch.setenv("FENCEGATE_KEY_TTL_SECONDS", "600")
    path = write(tmp_path, '[[routes]]\nprefix = "/a"\n[[routes]]\nprefix = "/b"\ntimeout = 2\n')
    config = load_config({"config": path, "upstream": "http://127.0.0.1:9000",
                          "max_body_bytes": 1000})  # fmt: skip
    a, b = config.policies()
    default = config.default_policy()
    assert (a.timeout, a.key_ttl_seconds, a.max_body_bytes) == (7.0, 600.0, 1000)
    assert b.timeout == 2.0
    assert (default.timeout, default.max_body_bytes, default.prefix) == (7.0, 1000, "/")
