from __future__ import annotations

import pytest

from fencegate.gateway.headers import parse_entity, parse_fence, parse_idempotency_key
from fencegate.problems import Problem


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], None),
        (["tool-job:8f1b7c3d:create_case"], "tool-job:8f1b7c3d:create_case"),
        (['"quoted key"'], "quoted key"),
        ([r'"with \"escaped\" quote and \\ slash"'], 'with "escaped" quote and \\ slash'),
        (["k", "k"], "k"),
        (["x" * 255], "x" * 255),
        (["a b"], "a b"),
        # RFC 8941 Item: an sf-string may carry parameters; the gateway ignores them.
        (['"k";v=1'], "k"),
        (['"k"; v=1;final'], "k"),
    ],
)
def test_valid_keys(values: list[str], expected: str | None) -> None:
    assert parse_idempotency_key(values) == expected


@pytest.mark.parametrize(
    "values",
    [
        [""],
        ["x" * 256],
        ['"' + "x" * 256 + '"'],
        ['""'],
        ["café"],
        ["tab\there"],
        ['"open'],
        ['"bad \\x escape"'],
        ['"inner " quote"'],
        ['"k";'],
        ['"k";V=1'],
        ['"k" trailing'],
        ["a", "b"],
    ],
)
def test_malformed_keys(values: list[str]) -> None:
    with pytest.raises(Problem) as caught:
        parse_idempotency_key(values)
    assert caught.value.status == 400
    assert caught.value.kind == "invalid-header"
    assert caught.value.extensions["header"] == "Idempotency-Key"


@pytest.mark.parametrize(
    ("values", "expected"),
    [([], None), (["0"], 0), (["42", "42"], 42), (["007"], 7), ([str(2**63 - 1)], 2**63 - 1)],
)
def test_valid_fences(values: list[str], expected: int | None) -> None:
    assert parse_fence(values) == expected


@pytest.mark.parametrize(
    "values",
    [[""], ["-1"], ["+1"], [" 1"], ["1 "], ["1.0"], ["1e3"], ["0x10"], ["\u0661"],
     [str(2**63)], ["9" * 50], ["1", "2"]],
)  # fmt: skip
def test_malformed_fences(values: list[str]) -> None:
    with pytest.raises(Problem) as caught:
        parse_fence(values)
    assert caught.value.status == 400
    assert caught.value.extensions["header"] == "X-Execution-Fence"


def test_entity_rules() -> None:
    assert parse_entity(["invoice:42"]) == "invoice:42"
    for bad in ([""], ["e" * 256], ["a", "b"], ["naïve"]):
        with pytest.raises(Problem) as caught:
            parse_entity(bad)
        assert caught.value.extensions["header"] == "X-Execution-Entity"
