"""Hosts for the tests, made of network namespaces: a switch namespace holding a bridge, and
one namespace per host joined to it by a veth pair, so that cutting a host off is a real link
going down (``ip link set eth0 down``). The addresses (10.250.0.0/24) exist only inside these
namespaces, which `Sandbox.destroy` deletes; nothing is added to the test's own namespace.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Sequence
from typing import Any

SUBNET = "10.250.0"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def cannot_make_namespaces() -> str | None:
    """Why this machine cannot make the sandbox, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN)"
    probe = f"fgprobe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0")
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or str(exc)
        return f"cannot create network namespaces and veth pairs here: {detail!r}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


class Sandbox:
    def __init__(self, hosts: Sequence[str]) -> None:
        tag = uuid.uuid4().hex[:6]
        self.switch = f"fg{tag}-sw"
        self.namespaces = {host: f"fg{tag}-{host}" for host in hosts}
        self.addresses = {host: f"{SUBNET}.{i + 1}" for i, host in enumerate(hosts)}
        self._made: list[str] = []

    def create(self) -> None:
        try:
            _ip("netns", "add", self.switch)
            self._made.append(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, (host, ns) in enumerate(self.namespaces.items()):
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                port = f"port{i}"
                _ip(
                    "-n",
                    ns,
                    "link",
                    "add",
                    "eth0",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    port,
                    "netns",
                    self.switch,
                )
                _ip("-n", ns, "addr", "add", f"{self.addresses[host]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
        except BaseException:
            self.destroy()
            raise

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host``."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def popen(self, host: str, argv: Sequence[str], **options: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.command(host, argv), **options)

    def run(self, host: str, argv: Sequence[str], *, timeout: float = 60) -> str:
        done = subprocess.run(
            self.command(host, argv), capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(f"on {host}: {' '.join(argv)}: {done.stdout}{done.stderr}")
        return done.stdout

    def cut(self, host: str) -> None:
        """The host's only link goes down: nothing in or out until `heal`."""
        _ip("-n", self.namespaces[host], "link", "set", "eth0", "down")

    def heal(self, host: str) -> None:
        _ip("-n", self.namespaces[host], "link", "set", "eth0", "up")
        # The link's address routes come back with it; the default route is not used.

    def destroy(self) -> None:
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made.clear()
