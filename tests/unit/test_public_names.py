"""The names a user imports keep working: every ``from fencegate… import …`` in the code of the
README and of the documentation site, the contract's spelling of the middleware, and one error
root under every public exception."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pkgutil
import re
from pathlib import Path

import fencegate
from fencegate import FencegateError

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def readme_imports() -> list[tuple[str, str]]:
    """(module, name) for every name the Python blocks of the README and the documentation
    import from fencegate."""
    names: list[tuple[str, str]] = []
    text = "\n".join(page.read_text(encoding="utf-8") for page in PAGES)
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        for line in block.splitlines():
            if not line.startswith("from fencegate"):
                continue
            node = ast.parse(line).body[0]
            assert isinstance(node, ast.ImportFrom) and node.module is not None
            names.extend((node.module, alias.name) for alias in node.names)
    return names


def test_every_name_the_readme_imports_exists() -> None:
    names = readme_imports()
    assert ("fencegate", "FencegateMiddleware") in names  # the middleware example
    assert ("fencegate.lease", "Worker") in names  # the workers guide
    for module, name in names:
        assert hasattr(importlib.import_module(module), name), f"from {module} import {name}"


def test_the_contract_spelling_is_the_same_object_and_the_old_modules_are_gone() -> None:
    """DESIGN §4 spells the middleware ``FenceGateMiddleware``; the shims of pre-1.0 module
    paths are gone (their names live in fencegate.problems and fencegate.operator_actions)."""
    assert fencegate.FenceGateMiddleware is fencegate.FencegateMiddleware
    for gone in ("fencegate.gateway.problems", "fencegate.commands.actions"):
        assert importlib.util.find_spec(gone) is None, gone


def _modules() -> list[str]:
    return [
        info.name
        for info in pkgutil.walk_packages(fencegate.__path__, "fencegate.")
        if not info.name.endswith("__main__")
    ]


def test_every_public_exception_is_under_the_one_root() -> None:
    strays = []
    for module_name in _modules():
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__.startswith("fencegate")
                and not name.startswith("_")
                and not issubclass(value, FencegateError)
            ):
                strays.append(f"{value.__module__}.{name}")
    assert strays == []
