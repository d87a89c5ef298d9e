"""fencegate across hosts: PostgreSQL, the gateway and the workers in network namespaces the
test makes (`tests/support/netns.py`), where a cut is a real link going down.

- A gateway host cut off from PostgreSQL mid-load: its clients (on the gateway's host) get
  only 503s while the link is down, and after it comes back every key has run once upstream
  and every answer replays as it was first given.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.netns import Sandbox, cannot_make_namespaces
from tests.support.processes import child_env
from tests.support.tiers import needs
from tests.support.topology import PgNode, give_to_server_user, missing
from tests.support.waits import wait_until_sync

pytestmark = pytest.mark.timeout(300)

UPSTREAM_PORT = 8001
GATEWAY_PORT = 8080


class Hosts:
    """The sandbox, PostgreSQL on host ``db``, and every process the test starts on a host."""

    def __init__(self, sandbox: Sandbox, db: PgNode, work: Path) -> None:
        self.sandbox = sandbox
        self.db = db
        self.work = work
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def database_url(self) -> str:
        return f"postgresql://postgres@{self.sandbox.addresses['db']}:5432/postgres"

    def start(self, host: str, *argv: str) -> subprocess.Popen[bytes]:
        log = (self.work / f"{host}-{len(self.procs)}.log").open("wb")
        proc = self.sandbox.popen(
            host, [sys.executable, *argv], env=child_env(), stdout=log, stderr=subprocess.STDOUT
        )
        self.procs.append(proc)
        return proc

    def python(self, host: str, code: str) -> str:
        return self.sandbox.run(host, [sys.executable, "-c", code])

    def answers(self, host: str, url: str) -> bool:
        code = (
            "import urllib.request,sys\n"
            f"try: urllib.request.urlopen({url!r}, timeout=2)\n"
            "except Exception: sys.exit(1)\n"
        )
        return (
            subprocess.run(
                self.sandbox.command(host, [sys.executable, "-c", code]),
                capture_output=True,
                timeout=30,
            ).returncode
            == 0
        )

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name} ---\n{p.read_text(errors='replace')[-2000:]}"
            for p in sorted(self.work.glob("*.log"))
        )

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    reason = cannot_make_namespaces() or missing("initdb")
    needs(reason, "topology")
    sandbox = Sandbox(["db", "gw", "w1", "w2"])
    sandbox.create()
    work = Path(tempfile.mkdtemp(prefix="fencegate-hosts-"))
    give_to_server_user(work)
    db = PgNode(work, "pg", host=sandbox.addresses["db"], wrap=sandbox.command("db", []))
    placed = Hosts(sandbox, db, work)
    try:
        db.init_primary()
        db.start()
        migrated = sandbox.run(
            "gw",
            [
                sys.executable,
                "-m",
                "fencegate.cli",
                "migrate",
                "--database-url",
                placed.database_url,
            ],
        )
        assert "applied" in migrated
        yield placed
    finally:
        placed.stop()
        print(placed.logs())  # shown when the test failed
        db.stop()
        sandbox.destroy()


def progress(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {"answers": 0, "503": 0}


def test_a_gateway_host_cut_off_from_postgresql_mid_load(hosts: Hosts) -> None:
    upstream = f"http://127.0.0.1:{UPSTREAM_PORT}"
    gateway = f"http://127.0.0.1:{GATEWAY_PORT}"
    hosts.start("gw", "-m", "tests.support.upstream", "--port", str(UPSTREAM_PORT))
    hosts.start(
        "gw",
        "-m",
        "fencegate.cli",
        "serve",
        "--upstream",
        upstream,
        "--host",
        "127.0.0.1",
        "--port",
        str(GATEWAY_PORT),
        "--database-url",
        hosts.database_url,
        "--store-timeout",
        "1",
    )
    wait_until_sync(
        lambda: hosts.answers("gw", gateway + "/healthz"), timeout=60, what="the gateway on gw"
    )
    stop, out, seen = hosts.work / "stop", hosts.work / "out.json", hosts.work / "progress"
    hosts.start(
        "gw",
        "-m",
        "tests.support.netns_load",
        "--gateway",
        gateway,
        "--upstream",
        upstream,
        "--stop",
        str(stop),
        "--out",
        str(out),
        "--progress",
        str(seen),
    )
    wait_until_sync(lambda: progress(seen)["answers"] >= 30, timeout=60, what="load")
    hosts.sandbox.cut("gw")  # the gateway host's link: PostgreSQL is unreachable from it
    wait_until_sync(lambda: progress(seen)["503"] >= 10, timeout=60, what="503s while cut")
    answered_while_cut = progress(seen)["answers"]
    hosts.sandbox.heal("gw")
    wait_until_sync(
        lambda: progress(seen)["answers"] >= answered_while_cut + 30,
        timeout=90,
        what="answers after the link came back",
    )
    stop.touch()
    wait_until_sync(out.exists, timeout=120, what="the load's report")
    report = json.loads(out.read_text())
    print(f"gateway host cut off: {report['statuses']}")
    assert set(report["statuses"]) <= {"200", "409", "503"}, report["statuses"]
    assert report["failed"] == []
    assert report["twice"] == []
    assert report["replays_differ"] == []


def test_the_unpleasant_test_across_hosts(hosts: Hosts) -> None:
    """W1 (its own host) claims the job and sends the capture through the gateway (another
    host); W1's link goes down while the request is in flight; the lease expires; W2 (a third
    host) claims with a larger token and retries, which the gateway replays; W1's link comes
    back: W1 cannot renew, cannot commit, its own client refuses, and its late request with
    the old token is refused with 412. The upstream executed once."""
    gateway = f"http://{hosts.sandbox.addresses['gw']}:{GATEWAY_PORT}"
    upstream = f"http://127.0.0.1:{UPSTREAM_PORT}"
    hosts.start("gw", "-m", "tests.support.upstream", "--port", str(UPSTREAM_PORT))
    hosts.start(
        "gw",
        "-m",
        "fencegate.cli",
        "serve",
        "--upstream",
        upstream,
        "--host",
        hosts.sandbox.addresses["gw"],
        "--port",
        str(GATEWAY_PORT),
        "--database-url",
        hosts.database_url,
    )
    wait_until_sync(
        lambda: hosts.answers("w2", gateway + "/healthz"), timeout=60, what="the gateway, from w2"
    )
    work = hosts.work
    common = ["--db", hosts.database_url, "--gateway", gateway, "--work", str(work)]
    job_id = int(
        hosts.sandbox.run(
            "w2",
            [
                sys.executable,
                "-m",
                "tests.support.netns_worker",
                "enqueue",
                "--invoice",
                "inv-1",
                *common,
            ],
        )
    )

    def executions() -> int:
        """How many times the upstream (on the gateway's host) received the capture."""
        return int(
            json.loads(
                hosts.python(
                    "gw",
                    (
                        "import urllib.request\n"
                        f"print(urllib.request.urlopen({upstream!r}"
                        " + '/_count?key=payment:inv-1:capture:capture')"
                        ".read().decode())"
                    ),
                )
            )["count"]
        )

    hosts.start("w1", "-m", "tests.support.netns_worker", "w1", *common)
    # The upstream counts the capture when it arrives and answers 2 s later (shorter than
    # the lease that W2 must wait out): cut W1 off only once its capture is in flight there,
    # not merely started by W1's client (it could still be on W1's side of the link).
    wait_until_sync(
        lambda: executions() >= 1, timeout=60, what="W1's capture at the upstream", interval=0.1
    )
    hosts.sandbox.cut("w1")  # W1's capture is in flight; W1 reaches nothing any more
    w2 = hosts.start("w2", "-m", "tests.support.netns_worker", "w2", "--job", str(job_id), *common)
    assert w2.wait(timeout=120) == 0, hosts.logs()
    hosts.sandbox.heal("w1")
    (work / "healed").touch()
    wait_until_sync((work / "w1.json").exists, timeout=120, what="W1's late attempts")
    w1 = json.loads((work / "w1.json").read_text())
    w2_report = json.loads((work / "w2.json").read_text())
    count = executions()
    print(f"across hosts: W1 {w1} W2 {w2_report} upstream executions {count}")

    [w2_answer] = w2_report["answers"]
    assert w2_answer["token"] > w1["token"]
    assert (w2_answer["status"], w2_answer["replayed"]) == (200, "true")
    assert w2_answer["execution"] == 1
    assert (w2_report["state"], w2_report["owner"]) == ("succeeded", "w2")
    assert w1["extend"] is None and w1["complete"] is False
    assert w1["own_client"] == "OwnershipLost"
    assert w1["raw_status"] == 412 and w1["raw_problem"]["type"].endswith("stale-fence")
    assert "result_committed" not in w1["events"]
    assert count == 1
