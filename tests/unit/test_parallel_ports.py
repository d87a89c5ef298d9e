"""Ports for servers the tests start: each pytest-xdist worker hands out its own block, below
Linux's ephemeral range (where client sockets take their ports), so a port handed to a test is
never the one another worker is about to bind."""

from __future__ import annotations

import os
import socket

from tests.support.net import free_port, port_block


def test_each_worker_has_a_block_of_its_own_below_the_ephemeral_range() -> None:
    blocks = [set(port_block(f"gw{n}")) for n in range(12)]
    assert all(len(block) == 1000 for block in blocks)
    assert len(set().union(*blocks)) == 12 * 1000  # no port in two blocks
    assert max(max(block) for block in blocks) < 32768
    assert port_block(None) == port_block("gw0")


def test_free_port_is_in_this_worker_s_block_and_free() -> None:
    mine = port_block(os.environ.get("PYTEST_XDIST_WORKER"))
    ports = [free_port() for _ in range(20)]
    assert all(port in mine for port in ports)
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # nobody holds it
