"""The release as a new user gets it: a copy of the project built into an sdist and a wheel
(``python -m build``, checked by ``twine check``), the wheel installed in a fresh virtualenv,
its ``fencegate --version`` and ``fencegate demo``, and each example run from the
repository's ``examples/`` folder with that virtualenv's Python. The legacy-API example also
puts the source checkout on ``PYTHONPATH`` for its gateway, so running from a checkout is
covered too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.support.processes import REPO_ROOT

pytestmark = pytest.mark.timeout(600)

EXAMPLES = REPO_ROOT / "examples"


def plain_env() -> dict[str, str]:
    """The environment without this test run's virtualenv or PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(sys.prefix)
    )
    return env


def pip(python: Path, *args: str) -> None:
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
        check=True,
        env=plain_env(),
        timeout=540,
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(python of a fresh venv with the built wheel installed, the copy it was built from)."""
    root = tmp_path_factory.mktemp("installed")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("fencegate", "sql"):
        shutil.copytree(REPO_ROOT / folder, source / folder, ignore=ignore)
    dist = root / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(dist), str(source)],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    artifacts = sorted(str(p) for p in dist.iterdir())
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *artifacts],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    [wheel] = dist.glob("fencegate-*.whl")
    venv.create(root / "venv", with_pip=True)
    python = root / "venv" / "bin" / "python"
    pip(python, str(wheel))
    return python, source


def run(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), *args],
        cwd=cwd,
        env=plain_env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_the_installed_package_is_not_the_source_tree(installed: tuple[Path, Path]) -> None:
    python, _ = installed
    done = run(python, "-c", "import fencegate; print(fencegate.__file__)", cwd=Path("/"))
    assert done.returncode == 0, done.stderr
    assert "site-packages" in done.stdout and str(REPO_ROOT) not in done.stdout


def test_the_wheel_says_its_version_and_runs_the_demo(
    installed: tuple[Path, Path], tmp_path: Path
) -> None:
    python, _ = installed
    fencegate = python.parent / "fencegate"
    version = subprocess.run(
        [str(fencegate), "--version"],
        cwd=tmp_path,
        env=plain_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == "fencegate 1.0.0"
    demo = subprocess.run(
        [str(fencegate), "demo"],
        cwd=tmp_path,
        env=plain_env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "412" in demo.stdout and "Traceback" not in demo.stderr


def test_middleware_example_checks_itself_without_extras(
    installed: tuple[Path, Path], tmp_path: Path
) -> None:
    python, _ = installed
    done = run(python, str(EXAMPLES / "middleware_starlette.py"), "--check", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stale, token 6   -> 412" in done.stdout
    assert "captures executed: 1" in done.stdout


def test_gateway_example_runs_installed_and_from_the_source_checkout(
    installed: tuple[Path, Path], tmp_path: Path
) -> None:
    python, _ = installed
    done = run(python, str(EXAMPLES / "gateway_legacy_api.py"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "a stale owner, token 41              -> 412 stale-fence" in done.stdout
    assert "tickets the legacy API created: 1" in done.stdout


def test_httpx_example_names_the_extra_then_runs_with_it(
    installed: tuple[Path, Path], tmp_path: Path
) -> None:
    python, source = installed
    without = run(python, str(EXAMPLES / "worker_httpx.py"), cwd=tmp_path)
    assert without.returncode != 0
    assert "Traceback" not in without.stderr
    assert "pip install 'fencegate[httpx]'" in without.stderr

    pip(python, f"{source}[httpx]")
    done = run(python, str(EXAMPLES / "worker_httpx.py"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "jobs: ['succeeded', 'succeeded', 'succeeded']" in done.stdout


def test_mcp_example_names_the_extra_then_runs_with_it(
    installed: tuple[Path, Path], tmp_path: Path
) -> None:
    python, source = installed
    without = run(python, str(EXAMPLES / "mcp_gateway.py"), cwd=tmp_path)
    assert without.returncode != 0
    assert "Traceback" not in without.stderr
    assert "pip install 'fencegate[mcp]'" in without.stderr

    pip(python, f"{source}[mcp]")
    done = run(python, str(EXAMPLES / "mcp_gateway.py"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [" ".join(line.split()) for line in done.stdout.splitlines()]
    assert "a copy while o-2 still runs -> JSON-RPC error -32062 (in-flight)" in lines
    assert "a replaced agent run, token 2 -> JSON-RPC error -32064 (stale-fence)" in lines
    assert "charges the MCP server executed: {'o-1': 1, 'o-2': 1}" in done.stdout
