"""A real high-availability PostgreSQL for the failover tests: one etcd and two Patroni nodes
managing PostgreSQL 15 (a primary and a streaming standby), all on free loopback ports under
one temporary directory. `stop()` ends every process it started, even after a failure.

Patroni runs as the ``postgres`` OS user when the tests run as root (PostgreSQL refuses root).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg

from tests.support.net import free_port, wait_for_port
from tests.support.postgres import pg_bindir
from tests.support.topology import give_to_server_user, server_user


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        body = exc.read()
        return exc.code, json.loads(body) if body.startswith(b"{") else {}


class PatroniNode:
    def __init__(self, cluster: PatroniCluster, name: str) -> None:
        self.cluster = cluster
        self.name = name
        self.pg_port = free_port()
        self.api_port = free_port()
        self.dir = cluster.root / name
        self.config = cluster.root / f"{name}.yml"
        self.log = cluster.root / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def write_config(self, *, synchronous: bool) -> None:
        c = self.cluster
        self.config.write_text(
            json.dumps(  # YAML is a superset of JSON
                {
                    "scope": c.scope,
                    "name": self.name,
                    "log": {"level": "INFO"},
                    "restapi": {
                        "listen": f"127.0.0.1:{self.api_port}",
                        "connect_address": f"127.0.0.1:{self.api_port}",
                    },
                    "etcd3": {"hosts": [f"127.0.0.1:{c.etcd_port}"]},
                    "bootstrap": {
                        "dcs": {
                            "ttl": 20,
                            "loop_wait": 1,
                            "retry_timeout": 5,
                            "synchronous_mode": synchronous,
                            # Asynchronous: promote however far behind (the loss is the point).
                            "maximum_lag_on_failover": 1 << 40,
                            # A crashed primary is failed over at once, not restarted in place.
                            "primary_start_timeout": 0,
                            "postgresql": {
                                "use_pg_rewind": True,
                                "parameters": {"wal_log_hints": "on", "max_connections": 100},
                            },
                        },
                        "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}],
                    },
                    "postgresql": {
                        "listen": f"127.0.0.1:{self.pg_port}",
                        "connect_address": f"127.0.0.1:{self.pg_port}",
                        "data_dir": str(self.dir),
                        "bin_dir": c.bindir,
                        "pgpass": str(c.root / f"{self.name}.pgpass"),
                        "authentication": {
                            "superuser": {"username": "postgres", "password": "fg"},
                            "replication": {"username": "replicator", "password": "fg"},
                            "rewind": {"username": "postgres", "password": "fg"},
                        },
                        "pg_hba": [
                            "local all all trust",
                            "host all all 127.0.0.1/32 trust",
                            "host replication all 127.0.0.1/32 trust",
                        ],
                        "parameters": {"unix_socket_directories": str(c.root)},
                    },
                }
            )
        )

    def start(self) -> None:
        user = server_user()
        env = {**os.environ, "HOME": str(self.cluster.root)}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                ["patroni", str(self.config)],
                user=user,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def role(self) -> str | None:
        """``primary``, ``replica`` or None (not answering)."""
        try:
            _, body = _get(f"http://127.0.0.1:{self.api_port}/patroni")
        except OSError:
            return None
        role = body.get("role")
        return "primary" if role in ("master", "primary") else role

    def postmaster_pid(self) -> int | None:
        pidfile = self.dir / "postmaster.pid"
        try:
            return int(pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill_postmaster(self) -> None:
        pid = self.postmaster_pid()
        assert pid is not None, f"{self.name}: no postmaster"
        os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        """SIGKILL to Patroni and its postmaster: the host dies, nothing cleaned up."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        # Patroni's postmaster may outlive it, and the postmaster's children (a walsender
        # still streaming, backends) outlive a SIGKILLed postmaster: all of them, found by
        # parent before the postmaster dies and they are reparented.
        pid = self.postmaster_pid()
        if pid is not None:
            for victim in [pid, *_children(pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # pid (comm) state ppid …; comm may hold spaces, so split after its ")".
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
    return found


class PatroniCluster:
    def __init__(self, *, synchronous: bool) -> None:
        bindir = pg_bindir()
        assert bindir is not None
        self.bindir = bindir
        self.synchronous = synchronous
        self.root = Path(tempfile.mkdtemp(prefix="fencegate-patroni-"))
        self.scope = "fg-" + uuid.uuid4().hex[:8]
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.etcd: subprocess.Popen[bytes] | None = None
        self.nodes = [PatroniNode(self, "node0"), PatroniNode(self, "node1")]

    @property
    def url(self) -> str:
        """The multi-host URL a gateway or worker uses: the host that accepts writes."""
        hosts = ",".join(f"127.0.0.1:{n.pg_port}" for n in self.nodes)
        return f"postgresql://postgres@{hosts}/postgres?target_session_attrs=read-write"

    def start(self, *, timeout: float = 120.0) -> None:
        give_to_server_user(self.root)
        etcd_dir = self.root / "etcd"
        with (self.root / "etcd.log").open("ab") as log:
            self.etcd = subprocess.Popen(
                [
                    "etcd", "--name", "e0", "--data-dir", str(etcd_dir),
                    "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                    "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                    "--listen-peer-urls", f"http://127.0.0.1:{self.etcd_peer_port}",
                    "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.etcd_peer_port}",
                    "--initial-cluster", f"e0=http://127.0.0.1:{self.etcd_peer_port}",
                ],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        wait_for_port(self.etcd_port, timeout=30)
        for node in self.nodes:
            node.write_config(synchronous=self.synchronous)
            give_to_server_user(node.config)
        self.nodes[0].start()
        self.wait_for(lambda: self.nodes[0].role() == "primary", timeout, "node0 to lead")
        self.nodes[1].start()
        self.wait_for(self.replicating, timeout, "node1 to stream from node0")

    def replicating(self) -> bool:
        """Both nodes up, one primary, and (synchronous mode) its standby synchronous."""
        roles = sorted(str(n.role()) for n in self.nodes)
        if roles != ["primary", "replica"]:
            return False
        _, cluster = _get(f"http://127.0.0.1:{self.nodes[0].api_port}/cluster")
        members = cluster.get("members", [])
        states = {m.get("role"): m.get("state") for m in members}
        wanted = "sync_standby" if self.synchronous else "replica"
        return states.get(wanted) in ("running", "streaming")

    def primary(self) -> PatroniNode:
        for node in self.nodes:
            if node.role() == "primary":
                return node
        raise AssertionError("no primary")

    def wait_for(self, condition: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(0.2)
        logs = "\n".join(
            f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.root.glob("*.log"))
        )
        raise TimeoutError(f"waited {timeout}s for {what}\n{logs}")

    async def wait_for_database(self, url: str, *, timeout: float = 60.0) -> None:
        """Until every node has replayed the creation of the database ``url`` names: a
        multi-host URL stops at the first host that says it does not exist."""
        name = urlsplit(url).path.lstrip("/")
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            while True:
                try:
                    conn = await asyncpg.connect(
                        f"postgresql://postgres@127.0.0.1:{node.pg_port}/{name}", timeout=5
                    )
                    await conn.close()
                    break
                except (OSError, asyncpg.PostgresError):
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.1)

    def patronictl(self, *args: str) -> str:
        done = subprocess.run(
            ["patronictl", "-c", str(self.nodes[0].config), *args],
            capture_output=True, text=True, timeout=60, user=server_user(),
            env={**os.environ, "HOME": str(self.root)},
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"patronictl {' '.join(args)}: {done.stdout}{done.stderr}")
        return done.stdout

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        if self.etcd is not None and self.etcd.poll() is None:
            os.killpg(self.etcd.pid, signal.SIGKILL)
            self.etcd.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)
