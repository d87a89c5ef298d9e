"""`fencegate demo`: run the lease/fence story of a stale worker on the embedded store."""

from __future__ import annotations

import argparse

from fencegate.errors import CommandError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Start a fake payment API, the gateway in front of it and two workers on a temporary "
        "SQLite store; cut W1 off from the store mid-capture and show, as an event log, how "
        "W2 takes over and W1 is fenced off. Needs no set-up; takes a few seconds."
    )


def run(args: argparse.Namespace) -> int:
    from fencegate.commands.demo_story import main

    try:
        return main()
    except (TimeoutError, RuntimeError, OSError) as exc:
        raise CommandError(f"the demo could not run: {exc}") from exc
