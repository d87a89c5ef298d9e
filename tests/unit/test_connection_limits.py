"""The connection guard's settings: from the environment and the file, and the connection
limit that fits the process's open-files limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from fencegate.gateway.config import ConfigError, load_config
from fencegate.gateway.connections import connections_within


def test_timeouts_and_limit_come_from_the_environment_and_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        "[gateway]\nidle_timeout = 7\nbody_timeout = 4\nmax_connections = 500\n",
        encoding="utf-8",
    )
    monkeypatch.setenv("FENCEGATE_HEADER_TIMEOUT", "3.5")
    settings = load_config({"config": str(config), "max_connections": 300}).settings
    assert (
        settings.header_timeout,
        settings.idle_timeout,
        settings.body_timeout,
        settings.max_connections,
    ) == (3.5, 7.0, 4.0, 300)
    monkeypatch.setenv("FENCEGATE_BODY_TIMEOUT", "2.5")
    assert load_config({"config": str(config)}).settings.body_timeout == 2.5
    assert load_config({"config": str(config), "body_timeout": 1}).settings.body_timeout == 1


def test_the_defaults_close_a_stuck_connection_within_30_seconds() -> None:
    settings = load_config({}).settings
    assert settings.header_timeout <= 30 and settings.idle_timeout <= 30
    assert settings.body_timeout == 10


@pytest.mark.parametrize("name", ["header_timeout", "body_timeout"])
def test_a_timeout_of_zero_is_refused(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(f"FENCEGATE_{name.upper()}", "0")
    with pytest.raises(ConfigError, match=name):
        load_config({})


@pytest.mark.parametrize(
    ("open_files", "wanted", "expected"),
    [
        (1024, 10_000, 740),  # next to 200 upstream connections, a pool of 20 and a margin
        (256, 10_000, 86),  # few files: each busy connection may hold an upstream one too
        (1_048_576, 10_000, 10_000),  # the configured limit when the files allow it
        (64, 10_000, 1),
    ],
)
def test_the_connection_limit_fits_the_open_files_limit(
    open_files: int, wanted: int, expected: int
) -> None:
    assert connections_within(open_files, wanted=wanted, store_pool=20) == expected
