"""What a failed attempt records about its error, so that whoever is on call can tell why a
job failed without reading its payload.

The job's stored error holds three things: the exception's ``type``; a ``summary`` — the
first line of its message, with what looks like customer data masked (card and account
numbers, e-mail addresses, long tokens) and cut to `SUMMARY_LIMIT` characters — which the
command line and the console show to every operator; and the ``message`` itself (at most
`MESSAGE_LIMIT` characters), shown only by a console started with ``--show-payloads``. A
worker that knows better passes its own ``error_summary`` to `Worker`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

SUMMARY_LIMIT = 160
MESSAGE_LIMIT = 500

ErrorSummary = Callable[[BaseException], str]

_MASKS = (
    (re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+"), "<email>"),
    # Long runs of letters and digits with at least one digit: keys, tokens, hashes.
    (re.compile(r"\b(?=[A-Za-z_-]*\d)[A-Za-z0-9_-]{24,}\b"), "<token>"),
    # Six or more digits, possibly grouped by spaces, dots or dashes: cards, accounts, phones.
    (re.compile(r"(?<![\w])\d(?:[ .-]?\d){5,}(?![\w])"), "<number>"),
)


def redact(text: str) -> str:
    for pattern, mask in _MASKS:
        text = pattern.sub(mask, text)
    return text


def default_error_summary(exc: BaseException) -> str:
    """The first line of the message, masked and bounded; the class name when it is empty."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    summary = redact(first) or type(exc).__name__
    if len(summary) > SUMMARY_LIMIT:
        summary = summary[: SUMMARY_LIMIT - 1] + "…"
    return summary


def error_record(
    exc: BaseException, summarize: ErrorSummary = default_error_summary
) -> dict[str, str]:
    """The job's ``error``: class, shown summary, and the bounded message; never a traceback."""
    try:
        summary = summarize(exc)[:SUMMARY_LIMIT]
    except Exception:  # a summary hook that fails must not lose the failure itself
        summary = type(exc).__name__
    return {"type": type(exc).__name__, "summary": summary, "message": str(exc)[:MESSAGE_LIMIT]}
