"""Real PostgreSQL topologies for the tests: a private primary with a streaming standby, and a
PgBouncer in front of a server. Everything listens on 127.0.0.1 on free ports, lives under a
temporary directory and is stopped by the caller (`stop()`), even after a failure.

PostgreSQL and PgBouncer refuse to run as root; as root (CI) they run as the ``postgres`` OS
user, like the private cluster in tests/support/postgres.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from tests.support.net import free_port, wait_for_port
from tests.support.postgres import pg_bindir, user_exists


def server_user() -> str | None:
    """The unprivileged user servers run as when the tests run as root (else None)."""
    if os.geteuid() != 0:
        return None
    return "postgres" if user_exists("postgres") else "nobody"


def run_as() -> list[str]:
    """The prefix that runs a command as `server_user`."""
    user = server_user()
    return [] if user is None else ["runuser", "-u", user, "--"]


def give_to_server_user(path: Path) -> None:
    user = server_user()
    if user is not None:
        shutil.chown(path, user)
        for child in path.rglob("*"):
            shutil.chown(child, user)


def missing(*commands: str) -> str | None:
    """Why these topology tests cannot run here, or None."""
    for command in commands:
        if command in ("initdb", "pg_basebackup", "pg_ctl"):
            if pg_bindir() is None:
                return f"no PostgreSQL server binaries ({command}) on this machine"
        elif shutil.which(command) is None:
            return f"{command} is not installed (apt-get install {command})"
    return None


class PgNode:
    """One private PostgreSQL server (primary, or a standby of one)."""

    def __init__(
        self, root: Path, name: str, *, host: str = "127.0.0.1", wrap: Sequence[str] = ()
    ) -> None:
        """``host``: the address it listens on (trusted for every client in its /24);
        ``wrap``: a prefix for its commands, e.g. ``ip netns exec NS`` to run it there."""
        bindir = pg_bindir()
        assert bindir is not None
        self.bin = bindir
        self.dir = root / name
        self.host = host
        self.wrap = list(wrap)
        self.port = free_port() if host == "127.0.0.1" else 5432
        self.url = f"postgresql://postgres@{host}:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        done = subprocess.run(
            [*self.wrap, *run_as(), *args], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            log = self.dir / "log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed: {done.stderr}{tail}")

    def init_primary(self) -> None:
        self._run(f"{self.bin}/initdb", "-D", str(self.dir), "-A", "trust", "-U", "postgres")
        with (self.dir / "pg_hba.conf").open("a") as hba:
            hba.write("host replication all 127.0.0.1/32 trust\n")
            if self.host != "127.0.0.1":
                network = self.host.rsplit(".", 1)[0] + ".0/24"
                hba.write(f"host all all {network} trust\n")

    def init_standby(self, primary: PgNode) -> None:
        self._run(
            f"{self.bin}/pg_basebackup", "-D", str(self.dir), "-h", "127.0.0.1",
            "-p", str(primary.port), "-U", "postgres", "-R", "-X", "stream",
        )  # fmt: skip
        # The standby's name, which synchronous_standby_names matches.
        with (self.dir / "postgresql.auto.conf").open("a") as conf:
            conf.write(
                f"primary_conninfo = 'host=127.0.0.1 port={primary.port} user=postgres "
                "application_name=standby1'\n"
            )

    def start(self) -> None:
        self._run(
            f"{self.bin}/pg_ctl", "-D", str(self.dir), "-w", "-l", str(self.dir / "log"),
            "-o", f"-p {self.port} -k {self.dir} -h {self.host} -c max_connections=100",
            "start",
        )  # fmt: skip
        if not self.wrap:
            wait_for_port(self.port)  # pg_ctl -w has waited already; this is the socket

    def stop(self) -> None:
        subprocess.run(
            [
                *self.wrap,
                *run_as(),
                f"{self.bin}/pg_ctl",
                "-D",
                str(self.dir),
                "-m",
                "immediate",
                "stop",
            ],
            capture_output=True,
            timeout=60,
        )


class PrimaryWithStandby:
    """A primary and one streaming standby (asynchronous until `make_synchronous`)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="fencegate-replicas-"))
        give_to_server_user(self.root)
        self.primary = PgNode(self.root, "primary")
        self.standby = PgNode(self.root, "standby")

    def start(self) -> None:
        self.primary.init_primary()
        self.primary.start()
        self.standby.init_standby(self.primary)
        self.standby.start()

    def stop(self) -> None:
        self.standby.stop()
        self.primary.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class PgBouncer:
    """PgBouncer on a free loopback port in front of the server a URL names, every database
    passed through (``* =``), trust authentication for the users given."""

    def __init__(
        self, server_url: str, *, pool_mode: str = "transaction", users: tuple[str, ...] = ()
    ) -> None:
        parts = urlsplit(server_url)
        self.server_host = parts.hostname or "127.0.0.1"
        self.server_port = parts.port or 5432
        self.user = parts.username or "postgres"
        self.users = {self.user, *users}
        self.pool_mode = pool_mode
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="fencegate-pgbouncer-"))
        self._proc: subprocess.Popen[bytes] | None = None

    def url(self, database: str, *, query: str = "") -> str:
        tail = f"?{query}" if query else ""
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}{tail}"

    def start(self) -> None:
        (self.dir / "users.txt").write_text("".join(f'"{u}" ""\n' for u in sorted(self.users)))
        (self.dir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={self.server_host} port={self.server_port}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.dir / 'users.txt'}\n"
            f"pool_mode = {self.pool_mode}\n"
            "max_client_conn = 400\ndefault_pool_size = 8\n"
            # A stale server connection after a test's database is dropped is closed fast.
            "server_check_delay = 0\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\n"
        )
        give_to_server_user(self.dir)
        user = server_user()
        self._proc = subprocess.Popen(
            ["pgbouncer", str(self.dir / "pgbouncer.ini")],
            user=user,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            wait_for_port(self.port, timeout=15)
        except TimeoutError:
            self.stop()
            raise

    def log(self) -> str:
        path = self.dir / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)
