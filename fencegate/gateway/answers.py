"""Completed answers kept in memory, so that a replay without a fence needs no round trip.

Why a copy can be trusted: a completed key changes in one way only before it expires. An
operator's resolve (released or completed, forced or not), the reconciler and the gateway's
own conditional writes all change only keys that are in flight or of unknown outcome; a
purge deletes only expired keys; the step itself reuses a completed key only once it has
expired (`tests/acceptance/test_answer_cache.py` holds every one of them to that). So a
copy taken once the key is completed, dropped no later than the key expires, is the
store's answer until then: nothing needs to tell the other processes about it.

Only requests without a fence are answered from a copy: a fence must be compared with the
entity's last accepted fence, which is the store's alone. A copy is answered for its own
tenant and key only, and its fingerprint is checked as the store would (another request
under the same key is still refused as ``key-reused``).

A copy expires no later than its key: its deadline is timed, on this process's monotonic
clock, from before the round trip whose transaction set the key's expiry (the database's
``now()`` plus the route's TTL).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from fencegate.store.base import StoredResponse

DEFAULT_ANSWER_CACHE_SIZE = 10_000
# Answers with bodies above this are not kept (each is replayed from the store as before).
DEFAULT_MAX_ANSWER_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class CachedAnswer:
    fingerprint: str
    response: StoredResponse
    attempt: int
    until: float  # time.monotonic() after which the copy is not used


class AnswerCache:
    """A bounded map (tenant, key) -> completed answer, least recently used first out."""

    def __init__(
        self,
        size: int = DEFAULT_ANSWER_CACHE_SIZE,
        *,
        max_body_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
    ) -> None:
        if size <= 0:
            raise ValueError("an answer cache holds at least one answer (use none to turn it off)")
        self.size = size
        self.max_body_bytes = max_body_bytes
        self._answers: OrderedDict[tuple[str, str], CachedAnswer] = OrderedDict()

    def __len__(self) -> int:
        return len(self._answers)

    def get(self, tenant: str, key: str) -> CachedAnswer | None:
        name = (tenant, key)
        answer = self._answers.get(name)
        if answer is None:
            return None
        if answer.until <= time.monotonic():
            del self._answers[name]
            return None
        self._answers.move_to_end(name)
        return answer

    def put(self, tenant: str, key: str, answer: CachedAnswer) -> None:
        body = answer.response.body
        if body is not None and len(body) > self.max_body_bytes:
            return
        if answer.until <= time.monotonic():
            return
        name = (tenant, key)
        self._answers[name] = answer
        self._answers.move_to_end(name)
        while len(self._answers) > self.size:
            self._answers.popitem(last=False)
