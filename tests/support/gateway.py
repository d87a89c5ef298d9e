"""Run `fencegate serve` as a real process on a loopback port, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.support.net import free_port
from tests.support.processes import child_env, stop_process


class GatewayProcess:
    """`fencegate serve` in a subprocess, started and ready (``GET /healthz`` answers 200).

    ``kill()`` is a real SIGKILL: no shutdown hooks run, in-flight reservations stay behind
    exactly as they would after a crash. The process output is kept in a log file and
    included in every start-up failure.
    """

    def __init__(
        self,
        *,
        upstream: str,
        database_url: str | None = None,
        config: Path | str | None = None,
        inflight_lease_seconds: float | None = None,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        port: int | None = None,
        workdir: Path | str | None = None,
        startup_timeout: float = 30.0,
        python: str | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.upstream = upstream
        self.database_url = database_url
        self.config = config
        self.inflight_lease_seconds = inflight_lease_seconds
        self.env = dict(env or {})
        self.extra_args = list(extra_args)
        self.startup_timeout = startup_timeout
        # Another interpreter (a venv with another fencegate installed) runs its own
        # installed package, not this checkout: benchmarks compare releases that way.
        self.python = python
        self._tmp = tempfile.TemporaryDirectory(prefix="fencegate-gw-")
        # Without a database URL the gateway uses ./fencegate.db: keep it out of the repo.
        self.workdir = Path(workdir) if workdir else Path(self._tmp.name)
        self.log_path = Path(self._tmp.name) / "gateway.log"
        self._log = self.log_path.open("wb")
        self._proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        cmd = [
            self.python or sys.executable,
            "-m",
            "fencegate.cli",
            "serve",
            "--upstream",
            self.upstream,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if self.database_url:
            cmd += ["--database-url", self.database_url]
        if self.config:
            cmd += ["--config", str(self.config)]
        if self.inflight_lease_seconds is not None:
            cmd += ["--inflight-lease-seconds", _number(self.inflight_lease_seconds)]
        return cmd + self.extra_args

    def __enter__(self) -> GatewayProcess:
        self.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.terminate()
        if exc_type is not None:
            # pytest shows captured output of a failed test: the gateway's side of the story.
            print(f"--- fencegate serve on port {self.port} ---\n{self.log_text()}")
        self._log.close()
        self._tmp.cleanup()

    @property
    def pid(self) -> int:
        assert self._proc is not None, "gateway not started"
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            self.command(),
            cwd=self.workdir,
            env=child_env(self.env) if self.python is None else installed_env() | self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.wait_ready(timeout=self.startup_timeout)

    def wait_ready(self, *, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if not self.running:
                raise RuntimeError(f"gateway exited during start-up:\n{self.log_text()}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2) as response:
                    if response.status == 200:
                        return
                    last = f"status {response.status}"
            except urllib.error.HTTPError as exc:
                last = f"status {exc.code}"
            except OSError as exc:
                last = str(exc)
            time.sleep(0.1)
        self.terminate()
        raise RuntimeError(f"gateway not ready after {timeout}s ({last}):\n{self.log_text()}")

    def kill(self, *, timeout: float = 10.0) -> None:
        """SIGKILL: the process dies mid-request, without any clean-up."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(timeout=timeout)

    def signal(self, signum: int) -> None:
        assert self._proc is not None, "gateway not started"
        self._proc.send_signal(signum)

    def wait_exit(self, *, timeout: float) -> int:
        """The exit status, once the process has ended by itself."""
        assert self._proc is not None, "gateway not started"
        return self._proc.wait(timeout=timeout)

    def terminate(self, *, timeout: float = 15.0) -> None:
        if self._proc is not None:
            stop_process(self._proc, timeout=timeout)

    def log_text(self) -> str:
        with contextlib.suppress(ValueError):
            self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def installed_env() -> dict[str, str]:
    """This environment without ``PYTHONPATH``: another interpreter runs the fencegate it has
    installed, not this checkout."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
