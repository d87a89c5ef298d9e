"""Reconcile functions for tests, named in route configurations as
``tests.support.reconcile_probes:NAME``.

`charges_by_key` asks the charges upstream (`tests.support.charges`, at ``CHARGES_URL``)
whether it ran a key, and answers as the upstream first did, but with status 201 so that a
test can tell the function's answer from an HTTP probe's.
"""

from __future__ import annotations

import asyncio
import os
import urllib.error
import urllib.request
from urllib.parse import quote

from fencegate.gateway.reconcile import Executed, NotExecuted, StoredRequest, Unknown


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def charges_by_key(request: StoredRequest) -> Executed | NotExecuted | Unknown:
    url = f"{os.environ['CHARGES_URL']}/v1/charges/by-key/{quote(request.key, safe='')}"
    status, body = await asyncio.to_thread(_get, url)
    if status == 200:
        headers = [("content-type", "application/json"), ("x-reconciled-by", "function")]
        return Executed(201, headers, body, note=f"{request.method} {request.target} ran")
    if status == 404:
        return NotExecuted("no charge with this key")
    return Unknown(f"the charges API answered {status}")


async def always_executed(request: StoredRequest) -> Executed:
    return Executed(200, [("content-type", "text/plain")], f"ran {request.key}".encode())


def not_async(request: StoredRequest) -> NotExecuted:
    return NotExecuted()
