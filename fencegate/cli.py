"""The `fencegate` command. Each subcommand lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int``; this file only dispatches."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# CommandError lives below every part (the subcommands raise it, and the store check this
# file runs before them too); importable from here as it always was.
from fencegate import __version__
from fencegate.errors import CommandError

__all__ = ["SUBCOMMANDS", "CommandError", "build_parser", "main"]

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("fencegate.commands.serve", "run the gateway in front of an upstream HTTP API"),
    "migrate": ("fencegate.commands.migrate", "apply the SQL migrations to the store"),
    "purge": ("fencegate.commands.purge", "delete expired idempotency keys, fences and nonces"),
    "keys": (
        "fencegate.commands.keys",
        "show an idempotency key, or resolve one whose outcome is unknown",
    ),
    "fences": ("fencegate.commands.fences", "show an entity's fence and its fenced decisions"),
    "jobs": ("fencegate.commands.jobs", "list, show, retry, cancel and purge lease-queue jobs"),
    "trace": (
        "fencegate.commands.trace",
        "one timeline of an entity or key: decisions, lease grants, tokens, fenced-off requests",
    ),
    "audit": (
        "fencegate.commands.audit",
        "the audit log: every operator action, who did it, why, before and after",
    ),
    "console": (
        "fencegate.commands.console",
        "the operator's web console: overview, jobs, keys, traces, audited actions",
    ),
    "demo": ("fencegate.commands.demo", "run the whole lease/fence story on the embedded store"),
    "sign": (
        "fencegate.commands.sign",
        "sign one HTTP request (RFC 9421) for curl or other callers",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fencegate",
        description="Idempotency keys and fencing tokens in front of any HTTP API.",
    )
    parser.add_argument("--version", action="version", version=f"fencegate {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        # Every subcommand ships with the package: one that does not import is a broken
        # install, and says so at once rather than vanishing from the help.
        module = importlib.import_module(module_name)
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command_parser)
        # Operator reads and actions work on an existing, migrated store, never create one.
        existing = bool(getattr(module, "NEEDS_EXISTING_STORE", False))
        command_parser.set_defaults(_run=module.run, _existing_store=existing)
        describe_actions(command_parser)
    return parser


def describe_actions(parser: argparse.ArgumentParser) -> None:
    """Give every nested sub-command (``keys list``, ``jobs show``) its one-line help as the
    description its own ``--help`` prints, unless it has one already."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for choice in action._choices_actions:
            child = action.choices[choice.dest]
            if not child.description and choice.help:
                child.description = choice.help[0].upper() + choice.help[1:] + "."
            describe_actions(child)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args._existing_store:
            from fencegate.commands.existing_store import require_existing_store

            require_existing_store(args.database_url, timeout=getattr(args, "timeout", 10.0))
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except CommandError as exc:
        print(f"fencegate {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # Run through the imported module, so that `python -m fencegate.cli` catches the same
    # CommandError class the subcommands raise (not a second copy defined in __main__).
    from fencegate.cli import main as _main

    sys.exit(_main())
