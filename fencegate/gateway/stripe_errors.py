"""The gateway's error answers in Stripe's shape, for routes (``error_format = "stripe"``) whose
clients are Stripe SDKs or were written against Stripe's API.

Stripe's clients read an error from its status and ``error.type``: on 400/404 an
``idempotency_error`` is `IdempotencyError`, otherwise `InvalidRequestError`; 401 is
`AuthenticationError`; any other status is a generic `APIError` carrying ``error.message``.
They retry 409 and most 5xx on their own unless the answer says ``Stripe-Should-Retry``.
So the statuses stay those of the problem format except a reused key, which Stripe itself
answers with 400 ``idempotency_error``; and every answer says whether a retry can help.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson

from fencegate.problems import Problem


class StripeError(NamedTuple):
    type: str
    status: int | None = None  # None: the problem's own status
    should_retry: bool | None = None  # None: leave it to the client's own rules
    code: str | None = None  # None: the problem kind with underscores


_BY_KIND: dict[str, StripeError] = {
    # Stripe answers a reused key with 400, and its clients raise IdempotencyError for it.
    "key-reused": StripeError("idempotency_error", status=400, should_retry=False),
    # Stripe's answer to a concurrent request with the same key: 409, retried by clients.
    "in-flight": StripeError("idempotency_error", should_retry=True, code="idempotency_key_in_use"),
    # Only an operator can resolve an unknown outcome: a retry gets the same answer.
    "outcome-unknown": StripeError("api_error", should_retry=False),
    "response-not-stored": StripeError("idempotency_error", should_retry=False),
    "stale-fence": StripeError("invalid_request_error", should_retry=False),
    "store-unavailable": StripeError("api_error", should_retry=True),
    # Its gateway is still recording the answer or the release: the retry learns which.
    "outcome-pending": StripeError("api_error", should_retry=True),
    "upstream-unreachable": StripeError("api_error"),
    # Retried by the client: the retry learns the outcome is unknown (a clearer answer).
    "upstream-timeout": StripeError("api_error"),
}

_RESERVED = frozenset({"type", "message", "code", "doc_url", "param"})


def stripe_error(problem: Problem) -> tuple[int, list[tuple[str, str]], bytes]:
    """Status, headers and body of ``problem`` as a Stripe error answer."""
    if problem.kind in _BY_KIND:
        shape = _BY_KIND[problem.kind]
    elif problem.status == 401:
        shape = StripeError("authentication_error")
    elif problem.status >= 500:
        shape = StripeError("api_error")
    else:
        shape = StripeError("invalid_request_error")
    error: dict[str, Any] = {
        "type": shape.type,
        "message": problem.detail,
        "code": shape.code or problem.kind.replace("-", "_"),
        "doc_url": problem.type_uri,
    }
    if "header" in problem.extensions:
        error["param"] = problem.extensions["header"]  # the malformed header's name
    # The problem's extension members (retry_after, last_accepted_fence, resolve, ...)
    # help a person reading the error; Stripe's clients keep unknown members as they are.
    error.update((k, v) for k, v in problem.extensions.items() if k not in _RESERVED)
    headers = [("content-type", "application/json")]
    headers.extend((k.lower(), v) for k, v in problem.headers.items())
    if shape.should_retry is not None:
        headers.append(("stripe-should-retry", "true" if shape.should_retry else "false"))
    return shape.status or problem.status, headers, orjson.dumps({"error": error})
