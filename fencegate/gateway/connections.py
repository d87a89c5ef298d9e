"""What `fencegate serve` does about connections, around uvicorn's httptools protocol.

uvicorn closes a keep-alive connection that stays idle after a response
(``timeout_keep_alive``), but nothing else: a connection that sends nothing, or half a
request head, stays open for ever, and enough of them use up the process's file descriptors
(then every client is refused). uvicorn's ``limit_concurrency`` does not help: past it, it
still accepts each connection and answers its requests with 503. So this protocol adds:

- a header timeout: a connection must complete each request head within
  ``header_timeout`` seconds of its first byte (the first request: of connecting), or it is
  closed;
- a connection limit: past ``max_connections`` open connections, the one that has waited
  longest without a request in progress (sending nothing, half a head, or idle between
  requests) is closed to make room, so hoarded sockets cannot keep a new client out; when
  every connection has a request in progress, the new one is answered 503 and closed;
- the raw target: the parser cuts a ``#fragment`` off the target before the application
  sees it, so it is put back where the gateway's target check refuses it (400
  ``invalid-target``) instead of forwarding a target other than the one sent.

The settings are per process (each worker of ``--workers N`` applies them to its own
connections) and set with `configure` before the server starts.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from fencegate.gateway.http_protocol import mark_empty_query
from fencegate.problems import Problem

logger = logging.getLogger("fencegate.gateway")

# File descriptors a gateway process needs besides its client connections: the upstream
# connection pool (at most one per request in progress, 200 at most), the store's pool, and
# a margin for the listener, logs, the event loop and the metrics files.
UPSTREAM_POOL = 200
MARGIN = 64


def _busy_answer() -> bytes:
    problem = Problem(
        503,
        "too-many-connections",
        "Too many connections",
        "the gateway's connection limit is reached and every connection has a request in "
        "progress; nothing was forwarded",
        headers={"Retry-After": "1"},
        retry_after=1,
    )
    body = problem.body()
    head = [b"HTTP/1.1 503 Service Unavailable"]
    head += [f"{k}: {v}".encode() for k, v in problem.response_headers()]
    head += [b"connection: close", b"content-length: %d" % len(body)]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


_BUSY = _busy_answer()


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout: float = 10.0
    idle_timeout: float = 5.0
    max_connections: int = 10_000


_limits = ConnectionLimits()


def configure(limits: ConnectionLimits) -> None:
    global _limits
    _limits = limits


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; the soft limit in
    force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1_048_576)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def connections_within(open_files: int, *, wanted: int, store_pool: int) -> int:
    """How many client connections fit in ``open_files`` descriptors with what else the
    process holds (see `UPSTREAM_POOL`), capped at ``wanted``; at least 1."""
    spare = open_files - store_pool - MARGIN
    # A busy connection may hold an upstream connection too (up to the upstream pool).
    fit = max(spare // 2, spare - UPSTREAM_POOL)
    return max(min(wanted, fit), 1)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header timeout, a connection limit that closes
    hoarded connections first, and the raw target's fragment kept."""

    # Connections without a request in progress, oldest first (a dict keeps order), per
    # process: the first to close when the limit is reached.
    _waiting: dict[GuardedHttpToolsProtocol, None] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's own idle timeout between requests, in fractions of a second too.
        self.timeout_keep_alive = _limits.idle_timeout  # type: ignore[assignment]
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._wait_for_head()
        if len(self.connections) > _limits.max_connections:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        self._waiting.pop(self, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # uvicorn stopped its idle timer on these bytes; if they began no request head (the
        # parser skips blank lines between requests), the head timer runs from here.
        idle = self.cycle is None or self.cycle.response_complete
        if idle and self._head_timer is None and not self.transport.is_closing():
            self._wait_for_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_timer is None:  # a later request on a kept-alive connection
            self._wait_for_head()

    def on_headers_complete(self) -> None:
        self._stop_head_timer()
        self._waiting.pop(self, None)
        super().on_headers_complete()
        if b"#" in self.url:
            self._keep_fragment()
        if self.url.endswith(b"?"):
            mark_empty_query(self.url, self.scope)

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # the next request starts now, if one is queued
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._waiting[self] = None

    def _wait_for_head(self) -> None:
        self._waiting[self] = None
        self._head_timer = self.loop.call_later(_limits.header_timeout, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined head behind a response still being sent: its time starts after.
            self._head_timer = self.loop.call_later(_limits.header_timeout, self._head_timed_out)
            return
        if not self.transport.is_closing():
            self.transport.close()

    def _make_room(self) -> None:
        for other in self._waiting:
            if other is not self:
                logger.warning(
                    "connection limit (%d) reached: closing the connection that waited "
                    "longest without a request",
                    _limits.max_connections,
                )
                self._waiting.pop(other)
                other.transport.close()
                return
        logger.warning(
            "connection limit (%d) reached and every connection has a request in progress: "
            "refusing a new one",
            _limits.max_connections,
        )
        self._waiting.pop(self, None)
        self._stop_head_timer()
        self.transport.write(_BUSY)
        self.transport.close()

    def _keep_fragment(self) -> None:
        """httptools' URL parser drops ``#…`` from the target: put it back on the raw path
        (or the query, when it comes after one), where the target check refuses it."""
        before, _, fragment = self.url.partition(b"#")
        parsed = httptools.parse_url(before)
        raw_path = self.root_path.encode("ascii") + parsed.path
        if parsed.query is not None or before.endswith(b"?"):
            self.scope["query_string"] = (parsed.query or b"") + b"#" + fragment
        else:
            self.scope["raw_path"] = raw_path + b"#" + fragment
