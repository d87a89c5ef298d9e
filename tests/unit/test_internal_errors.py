"""Internal errors are logged with their traceback once per kind, then in one line."""

from __future__ import annotations

import logging

import pytest

from fencegate.internal_errors import InternalErrors


def _raised(exc: Exception) -> Exception:
    try:
        raise exc
    except Exception as caught:
        return caught


def test_a_kind_of_internal_error_is_logged_in_full_once(caplog: pytest.LogCaptureFixture) -> None:
    counted: list[str] = []
    errors = InternalErrors(logging.getLogger("test.internal"), count=counted.append)
    caplog.set_level(logging.ERROR, logger="test.internal")
    for _ in range(3):
        errors.report(_raised(KeyError("a")), where="decide", about="request r1")
    errors.report(_raised(ValueError("b")), where="record")
    records = caplog.records
    assert [r.exc_info is not None for r in records] == [True, False, False, True]
    assert (
        "builtins.KeyError" in records[0].getMessage() and "request r1" in records[0].getMessage()
    )
    assert "test_internal_errors.py" in records[0].getMessage()  # the place it was raised
    assert "seen 3 times" in records[2].getMessage()
    assert counted == ["decide", "decide", "decide", "record"]
