"""Issue 25, story 2: requests held on the way. An operator who follows the 424 and releases
a key as soon as `fencegate keys resolve` accepts must not make it run twice, although a copy
of its request was still on its way to the upstream when the 424 was given.

Gateway A reaches the upstream through a slow network path that holds every byte for 4 s;
A is not paused. Its upstream timeout (2 s) passes first: A marks each key's outcome unknown
and answers 504, and the client, retrying through gateway B, is told 424. The upstream has
not run the key yet (its log is empty), so the operator releases it — but the copy A sent is
still on the path and arrives 2 s later. The release margin (6 s, longer than anything is
held) is what protects: the 424 says settling by hand is safe only once the margin has passed
since the outcome became unknown (and `keys resolve` refuses until then), by which time the
held copy has arrived and run. The operator, reading the upstream's log from then on, records
its answer. No key runs twice; each ends completed with the upstream's answer. (Without the
margin — 0 s — the operator releases the keys at once and most of them run twice.)
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fencegate.cli import build_parser
from tests.support.gateway import GatewayProcess
from tests.support.net import SlowPath
from tests.support.settling import (
    KeyRows,
    Operator,
    Tally,
    answer_name,
    send_keyed,
    until_answered,
)
from tests.support.upstream import UpstreamProcess

LEASE = 1.0  # seconds of in-flight lease
UPSTREAM_TIMEOUT = 2.0  # A gives up on the upstream after this
HOLD = 4.0  # what the path holds every byte for: longer than A waits
MARGIN = 6.0  # the release margin: longer than anything is held
KEYS = 5


def resolve_takes_a_release_margin() -> bool:
    parser = build_parser()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parser.parse_args(["keys", "resolve", "k", "--release", "--release-margin", "6"])
    except SystemExit:
        return False
    return True


pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not resolve_takes_a_release_margin(),
        reason="`fencegate keys resolve` has no --release-margin yet: without the release rule "
        "nothing keeps an operator from releasing a key whose request is still on its way "
        "(the margin is what protects this story)",
    ),
]


@pytest.fixture
def upstream() -> Iterator[UpstreamProcess]:
    with UpstreamProcess(keep_answers=True) as process:
        yield process


async def test_a_request_still_on_its_way_is_not_released_under_it(
    store_url: str, upstream: UpstreamProcess, tmp_path: Path
) -> None:
    tally = Tally()
    operator = Operator(store_url, upstream, tally, workdir=tmp_path, release_margin=MARGIN)
    env = {"FENCEGATE_RELEASE_MARGIN": f"{MARGIN:g}", "FENCEGATE_GATEWAY_HEARTBEAT": "0.3"}
    tag = uuid.uuid4().hex[:8]
    keys = [f"held:{i}:{tag}" for i in range(KEYS)]
    with (
        SlowPath("127.0.0.1", upstream.port) as path,
        GatewayProcess(
            upstream=f"http://127.0.0.1:{path.port}",
            database_url=store_url,
            inflight_lease_seconds=LEASE,
            env=env | {"FENCEGATE_UPSTREAM_TIMEOUT": f"{UPSTREAM_TIMEOUT:g}"},
        ) as a,
        GatewayProcess(
            upstream=upstream.url, database_url=store_url, inflight_lease_seconds=LEASE, env=env
        ) as b,
    ):
        async with httpx.AsyncClient(timeout=60) as client, KeyRows(store_url) as store:
            path.hold = HOLD
            first = await asyncio.gather(*(send_keyed(client, a.url, k) for k in keys))
            from_a = sorted(answer_name(r) for r in first)
            # A gave up before anything arrived: the upstream has run none of them yet.
            ran_when_a_gave_up = sum([await upstream.acount(k) for k in keys])

            await asyncio.gather(
                *(
                    until_answered(
                        client,
                        b.url,
                        key,
                        tally,
                        on_unknown=lambda k, p: operator.settle(k, p, timeout=40),
                        ran=upstream.acount,
                        timeout=60,
                    )
                    for key in keys
                )
            )
            counts = {k: await upstream.acount(k) for k in keys}
            endings = {}
            for key in keys:
                replay = await send_keyed(client, b.url, key)
                [answer, *_] = await upstream.aanswers(key)
                endings[key] = replay.status_code == 200 and replay.text == answer["body"]
            final = await store.rows(keys)
        print(
            f"\nheld requests on {store_url.split(':')[0]}: {KEYS} keys held {HOLD:g} s, "
            f"A answered {from_a}, run when A gave up {ran_when_a_gave_up}; through B: "
            f"{tally.summary()}; runs per key {sorted(counts.values())}"
        )
        # A sent every key and gave up on it (on a starved machine it may instead refuse to
        # send one whose lease could have ended first: 503, and B runs that key).
        held = from_a.count("504 upstream-timeout")
        assert held >= 1 and set(from_a) <= {"504 upstream-timeout", "503 store-unavailable"}
        assert ran_when_a_gave_up == 0
        assert {k: c for k, c in counts.items() if c != 1} == {}, "a key ran twice"
        assert all(endings.values()), endings
        assert [r.state for r in final.values()] == ["completed"] * KEYS
        # The story happened: when the 424 came, settling by hand was not safe yet (copies
        # were on their way); once it was, the upstream had run every key, and the operator
        # recorded its answers.
        assert len(tally.waits) == held and min(tally.waits) > 0, tally.summary()
        assert tally.resolutions["completed"] == held, tally.summary()
