"""The console in process (httpx over ASGI, a real SQLite store): tokens, sign-in, CSRF and
Origin checks, roles, tenant limits, confirmation and audit of actions, hidden payloads and
clear errors. The browser test (tests/acceptance) drives the same flows in Chromium."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from fencegate.console import ConsoleToken, TokenConfigError, create_console_app
from fencegate.console.auth import parse_tokens
from fencegate.store import open_gateway_store
from fencegate.store.inspect import Inspector
from tests.support.stories import two_workers_one_fenced_off

pytestmark = pytest.mark.timeout(60)

ORIGIN = "http://console.test"
KEY = "capture:inv-1:POST /v1/charges"
TOKENS = [
    ConsoleToken.from_secret("night-op", "operator-secret-0123", role="operator"),
    ConsoleToken.from_secret("watcher", "viewer-secret-012345", role="viewer"),
    ConsoleToken.from_secret("other-op", "other-secret-0123456", role="operator", tenant="other"),
]
SECRETS = {"night-op": "operator-secret-0123", "watcher": "viewer-secret-012345",
           "other-op": "other-secret-0123456"}  # fmt: skip


class Story:
    def __init__(self, url: str, job: int, app: Any) -> None:
        self.url, self.job, self.app = url, job, app

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url=ORIGIN, follow_redirects=False
        )


async def make_story(
    url: str, *, show_payloads: bool = False, release_margin: float = 0
) -> AsyncIterator[Story]:
    job, _, _ = await two_workers_one_fenced_off(url)
    # By default the story's request is not on its way: nothing to wait for before resolving.
    app = create_console_app(
        url, tokens=TOKENS, show_payloads=show_payloads, release_margin=release_margin
    )
    try:
        yield Story(url, job, app)
    finally:
        await app.state.console.close()


@pytest.fixture
async def story(sqlite_url: str) -> AsyncIterator[Story]:
    async for s in make_story(sqlite_url):
        yield s


def csrf_of(html: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', html)
    assert match, "no CSRF field on the page"
    return match.group(1)


async def sign_in(client: httpx.AsyncClient, name: str) -> str:
    """Signs in through the form; returns the session's CSRF token (from a page's form)."""
    form = await client.get("/login", headers={"accept": "text/html"})
    answer = await client.post(
        "/login",
        data={"csrf": csrf_of(form.text), "token": SECRETS[name], "next": "/"},
        headers={"origin": ORIGIN},
    )
    assert answer.status_code == 303, answer.text
    page = await client.get("/", headers={"accept": "text/html"})
    assert page.status_code == 200 and name in page.text
    return csrf_of(page.text)


async def key_state(url: str) -> str | None:
    store = await open_gateway_store(url, run_migrations=False, pool_max_size=1)
    try:
        record = await store.get_key("acme", KEY, timeout=10)
        return record.state if record else None
    finally:
        await store.close()


async def audit_rows(url: str) -> list[dict[str, Any]]:
    inspector = await Inspector.open(url)
    try:
        return await inspector.audit_log(limit=10)
    finally:
        await inspector.close()


@pytest.mark.parametrize(
    ("document", "error"),
    [
        ('[[tokens]]\nname="a"\ntoken="0123456789abcdef"\nrole="admin"', "role must be"),
        ('[[tokens]]\nname="a"\nrole="viewer"', "exactly one of"),
        ('[[tokens]]\nname="a"\ntoken="short"\nrole="viewer"', "at least 16"),
        ('[[tokens]]\nname="a"\ntoken_sha256="abc"\nrole="viewer"', "64 hex"),
        ("tokens = 1", "no [[tokens]]"),
    ],
)
def test_malformed_tokens_are_refused(document: str, error: str) -> None:
    with pytest.raises(TokenConfigError, match=re.escape(error)):
        parse_tokens(document, source="t.toml")


def test_token_sha256_matches_the_secret() -> None:
    digest = TOKENS[0].sha256.hex()
    [token] = parse_tokens(
        f'[[tokens]]\nname="n"\ntoken_sha256="{digest}"\nrole="operator"\ntenant="t"',
        source="t",
    )
    assert (token.sha256, token.role, token.tenant) == (TOKENS[0].sha256, "operator", "t")


async def test_pages_need_a_token(story: Story) -> None:
    async with story.client() as client:
        page = await client.get("/keys", headers={"accept": "text/html"})
        assert page.status_code == 303 and page.headers["location"].startswith("/login?next=")
        api = await client.get("/keys", headers={"authorization": "Bearer wrong-token-value"})
        assert api.status_code == 401
        assert api.headers["content-type"] == "application/problem+json"
        wrong = await client.post(
            "/login", data={"csrf": "x", "token": "nope"}, headers={"origin": ORIGIN}
        )
        assert wrong.status_code == 403  # no session yet: its CSRF token cannot match


async def test_sign_in_sets_a_strict_http_only_cookie(story: Story) -> None:
    async with story.client() as client:
        form = await client.get("/login", headers={"accept": "text/html"})
        bad = await client.post(
            "/login", data={"csrf": csrf_of(form.text), "token": "not-a-token"},
            headers={"origin": ORIGIN, "accept": "text/html"},
        )  # fmt: skip
        assert bad.status_code == 401 and "not valid" in bad.text
        good = await client.post(
            "/login", data={"csrf": csrf_of(bad.text), "token": SECRETS["night-op"]},
            headers={"origin": ORIGIN},
        )  # fmt: skip
        cookie = good.headers["set-cookie"].lower()
        assert good.status_code == 303
        assert "httponly" in cookie and "samesite=strict" in cookie


async def test_posts_need_the_csrf_token_and_the_same_origin(story: Story) -> None:
    async with story.client() as client:
        csrf = await sign_in(client, "night-op")
        form = {"tenant": "acme", "key": KEY, "mode": "release", "step": "confirm"}
        missing = await client.post("/key/resolve", data=form, headers={"origin": ORIGIN})
        assert missing.status_code == 403
        foreign = await client.post(
            "/key/resolve", data={**form, "csrf": csrf}, headers={"origin": "http://evil.test"}
        )
        assert foreign.status_code == 403
        assert await key_state(story.url) == "outcome_unknown"
        done = await client.post(
            "/key/resolve", data={**form, "csrf": csrf}, headers={"origin": ORIGIN}
        )
        assert done.status_code == 303
        assert await key_state(story.url) is None  # released


async def test_resolve_is_confirmed_then_done_and_audited(story: Story) -> None:
    async with story.client() as client:
        csrf = await sign_in(client, "night-op")
        form = {
            "csrf": csrf, "tenant": "acme", "key": KEY, "mode": "completed", "status": "201",
            "body": '{"id": "ch_1"}', "reason": "upstream says ok",
        }  # fmt: skip
        html = {"origin": ORIGIN, "accept": "text/html"}
        review = await client.post("/key/resolve", data={**form, "step": "review"}, headers=html)
        assert review.status_code == 200 and "Confirm: record the answer" in review.text
        assert await key_state(story.url) == "outcome_unknown"  # nothing done yet
        done = await client.post("/key/resolve", data={**form, "step": "confirm"}, headers=html)
        assert done.status_code == 303, done.text
        assert await key_state(story.url) == "completed"
        [row] = await audit_rows(story.url)
        assert (row["actor"], row["action"], row["reason"]) == (
            "console:night-op", "keys.resolve_completed", "upstream says ok",
        )  # fmt: skip
        assert orjson.loads(row["before"])["state"] == "outcome_unknown"
        assert orjson.loads(row["after"])["response_status"] == 201
        again = await client.post("/key/resolve", data={**form, "step": "confirm"}, headers=html)
        assert again.status_code == 409 and "left as it is" in again.text


async def test_resolve_is_refused_until_safe_with_when_then_forced_and_audited(
    sqlite_url: str,
) -> None:
    """The console resolves by the release rule, as `fencegate keys resolve` does: the story's
    key became unknown just now, so within the release margin a copy of its request may
    still be on its way."""
    async for story in make_story(sqlite_url, release_margin=600):
        async with story.client() as client:
            csrf = await sign_in(client, "night-op")
            page = await client.get("/key", params={"tenant": "acme", "key": KEY})
            assert "Release: not yet: its outcome became unknown" in page.text
            assert "(release margin 600 s)" in page.text and "safe from" in page.text
            form = {"csrf": csrf, "tenant": "acme", "key": KEY, "mode": "release"}
            html = {"origin": ORIGIN, "accept": "text/html"}
            review = await client.post(
                "/key/resolve", data={**form, "step": "review"}, headers=html
            )
            assert "Not safe yet, so this will be refused" in review.text
            refused = await client.post(
                "/key/resolve", data={**form, "step": "confirm"}, headers={"origin": ORIGIN}
            )
            assert refused.status_code == 409
            assert refused.headers["content-type"] == "application/problem+json"
            problem = refused.json()
            assert problem["type"].endswith("/release-unsafe")
            assert (problem["blocker"], problem["release_margin"]) == ("release_margin", 600)
            assert "a request sent before then may still be on its way" in problem["detail"]
            assert f"safe to release from {problem['safe_from']}" in problem["detail"]
            assert await key_state(story.url) == "outcome_unknown"
            assert await audit_rows(story.url) == []

            forced = {**form, "force": "yes", "reason": "upstream has no charge"}
            review = await client.post(
                "/key/resolve", data={**forced, "step": "review"}, headers=html
            )
            assert "Forced: the release rule is skipped." in review.text
            done = await client.post(
                "/key/resolve", data={**forced, "step": "confirm"}, headers=html
            )
            assert done.status_code == 303, done.text
            assert await key_state(story.url) is None
            [row] = await audit_rows(story.url)
            assert (row["actor"], row["action"], row["reason"]) == (
                "console:night-op", "keys.resolve_forced", "upstream has no charge",
            )  # fmt: skip


async def test_bad_status_is_a_clear_error(story: Story) -> None:
    async with story.client() as client:
        csrf = await sign_in(client, "night-op")
        form = {"csrf": csrf, "tenant": "acme", "key": KEY, "mode": "completed", "status": "42",
                "step": "confirm"}  # fmt: skip
        page = await client.post(
            "/key/resolve", data=form, headers={"origin": ORIGIN, "accept": "text/html"}
        )
        assert page.status_code == 400 and "100 to 599" in page.text
        assert "Traceback" not in page.text
        assert await key_state(story.url) == "outcome_unknown"


async def test_viewer_reads_but_cannot_act(story: Story) -> None:
    async with story.client() as client:
        csrf = await sign_in(client, "watcher")
        page = await client.get("/key", params={"tenant": "acme", "key": KEY})
        assert page.status_code == 200 and KEY in page.text
        assert "/key/resolve" not in page.text
        job = await client.get(f"/jobs/{story.job}")
        assert "/cancel" not in job.text and "/retry" not in job.text
        form = {"csrf": csrf, "tenant": "acme", "key": KEY, "mode": "release", "step": "confirm"}
        refused = await client.post("/key/resolve", data=form, headers={"origin": ORIGIN})
        assert refused.status_code == 403
        cancel = await client.post(
            f"/jobs/{story.job}/cancel", data={"csrf": csrf, "step": "confirm"},
            headers={"origin": ORIGIN},
        )  # fmt: skip
        assert cancel.status_code == 403
        assert await key_state(story.url) == "outcome_unknown"
        assert await audit_rows(story.url) == []


async def test_tenant_token_sees_only_its_tenant(story: Story) -> None:
    async with story.client() as client:
        await sign_in(client, "other-op")
        assert KEY not in (await client.get("/keys")).text
        assert KEY not in (await client.get("/")).text
        assert (await client.get("/key", params={"tenant": "acme", "key": KEY})).status_code == 404
        assert (await client.get("/jobs")).status_code == 403
        assert (await client.get(f"/jobs/{story.job}")).status_code == 403
        trace = await client.get("/trace", params={"subject": f"job:{story.job}"})
        assert "worker-1" not in trace.text and "Nothing recorded" in trace.text
        trace = await client.get("/trace", params={"subject": KEY, "tenant": "acme"})
        assert "worker-1" not in trace.text


async def test_job_cancel_then_retry_through_confirmation(story: Story) -> None:
    async with story.client() as client:
        csrf = await sign_in(client, "night-op")
        headers = {"origin": ORIGIN, "accept": "text/html"}
        review = await client.post(
            f"/jobs/{story.job}/cancel", data={"csrf": csrf, "step": "review"}, headers=headers
        )
        assert "Confirm: cancel job" in review.text
        for action in ("cancel", "retry"):
            done = await client.post(
                f"/jobs/{story.job}/{action}", data={"csrf": csrf, "step": "confirm"},
                headers=headers,
            )  # fmt: skip
            assert done.status_code == 303, done.text
        actions = [(r["actor"], r["action"]) for r in await audit_rows(story.url)]
        assert actions == [("console:night-op", "jobs.retry"), ("console:night-op", "jobs.cancel")]


async def test_payloads_only_with_the_flag(story: Story) -> None:
    shown = create_console_app(story.url, tokens=TOKENS, show_payloads=True)
    try:
        for app, expected in ((story.app, False), (shown, True)):
            async with Story(story.url, story.job, app).client() as client:
                await sign_in(client, "night-op")
                page = await client.get(f"/jobs/{story.job}")
                assert page.status_code == 200
                assert ("&#34;invoice&#34;: &#34;inv-1&#34;" in page.text) is expected
    finally:
        await shown.state.console.close()


async def test_bad_input_is_a_page_or_a_problem(story: Story) -> None:
    async with story.client() as client:
        await sign_in(client, "night-op")
        html = await client.get("/jobs", params={"state": "bogus"}, headers={"accept": "text/html"})
        assert html.status_code == 400 and "state must be one of" in html.text
        assert html.headers["content-type"].startswith("text/html")
        api = await client.get("/jobs", params={"cursor": "x"}, headers={"accept": "*/*"})
        assert api.status_code == 400
        assert orjson.loads(api.content)["detail"].startswith("cursor")
        assert (await client.get("/jobs/999999")).status_code == 404
        assert (await client.get("/nowhere", headers={"accept": "text/html"})).status_code == 404
        headers = (await client.get("/")).headers
        assert "script-src 'self'" in headers["content-security-policy"]
