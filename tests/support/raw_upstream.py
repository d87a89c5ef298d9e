"""An upstream with no HTTP library on its side: it reads the request head off the socket
and answers with what it received, the request line and the header fields, as JSON. A test
then sees exactly what the gateway sent (an empty query's "?", a ``traceparent``)."""

from __future__ import annotations

import json
import socket
import threading


class RawUpstream:
    """``{"request_line": "...", "headers": {...}}``, one connection at a time.
    ``received`` lists the request line of every request head that reached it."""

    def __init__(self, *, status: str = "200 OK") -> None:
        self.status = status
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self.received: list[str] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> RawUpstream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._listener.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(10)
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data and len(data) < 65536:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        line, *fields = head.decode("latin-1").split("\r\n")
        self.received.append(line)
        headers = {k.lower(): v for k, _, v in (f.partition(": ") for f in fields)}
        length = int(headers.get("content-length", "0"))
        while len(rest) < length:
            chunk = conn.recv(65536)
            if not chunk:
                break
            rest += chunk
        body = json.dumps({"request_line": line, "headers": headers}).encode()
        conn.sendall(
            f"HTTP/1.1 {self.status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
