"""A response's head and the start of its body in one write, for `fencegate serve`.

uvicorn writes an answer's head when the application sends ``http.response.start`` and
its body when it sends ``http.response.body``: two system calls, and two TCP segments for
the client to take in, for every answer the gateway sends (it always sends the two messages
back to back). On loopback and in virtual machines a system call costs more than building
the answer, so the gateway's protocol gives each request's cycle this transport instead:
the head is held until the body's first write, and both leave in one call. A head whose
body does not follow in the same turn of the event loop (a stream that waits for its first
event, an answer with nothing to write) is written at the end of that turn, so no client
waits on a held head.
"""

from __future__ import annotations

import asyncio
from typing import Any

# What an interim answer starts with: "100 Continue" is written before the real head, at
# once (the client waits for it before sending the body).
_INTERIM = b"HTTP/1.1 1"


class HeadWithBody:
    """Wraps the connection's transport for one request/response cycle."""

    __slots__ = ("_flush", "_head", "_head_seen", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None
        self._head_seen = False
        self._flush: asyncio.Handle | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        head = self._head
        if head is not None:
            self._head = None
            if self._flush is not None:
                self._flush.cancel()
                self._flush = None
            self._transport.writelines((head, data))
            return
        if not self._head_seen and data[: len(_INTERIM)] != _INTERIM:
            # The cycle's first write that is not an interim answer is its head.
            self._head_seen = True
            self._head = bytes(data)
            self._flush = self._loop.call_soon(self._write_head)
            return
        self._transport.write(data)

    def _write_head(self) -> None:
        self._flush = None
        head, self._head = self._head, None
        if head is not None and not self._transport.is_closing():
            self._transport.write(head)

    def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
        self._write_head()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        # Everything else (is_closing, get_extra_info, ...) is the connection's own.
        return getattr(self._transport, name)
