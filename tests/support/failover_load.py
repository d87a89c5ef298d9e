"""Keyed, fenced load from retrying clients through real gateways, kept up across a failover,
and what the clients saw: every answer each key got, every status, when the first success
after a given moment came.

Each client thread sends new keys one after another; a key is retried (same body, same fence)
until it gets a 2xx or the deadline passes, like an SDK with retries. Each thread owns one
entity and sends a growing fence with each new key, so the highest fence a client saw
accepted is known per entity.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field

import requests

RETRYABLE = {409, 502, 503, 504}


@dataclass
class Answer:
    status: int
    body: bytes
    sent: float  # when the attempt that got it was sent
    at: float


@dataclass
class LoadResult:
    answers: dict[str, Answer] = field(default_factory=dict)  # first 2xx per key
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    gave_up: list[str] = field(default_factory=list)
    unexpected: list[tuple[str, int, bytes]] = field(default_factory=list)
    accepted_fence: dict[str, int] = field(default_factory=dict)  # entity -> highest 2xx fence
    errors: int = 0  # connection errors (a gateway unreachable)

    def first_success_after(self, moment: float) -> float | None:
        """Seconds from ``moment`` to the first 2xx of a request sent after it."""
        later = [a.at for a in self.answers.values() if a.sent >= moment]
        return min(later) - moment if later else None


def body_for(key: str) -> bytes:
    return b'{"charge": "' + key.encode() + b'", "amount": 100}'


class KeyedLoad:
    def __init__(
        self, gateways: list[str], *, prefix: str, clients: int = 6, key_deadline: float = 90.0
    ) -> None:
        self.gateways = gateways
        self.prefix = prefix
        self.clients = clients
        self.key_deadline = key_deadline
        self.result = LoadResult()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for n in range(self.clients):
            thread = threading.Thread(target=self._client, args=(n,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, *, timeout: float = 120.0) -> LoadResult:
        """Stop sending new keys; the keys being retried finish (or give up) first."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
        return self.result

    def _client(self, n: int) -> None:
        session = requests.Session()
        entity = f"{self.prefix}-entity-{n}"
        for i in itertools.count(1):
            if self._stop.is_set():
                return
            key = f"{self.prefix}-{n}-{i}"
            self._send_until_answered(session, key, entity, fence=i, gateway=i + n)

    def _send_until_answered(
        self, session: requests.Session, key: str, entity: str, *, fence: int, gateway: int
    ) -> None:
        deadline = time.monotonic() + self.key_deadline
        for attempt in itertools.count():
            if time.monotonic() > deadline:
                with self._lock:
                    self.result.gave_up.append(key)
                return
            base = self.gateways[(gateway + attempt) % len(self.gateways)]
            sent = time.monotonic()
            try:
                response = send(base, key, entity, fence, session=session)
            except requests.RequestException:
                with self._lock:
                    self.result.errors += 1
                time.sleep(0.05)
                continue
            with self._lock:
                self.result.statuses[response.status_code] += 1
            if 200 <= response.status_code < 300:
                with self._lock:
                    self.result.answers[key] = Answer(
                        response.status_code, response.content, sent, time.monotonic()
                    )
                    seen = self.result.accepted_fence.get(entity, 0)
                    self.result.accepted_fence[entity] = max(seen, fence)
                return
            if response.status_code not in RETRYABLE:
                with self._lock:
                    self.result.unexpected.append((key, response.status_code, response.content))
                return
            time.sleep(0.05)


def send(
    gateway: str, key: str, entity: str, fence: int, *, session: requests.Session | None = None
) -> requests.Response:
    """One keyed, fenced charge: the body is the key's own, so a retry is the same request."""
    return (session or requests).post(
        gateway + "/charges",
        data=body_for(key),
        timeout=30,
        headers={
            "Idempotency-Key": key,
            "Content-Type": "application/json",
            "X-Execution-Entity": entity,
            "X-Execution-Fence": str(fence),
        },
    )
