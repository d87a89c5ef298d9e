"""What `fencegate serve` does about connections, around uvicorn's httptools protocol.

uvicorn closes a keep-alive connection that stays idle after a response
(``timeout_keep_alive``), but nothing else: a connection that sends nothing, or half a
request head, stays open for ever, and enough of them use up the process's file descriptors
(then every client is refused). uvicorn's ``limit_concurrency`` does not help: past it, it
still accepts each connection and answers its requests with 503. So this protocol adds:

- a header timeout: a connection must complete each request head within
  ``header_timeout`` seconds of its first byte (the first request: of connecting), or it is
  closed;
- a body timeout: once the head is read, a body that makes no progress for
  ``body_timeout`` seconds (no byte while the gateway is reading it) is answered 408
  ``request-timeout`` and the connection closed; nothing was forwarded, as the gateway reads
  the whole body before deciding anything;
- a connection limit: past ``max_connections`` open connections, the one that has waited
  longest without a request in progress (sending nothing, half a head, idle between
  requests, or a body stalled for `STALLED_AFTER` seconds) is closed to make room, so
  hoarded sockets cannot keep a new client out; when every connection has a request in
  progress, the new one is answered 503 and closed;
- one write per answer: a response's head leaves with its body (`HeadWithBody`);
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

from fencegate.gateway.head_with_body import HeadWithBody
from fencegate.gateway.http_protocol import mark_empty_query
from fencegate.problems import Problem

logger = logging.getLogger("fencegate.gateway")

# File descriptors a gateway process needs besides its client connections: the upstream
# connection pool (at most one per request in progress, 200 at most), the store's pool, and
# a margin for the listener, logs, the event loop and the metrics files.
UPSTREAM_POOL = 200
MARGIN = 64


# A body that has sent nothing for this long (or the body timeout, if shorter) is stalled:
# its connection may be closed to make room. One still sending is not cut off for a newcomer.
STALLED_AFTER = 1.0


def _closing_answer(problem: Problem, status_line: bytes) -> bytes:
    """A problem answer written straight to the socket, before closing it."""
    body = problem.body()
    head = [status_line]
    head += [f"{k}: {v}".encode() for k, v in problem.response_headers()]
    head += [b"connection: close", b"content-length: %d" % len(body)]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


_BUSY = _closing_answer(
    Problem(
        503,
        "too-many-connections",
        "Too many connections",
        "the gateway's connection limit is reached and every connection has a request in "
        "progress; nothing was forwarded",
        headers={"Retry-After": "1"},
        retry_after=1,
    ),
    b"HTTP/1.1 503 Service Unavailable",
)


def _body_timeout_answer(seconds: float) -> bytes:
    return _closing_answer(
        Problem(
            408,
            "request-timeout",
            "Request body timed out",
            f"the request body made no progress for {seconds:g} s; nothing was forwarded",
        ),
        b"HTTP/1.1 408 Request Timeout",
    )


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout: float = 10.0
    idle_timeout: float = 5.0
    body_timeout: float = 10.0
    max_connections: int = 10_000


_limits = ConnectionLimits()
_body_timed_out_answer = _body_timeout_answer(_limits.body_timeout)


def configure(limits: ConnectionLimits) -> None:
    global _limits, _body_timed_out_answer
    _limits = limits
    _body_timed_out_answer = _body_timeout_answer(limits.body_timeout)


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
    """uvicorn's httptools protocol with header and body timeouts, a connection limit that
    closes hoarded connections first, and the raw target's fragment kept."""

    # Connections without a request in progress (or whose body has stalled), the one that
    # waited longest first (a dict keeps order), per process: the first to close when the
    # limit is reached.
    _waiting: dict[GuardedHttpToolsProtocol, None] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's own idle timeout between requests, in fractions of a second too.
        self.timeout_keep_alive = _limits.idle_timeout  # type: ignore[assignment]
        self._head_timer: asyncio.TimerHandle | None = None
        # Between a head and the end of its body: when a body byte last came (loop time).
        self._reading_body = False
        self._body_since = 0.0
        self._body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._wait_for_head()
        if len(self.connections) > _limits.max_connections:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        self._stop_body_timer()
        self._waiting.pop(self, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._reading_body:
            self._body_progress()
        super().data_received(data)
        if self._reading_body and self._body_timer is None and not self.transport.is_closing():
            # The head came, its body has not come whole: from here it must keep coming.
            self._wait_for_body()
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
        previous = self.cycle
        super().on_headers_complete()
        # A new request (not an upgrade): its body, if any, is read from here on. No timer
        # yet: most bodies come whole with their head (see `data_received`).
        self._reading_body = self.cycle is not previous
        if self._reading_body:
            # Its head leaves with its body (head_with_body.py); the cycle uses only the
            # transport's methods the wrapper passes on.
            self.cycle.transport = HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]
        if b"#" in self.url:
            self._keep_fragment()
        if self.url.endswith(b"?"):
            mark_empty_query(self.url, self.scope)

    def on_message_complete(self) -> None:
        if self._reading_body:
            self._reading_body = False
            self._stop_body_timer()
            if not self.cycle.response_complete:  # else it is idle now, and stays listed
                self._waiting.pop(self, None)
        super().on_message_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # the next request starts now, if one is queued
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._waiting[self] = None
        elif self._reading_body and not self.pipeline:
            self._body_since = self.loop.time()  # its body's time starts with its turn

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

    def _wait_for_body(self) -> None:
        self._body_since = self.loop.time()
        self._waiting[self] = None  # evictable once stalled (`_evictable`)
        self._body_timer = self.loop.call_later(_limits.body_timeout, self._body_timed_out)

    def _body_progress(self) -> None:
        self._body_since = self.loop.time()
        if self in self._waiting:  # listed by when it last made progress: to the end
            del self._waiting[self]
            self._waiting[self] = None

    def _stop_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _gateway_holds_body(self) -> bool:
        """Whether the gateway, not the client, is why no body byte comes: the request is
        pipelined behind one still being answered (the client may wait for that answer),
        reading is paused (the application has not taken what came), or the client waits
        for the ``100 Continue`` it asked for."""
        return bool(self.pipeline) or self.flow.read_paused or self.cycle.waiting_for_100_continue

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if not self._reading_body or self.transport.is_closing():
            return
        now = self.loop.time()
        if self._gateway_holds_body():
            # Not the client's stall: its time starts again (at most one period late).
            self._body_since = now
        quiet = now - self._body_since
        if quiet < _limits.body_timeout:
            self._body_timer = self.loop.call_later(
                _limits.body_timeout - quiet, self._body_timed_out
            )
            return
        if not self.cycle.response_started:
            self.transport.write(_body_timed_out_answer)
        self.transport.close()

    def _evictable(self, now: float) -> bool:
        """Whether this listed connection may be closed to make room: it has no request in
        progress, or its body stalled (the gateway not holding it up)."""
        if not self._reading_body or self.cycle.response_complete:
            return True
        stalled = now - self._body_since >= min(STALLED_AFTER, _limits.body_timeout)
        return stalled and not self._gateway_holds_body()

    def _make_room(self) -> None:
        now = self.loop.time()
        for other in self._waiting:
            if other is not self and other._evictable(now):
                logger.warning(
                    "connection limit (%d) reached: closing the connection that waited "
                    "longest without a request or a byte of its request's body",
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
