"""What the operator's commands say when something is off, and the one vocabulary of key
states they share with the gateway's 424 and the console. Run as a user runs them
(`python -m fencegate.cli`), on both stores."""

from __future__ import annotations

import asyncio
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from fencegate import FenceGateMiddleware
from fencegate.gateway.routes import RoutePolicy
from fencegate.store import open_gateway_store
from tests.support import postgres
from tests.support.asgi import call
from tests.support.echo_app import EchoApp
from tests.support.processes import child_env, fencegate
from tests.support.stories import (
    LEASE_EXPIRED_BODY,
    gateway_stopped_in_flight,
    request,
    two_workers_one_fenced_off,
)

pytestmark = pytest.mark.timeout(120)


def one_clear_line(done: subprocess.CompletedProcess[str]) -> str:
    """The error a person reads: exit status 2, one line, no traceback, nothing on stdout."""
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr and "Error:" not in lines[0].split(": error: ")[1]
    return lines[0]


@pytest.mark.parametrize(
    "command",
    [
        ["keys", "list"],
        ["keys", "show", "k"],
        ["jobs", "list"],
        ["trace", "job:1"],
        ["fences", "show", "e"],
        ["audit", "list"],
        ["purge"],
        ["keys", "resolve", "k", "--release"],
        ["jobs", "purge", "--older-than", "7d"],
    ],
)
def test_a_read_or_action_without_a_store_creates_none_and_says_what_to_do(
    command: list[str], tmp_path: Path
) -> None:
    line = one_clear_line(fencegate(*command, cwd=tmp_path))
    assert f"the SQLite store sqlite:///fencegate.db ({tmp_path / 'fencegate.db'})" in line
    assert "does not exist" in line
    assert "--database-url" in line and "fencegate migrate" in line
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_an_empty_sqlite_file_is_named_with_what_to_do(tmp_path: Path) -> None:
    empty = tmp_path / "other.db"
    empty.touch()
    line = one_clear_line(fencegate("keys", "list", "--database-url", f"sqlite:///{empty}"))
    assert f"({empty}) holds no fencegate schema" in line
    assert f"fencegate migrate --database-url sqlite:///{empty}" in line
    assert empty.stat().st_size == 0


def test_an_unmigrated_postgresql_database_is_named_with_what_to_do(pg_server_url: str) -> None:
    url = asyncio.run(postgres.create_database(pg_server_url))
    try:
        line = one_clear_line(fencegate("jobs", "list", "--database-url", url))
        assert f"PostgreSQL at {url} holds no fencegate schema" in line
        assert f"fencegate migrate --database-url {url}" in line
        assert "UndefinedTable" not in line
    finally:
        asyncio.run(postgres.drop_database(pg_server_url, url))


def test_migrate_on_an_unreachable_postgresql_names_it_without_the_password() -> None:
    url = "postgresql://night-op:s3cret@127.0.0.1:1/fencegate"
    line = one_clear_line(fencegate("migrate", "--database-url", url))
    assert "cannot migrate PostgreSQL at postgresql://night-op:***@127.0.0.1:1/fencegate" in line
    assert "s3cret" not in line


def test_a_bad_option_value_is_one_clean_line(sqlite_url: str) -> None:
    line = one_clear_line(
        fencegate("jobs", "purge", "--older-than", "banana", "--database-url", sqlite_url)
    )
    assert line == (
        "fencegate jobs: error: --older-than 'banana': give a number and a unit, e.g. 7d or 12h"
    )
    assert "CommandError" not in line


def test_serve_with_a_bad_database_url_prints_only_that() -> None:
    done = fencegate("serve", "--upstream", "http://127.0.0.1:9", "--database-url", "bogus://x")
    line = one_clear_line(done)
    assert "unsupported database URL 'bogus://x'" in line
    assert "INFO" not in done.stderr


def test_help_describes_every_sub_command_and_the_console_address() -> None:
    for command in (
        ["keys", "list"],
        ["keys", "show"],
        ["jobs", "show"],
        ["jobs", "purge"],
        ["fences", "show"],
        ["audit", "list"],
    ):
        shown = fencegate(*command, "--help")
        assert shown.returncode == 0
        description = shown.stdout.split("\n\n")[1]
        assert not description.startswith(("options:", "positional")), (command, shown.stdout)
    console = fencegate("console", "--help").stdout
    assert "address to listen on" in console and "port to listen on" in console


async def answer_424(url: str, key: str) -> Any:
    gate = FenceGateMiddleware(
        EchoApp(), database_url=url, routes=[RoutePolicy(prefix="/v1")], store_timeout=30.0
    )
    try:
        answer = await call(
            gate,
            "POST",
            "/v1/refunds",
            body=LEASE_EXPIRED_BODY,
            headers=[("idempotency-key", key), ("content-type", "application/json")],
        )
    finally:
        await gate.close()
    assert answer.status == 424, answer.body
    return answer.json()


def test_a_lease_expired_key_is_outcome_unknown_in_the_424_and_the_commands(
    store_url: str, store_kind: str, tmp_path: Path
) -> None:
    key = asyncio.run(gateway_stopped_in_flight(store_url))
    problem = asyncio.run(answer_424(store_url, key))
    assert (problem["key_state"], problem["reason"]) == ("outcome_unknown", "lease_expired")

    listed = fencegate(
        "keys", "list", "--state", "outcome_unknown", "--json", "--database-url", store_url
    )
    [row] = orjson.loads(listed.stdout)["keys"]
    assert (row["key"], row["state"], row["reason"]) == (key, "outcome_unknown", "lease_expired")
    live = fencegate("keys", "list", "--state", "in_flight", "--json", "--database-url", store_url)
    assert orjson.loads(live.stdout)["keys"] == []
    table = fencegate("keys", "list", "--database-url", store_url).stdout.splitlines()
    assert table[0].split()[:4] == ["TENANT", "KEY", "STATE", "REASON"]
    assert "outcome_unknown  lease_expired" in table[1]
    shown = fencegate("keys", "show", key, "--json", "--database-url", store_url)
    fields = orjson.loads(shown.stdout)
    assert (fields["state"], fields["reason"]) == ("outcome_unknown", "lease_expired")
    text = fencegate("keys", "show", key, "--database-url", store_url).stdout
    assert "reason" in text and "lease_expired" in text

    # The 424's commands, run as given from another directory, resolve the key. (The story's
    # request is not on its way: the operator's environment sets the release margin to 0.)
    completed, release = problem["resolve"]
    assert "--body @answer.json" in completed and "--database-url" in completed
    (tmp_path / "answer.json").write_text('{"id": "re_1"}')
    command = completed.replace(" N ", " 201 ", 1).replace("fencegate ", "", 1)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fencegate.cli",
            *shlex.split(command.replace('"$FENCEGATE_DATABASE_URL"', shlex.quote(store_url))),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env({"FENCEGATE_RELEASE_MARGIN": "0"}),
    )
    assert done.returncode == 0, done.stderr
    after = orjson.loads(
        fencegate("keys", "show", key, "--json", "--database-url", store_url).stdout
    )
    assert (after["state"], after["response_status"], after["reason"]) == ("completed", 201, None)
    # The API client learns nothing of where the store is (a SQLite file's path used to be
    # in the body); the operator's own FENCEGATE_DATABASE_URL names it.
    assert '--database-url "$FENCEGATE_DATABASE_URL"' in release
    where = store_url.removeprefix("sqlite:///") if store_kind == "sqlite" else "127.0.0.1"
    assert where not in orjson.dumps(problem).decode()


def test_audit_list_shows_who_did_what_and_why(store_url: str) -> None:
    asyncio.run(two_workers_one_fenced_off(store_url))
    key = "capture:inv-1:POST /v1/charges"
    resolved = fencegate(
        "keys",
        "resolve",
        key,
        "--tenant",
        "acme",
        "--database-url",
        store_url,
        "--release",
        "--by",
        "night-op",
        "--reason",
        "upstream has no charge",
        "--release-margin",
        "0",
    )
    assert resolved.returncode == 0, resolved.stderr
    [row] = orjson.loads(fencegate("audit", "list", "--json", "--database-url", store_url).stdout)[
        "audit"
    ]
    assert (row["actor"], row["action"], row["subject"], row["reason"]) == (
        "operator:night-op",
        "keys.resolve_released",
        key,
        "upstream has no charge",
    )
    assert row["before"]["state"] == "outcome_unknown"
    text = fencegate("audit", "list", "--database-url", store_url).stdout
    assert "operator:night-op" in text and "keys.resolve_released" in text
    assert "state outcome_unknown -> released" in text and "None" not in text

    # The released key stays visible with its history, the operator's action as the operator's.
    shown = fencegate("keys", "show", key, "--tenant", "acme", "--database-url", store_url)
    assert shown.returncode == 0, shown.stderr
    assert "has no record now: released by operator:night-op" in shown.stdout
    document = orjson.loads(
        fencegate(
            "keys", "show", key, "--tenant", "acme", "--json", "--database-url", store_url
        ).stdout
    )
    assert document["state"] == "released"
    last = document["history"][-1]
    assert (last["source"], last["what"]) == ("operator", "resolved_released")
    trace = orjson.loads(
        fencegate("trace", key, "--tenant", "acme", "--json", "--database-url", store_url).stdout
    )
    sources = {e["what"]: e["source"] for e in trace["events"] if e.get("key") == key}
    assert sources["resolved_released"] == "operator" and sources["reserved"] == "gateway"


async def a_foreign_request_with_a_queue_token(url: str, token: int) -> None:
    """A caller outside the queue sends a fence that happens to equal a job's token."""
    store = await open_gateway_store(url, run_migrations=False)
    try:
        decision = await store.decide(
            request(token, "gw/9", "manual:refund-9", "invoice:inv-9"), timeout=30
        )
        assert decision.outcome == "reserved"
    finally:
        await store.close()


def test_a_request_is_attributed_to_a_worker_only_when_it_carries_the_jobs_identity(
    store_url: str,
) -> None:
    job, first, _ = asyncio.run(two_workers_one_fenced_off(store_url))
    asyncio.run(a_foreign_request_with_a_queue_token(store_url, first))

    foreign = orjson.loads(
        fencegate("trace", "invoice:inv-9", "--json", "--database-url", store_url).stdout
    )
    [decision] = foreign["events"]
    assert (decision["source"], decision["token"], decision["worker"]) == ("gateway", first, None)
    shown = orjson.loads(
        fencegate(
            "keys",
            "show",
            "manual:refund-9",
            "--tenant",
            "acme",
            "--json",
            "--database-url",
            store_url,
        ).stdout
    )
    assert [h["worker"] for h in shown["history"]] == [None]

    # The job's own requests (its key and entity job:<id>) still name their workers.
    ours = orjson.loads(
        fencegate("trace", f"job:{job}", "--json", "--database-url", store_url).stdout
    )
    workers = {e["what"]: e["worker"] for e in ours["events"] if e["source"] == "gateway"}
    assert (workers["reserved"], workers["stale"]) == ("worker-2", "worker-1")
    charge = orjson.loads(
        fencegate(
            "trace",
            "capture:inv-1:POST /v1/charges",
            "--tenant",
            "acme",
            "--json",
            "--database-url",
            store_url,
        ).stdout
    )
    assert "heartbeat_lost" in [e["what"] for e in charge["events"]]


def test_jobs_commands_offer_no_tenant_since_jobs_carry_none(sqlite_url: str) -> None:
    """`jobs list --help` used to offer --tenant, then refuse it when used."""
    helped = fencegate("jobs", "list", "--help")
    assert helped.returncode == 0 and "--tenant" not in helped.stdout
    listed = fencegate("jobs", "list", "--database-url", sqlite_url, FENCEGATE_TENANT="acme")
    assert listed.returncode == 0, listed.stderr


def test_serve_on_a_port_in_use_says_so_in_one_line_before_starting() -> None:
    """It used to print "Application startup complete", then an [Errno 98] line."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = fencegate("serve", "--upstream", "http://127.0.0.1:9", "--port", str(port))
    line = one_clear_line(done)
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in line
    assert "startup complete" not in done.stderr
