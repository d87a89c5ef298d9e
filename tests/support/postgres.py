"""Where the tests find PostgreSQL.

1. ``FENCEGATE_TEST_DATABASE_URL`` (a server URL; each test gets its own database on it);
2. otherwise the local service at 127.0.0.1:5432, if it answers;
3. otherwise a private cluster started for this test session, with ``initdb``/``pg_ctl``
   when they are installed, else the ``pgserver`` wheel.
"""

from __future__ import annotations

import asyncio
import atexit
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from urllib.parse import urlsplit, urlunsplit

import asyncpg

DEFAULT_LOCAL_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


async def _answers(url: str) -> bool:
    try:
        conn = await asyncpg.connect(url, timeout=3)
    except (TimeoutError, OSError, asyncpg.PostgresError):
        return False
    await conn.close()
    return True


def _pg_bindir() -> str | None:
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        bindir = out.stdout.strip()
        if os.path.exists(os.path.join(bindir, "initdb")):
            return bindir
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return os.path.dirname(found[-1]) if found else None


def _start_with_initdb(bindir: str) -> str:
    datadir = tempfile.mkdtemp(prefix="fencegate-pg-")
    port = 15400 + os.getpid() % 1000
    run_as: list[str] = []
    if os.geteuid() == 0:  # initdb refuses to run as root
        user = "postgres" if _user_exists("postgres") else "nobody"
        shutil.chown(datadir, user)
        run_as = ["runuser", "-u", user, "--"]
    subprocess.run(
        [*run_as, f"{bindir}/initdb", "-D", datadir, "-A", "trust", "-U", "postgres"],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [
            *run_as,
            f"{bindir}/pg_ctl",
            "-D",
            datadir,
            "-w",
            "-l",
            f"{datadir}/log",
            "-o",
            f"-p {port} -k {datadir} -h 127.0.0.1 -c max_connections=300",
            "start",
        ],
        check=True,
        capture_output=True,
    )
    atexit.register(
        subprocess.run,
        [*run_as, f"{bindir}/pg_ctl", "-D", datadir, "-m", "immediate", "stop"],
        capture_output=True,
    )
    return f"postgresql://postgres@127.0.0.1:{port}/postgres"


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _start_with_pgserver() -> str:
    import pgserver

    server = pgserver.get_server(  # type: ignore[attr-defined]  # pgserver re-exports it untyped
        tempfile.mkdtemp(prefix="fencegate-pgserver-"), cleanup_mode="stop"
    )
    return str(server.get_uri())


def server_url() -> str:
    """A URL of a PostgreSQL server on which the tests may create databases."""
    configured = os.environ.get("FENCEGATE_TEST_DATABASE_URL")
    if configured:
        return configured
    if asyncio.run(_answers(DEFAULT_LOCAL_URL)):
        return DEFAULT_LOCAL_URL
    bindir = _pg_bindir()
    url = _start_with_initdb(bindir) if bindir else _start_with_pgserver()
    os.environ["FENCEGATE_TEST_DATABASE_URL"] = url  # child processes reuse it
    return url


def with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, ""))


async def create_database(server: str) -> str:
    name = "fg_test_" + uuid.uuid4().hex[:12]
    conn = await asyncpg.connect(server, timeout=10)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return with_database(server, name)


async def drop_database(server: str, url: str) -> None:
    name = urlsplit(url).path.lstrip("/")
    conn = await asyncpg.connect(server, timeout=10)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()
