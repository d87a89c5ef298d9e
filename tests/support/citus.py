"""A Citus cluster for the tests: a coordinator and workers, each a private PostgreSQL on a
free loopback port with its own data folder, started with ``shared_preload_libraries =
'citus'``; ``CREATE EXTENSION citus`` in each node's database, then the coordinator is told
its own address and its workers (``citus_set_coordinator_host``, ``citus_add_node``).

Citus is not packaged everywhere: `missing_citus` says why the tier cannot run (the server
binaries, or the extension's library). PostgreSQL refuses to run as root; as root (CI) the
nodes run as the ``postgres`` OS user, like the topology tier's servers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import asyncpg

from tests.support.net import free_port, wait_for_port
from tests.support.postgres import pg_bindir
from tests.support.topology import give_to_server_user, run_as

SETTINGS = {
    "shared_preload_libraries": "citus",
    # Citus commits a transaction that writes on several nodes with two-phase commit.
    "max_prepared_transactions": "100",
    "max_connections": "300",
    "fsync": "off",
    "full_page_writes": "off",
    "synchronous_commit": "off",
    # A worker killed under load is noticed within a few seconds, not minutes.
    "citus.node_connection_timeout": "3000",
}


def missing_citus() -> str | None:
    """Why a Citus cluster cannot start here, or None."""
    bindir = pg_bindir()
    if bindir is None:
        return "no PostgreSQL server binaries (initdb, pg_ctl) on this machine"
    out = subprocess.run(
        [
            os.path.join(bindir, "pg_config")
            if os.path.exists(os.path.join(bindir, "pg_config"))
            else shutil.which("pg_config") or "pg_config",
            "--pkglibdir",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    libdir = out.stdout.strip() or os.path.join(os.path.dirname(bindir), "lib")
    if not os.path.exists(os.path.join(libdir, "citus.so")):
        return f"Citus is not installed into this PostgreSQL ({libdir}/citus.so is missing)"
    return None


class CitusNode:
    """One node: a private PostgreSQL with Citus preloaded."""

    def __init__(self, root: Path, name: str) -> None:
        bindir = pg_bindir()
        assert bindir is not None
        self.bin = bindir
        self.name = name
        self.dir = root / name
        self.port = free_port()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str) -> None:
        done = subprocess.run([*run_as(), *args], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            log = self.dir / "log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed: {done.stderr}{tail}")

    def init(self) -> None:
        self._run(
            f"{self.bin}/initdb",
            "-D",
            str(self.dir),
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
            "--no-instructions",
        )
        with (self.dir / "postgresql.auto.conf").open("a") as conf:
            for name, value in SETTINGS.items():
                conf.write(f"{name} = '{value}'\n")

    def start(self) -> None:
        self.clear_stale_pid()
        self._run(
            f"{self.bin}/pg_ctl",
            "-D",
            str(self.dir),
            "-w",
            "-t",
            "60",
            "-l",
            str(self.dir / "log"),
            "-o",
            f"-p {self.port} -k {self.dir} -h 127.0.0.1",
            "start",
        )
        wait_for_port(self.port)

    def pid(self) -> int | None:
        try:
            return int((self.dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def kill(self) -> None:
        """SIGKILL to the node's every process at once, as a host that dies: the postmaster
        and each of its children (backends, the checkpointer, Citus's daemon)."""
        pid = self.pid()
        if pid is None:
            return
        for victim in [pid, *_children(pid)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(victim, signal.SIGKILL)

    def clear_stale_pid(self, timeout: float = 30.0) -> None:
        """A postmaster killed with -9 may stay a zombie (where nothing reaps it, or reaps
        late) named in ``postmaster.pid`` and in its socket's lock file: a new postmaster
        that finds either naming a process that still exists refuses to start ("lock file
        already exists"). Wait for it to stop running, then remove the files it left."""
        pid = self.pid()
        if pid is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _running(pid):
                break
            time.sleep(0.05)
        socket = f".s.PGSQL.{self.port}"
        for left in ("postmaster.pid", f"{socket}.lock", socket):
            with contextlib.suppress(FileNotFoundError):
                (self.dir / left).unlink()

    def stop(self) -> None:
        subprocess.run(
            [*run_as(), f"{self.bin}/pg_ctl", "-D", str(self.dir), "-m", "immediate", "stop"],
            capture_output=True,
            timeout=60,
        )


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == str(pid):
            found.append(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class CitusCluster:
    """A coordinator and ``workers`` workers on loopback, under one temporary folder."""

    def __init__(self, workers: int = 2, root: Path | None = None) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="fencegate-citus-", dir=root))
        give_to_server_user(self.root)
        self.coordinator = CitusNode(self.root, "coordinator")
        self.workers = [CitusNode(self.root, f"worker{i + 1}") for i in range(workers)]

    @property
    def nodes(self) -> list[CitusNode]:
        return [self.coordinator, *self.workers]

    def start(self) -> None:
        for node in self.nodes:
            node.init()
            node.start()

    async def create_database(self, name: str) -> str:
        """A database of that name on every node, with the extension, the workers added to
        the coordinator's: its URL on the coordinator."""
        for node in self.nodes:
            conn = await asyncpg.connect(node.url(), timeout=30)
            try:
                await conn.execute(f'CREATE DATABASE "{name}"')
            finally:
                await conn.close()
            conn = await asyncpg.connect(node.url(name), timeout=30)
            try:
                await conn.execute("CREATE EXTENSION citus")
            finally:
                await conn.close()
        conn = await asyncpg.connect(self.coordinator.url(name), timeout=30)
        try:
            await conn.execute(
                "SELECT citus_set_coordinator_host('127.0.0.1', $1)", self.coordinator.port
            )
            for worker in self.workers:
                await conn.execute("SELECT citus_add_node('127.0.0.1', $1)", worker.port)
        finally:
            await conn.close()
        return self.coordinator.url(name)

    def add_worker(self) -> CitusNode:
        """One more worker, started (the caller adds it to a database's cluster)."""
        node = CitusNode(self.root, f"worker{len(self.workers) + 1}")
        node.init()
        node.start()
        self.workers.append(node)
        return node

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.root, ignore_errors=True)
