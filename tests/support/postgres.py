"""Where the tests find PostgreSQL.

- ``FENCEGATE_TEST_DATABASE_URL``, when set, names a server; each test gets its own database
  on it and nothing else on it is touched.
- Otherwise the run starts a private cluster of its own (``initdb``/``pg_ctl`` when the server
  binaries are installed, else those shipped in the ``pgserver`` wheel), tuned for tests
  (no fsync) and stopped at the end. A service that happens to answer at 127.0.0.1:5432 is
  not used unless named.

One private cluster serves a whole run, however many pytest-xdist workers it has: the run's
folder (``FENCEGATE_TEST_RUN_DIR``, made by the controlling process, see
tests/support/run_folder.py) holds a lock file and ``server.json``; the first process that needs
the server starts it under the lock and writes its URL there, the others read it, and the
controlling process stops it when the run ends.

Each migrated test database is a copy of a template migrated once per run (``CREATE DATABASE
... TEMPLATE``), which is much cheaper than running every migration for every test.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import glob
import json
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from tests.support.net import free_port

URL_ENV = "FENCEGATE_TEST_DATABASE_URL"
RUN_DIR_ENV = "FENCEGATE_TEST_RUN_DIR"
RUN_DIR_PREFIX = "fencegate-testrun-"
# Settings of the private cluster: no fsync (a killed server still recovers from its WAL;
# only an OS crash would lose data, and then the run is lost anyway), and room for several
# xdist workers, each running gateways with pools of their own. synchronous_commit stays at
# its default: the gateway sets it per transaction and a test checks that it does.
PRIVATE_SETTINGS = {
    "max_connections": "400",
    "fsync": "off",
    "full_page_writes": "off",
}


def pg_bindir() -> str | None:
    """The installed PostgreSQL server binaries (initdb, pg_ctl, ...), or None."""
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=30)
        bindir = out.stdout.strip()
        if os.path.exists(os.path.join(bindir, "initdb")):
            return bindir
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return os.path.dirname(found[-1]) if found else None


def pgserver_bindir() -> str:
    """The server binaries the ``pgserver`` wheel ships (the fallback)."""
    from pgserver import _commands  # the wheel keeps its binaries' path here

    return str(_commands.POSTGRES_BIN_PATH)


def user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _run_as() -> list[str]:
    """initdb and postgres refuse to run as root: as root they run as ``postgres``."""
    if os.geteuid() != 0:
        return []
    user = "postgres" if user_exists("postgres") else "nobody"
    return ["runuser", "-u", user, "--"]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read_state(run_dir: Path) -> dict[str, Any]:
    state = run_dir / "server.json"
    return dict(json.loads(state.read_text())) if state.exists() else {}


def _write_state(run_dir: Path, state: dict[str, Any]) -> None:
    tmp = run_dir / "server.json.tmp"
    tmp.write_text(json.dumps(state))
    tmp.replace(run_dir / "server.json")


def _start_private(run_dir: Path) -> dict[str, Any]:
    """initdb and pg_ctl start a cluster under ``run_dir/data``; its state for server.json."""
    bindir = pg_bindir() or pgserver_bindir()
    datadir = run_dir / "data"
    datadir.mkdir(mode=0o700)
    run_as = _run_as()
    if run_as:
        shutil.chown(run_dir, run_as[2])
        shutil.chown(datadir, run_as[2])
    subprocess.run(
        [
            *run_as,
            f"{bindir}/initdb",
            "-D",
            str(datadir),
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
            "--no-instructions",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    options = " ".join(f"-c {name}={value}" for name, value in PRIVATE_SETTINGS.items())
    for _attempt in range(5):  # a port taken between free_port() and the bind: another one
        port = free_port()
        started = subprocess.run(
            [
                *run_as,
                f"{bindir}/pg_ctl",
                "-D",
                str(datadir),
                "-w",
                "-t",
                "60",
                "-l",
                str(datadir / "log"),
                "-o",
                f"-p {port} -k {datadir} -h 127.0.0.1 {options}",
                "start",
            ],
            capture_output=True,
            timeout=120,
        )
        if started.returncode == 0:
            break
    else:
        log = (datadir / "log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the private PostgreSQL cluster did not start: {log}")
    return {
        "url": f"postgresql://postgres@127.0.0.1:{port}/postgres",
        "private": True,
        "bindir": bindir,
        "datadir": str(datadir),
        "run_as": run_as,
    }


def _stop_private(state: dict[str, Any]) -> None:
    if state.get("private"):
        subprocess.run(
            [
                *state["run_as"],
                f"{state['bindir']}/pg_ctl",
                "-D",
                state["datadir"],
                "-m",
                "immediate",
                "stop",
            ],
            capture_output=True,
            timeout=60,
        )


def _run_dir() -> Path:
    """The run's folder; outside pytest (a benchmark) one for this process."""
    path = os.environ.get(RUN_DIR_ENV)
    if path:
        return Path(path)
    run_dir = new_run_dir()
    os.environ[RUN_DIR_ENV] = str(run_dir)
    atexit.register(end_run, run_dir)
    return run_dir


def new_run_dir() -> Path:
    """A folder for one test run, owned by this process (see `end_run`)."""
    run_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))
    (run_dir / "owner").write_text(str(os.getpid()))
    return run_dir


def end_run(run_dir: Path) -> None:
    """Drop the run's template database, stop its private cluster, remove its folder."""
    if not run_dir.exists():
        return
    with _locked(run_dir / "lock"):
        state = _read_state(run_dir)
        for server, template in state.get("templates", {}).items():
            if server != state.get("url"):  # the private cluster's go with it
                with contextlib.suppress(Exception):
                    _drop_sync(server, template)
        _stop_private(state)
    shutil.rmtree(run_dir, ignore_errors=True)


def sweep_abandoned_runs() -> None:
    """Stop the clusters of earlier runs whose controlling process died without ending them."""
    for path in Path(tempfile.gettempdir()).glob(RUN_DIR_PREFIX + "*"):
        try:
            owner = int((path / "owner").read_text())
        except (OSError, ValueError):
            continue
        if owner == os.getpid() or _alive(owner):
            continue
        end_run(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def server_url() -> str:
    """A URL of a PostgreSQL server on which the tests may create databases."""
    configured = os.environ.get(URL_ENV)
    if configured:
        return configured
    run_dir = _run_dir()
    with _locked(run_dir / "lock"):
        state = _read_state(run_dir)
        if "url" not in state:
            state.update(_start_private(run_dir))
            _write_state(run_dir, state)
    return str(state["url"])


async def create_migrated_database(server: str) -> str:
    """A new database on ``server`` with every migration applied: a copy of the run's
    template, which the first caller migrates (under the run's lock)."""
    return await create_database(server, template=await _template(server))


async def _template(server: str) -> str:
    from fencegate.store.migrations import migrate

    run_dir = _run_dir()
    with _locked(run_dir / "lock"):  # blocks this event loop while another process migrates
        state = _read_state(run_dir)
        templates: dict[str, str] = state.setdefault("templates", {})
        if server not in templates:
            name = "fg_template_" + uuid.uuid4().hex[:12]
            await _execute(server, f'CREATE DATABASE "{name}"')
            await migrate(with_database(server, name))
            templates[server] = name
            _write_state(run_dir, state)
        return templates[server]


def _drop_sync(server: str, name: str) -> None:
    import asyncio

    asyncio.run(_execute(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


async def _execute(server: str, sql: str) -> None:
    conn = await asyncpg.connect(server, timeout=10)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, ""))


def locale_clause(locale: str) -> str:
    """What CREATE DATABASE takes to give a database ``locale`` as its collation and
    character classes (only template0 may be copied with another locale)."""
    quoted = locale.replace("'", "''")
    return f" TEMPLATE template0 LC_COLLATE '{quoted}' LC_CTYPE '{quoted}'"


async def create_database(
    server: str, *, template: str | None = None, locale: str | None = None
) -> str:
    """A new database on ``server``; a copy of ``template`` when given; with ``locale`` as
    its collation and character classes (a copy of template0) when given."""
    name = "fg_test_" + uuid.uuid4().hex[:12]
    copy = f' TEMPLATE "{template}"' if template else ""
    if locale is not None:
        copy = locale_clause(locale)
    await _execute(server, f'CREATE DATABASE "{name}"{copy}')
    return with_database(server, name)


async def drop_database(server: str, url: str) -> None:
    name = urlsplit(url).path.lstrip("/")
    await _execute(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
