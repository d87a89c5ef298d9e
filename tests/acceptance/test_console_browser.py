"""The console as an operator uses it at 2 a.m.: a real `fencegate console` process on a
loopback port, Debian's Chromium driven by Playwright, and the database checked afterwards.

The store holds the story of the trace command's tests: a job with two attempts (worker-1's
lease ran out, worker-2 took over), worker-1's late request fenced off, and the charge key
stuck in outcome unknown. The operator follows that key from the overview to its trace and
resolves it with confirmation; a viewer cannot act, a tenant's token sees no other tenant, and
a POST without the CSRF token is refused. The pages' screenshots for the documentation are taken
only when asked: ``FENCEGATE_SCREENSHOTS=docs/console python -m pytest -k operator_follows
tests/acceptance/test_console_browser.py`` (a test run leaves the tree clean).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from playwright import async_api as playwright_api
from playwright.async_api import expect

from fencegate.store import open_gateway_store
from fencegate.store.inspect import Inspector
from tests.support.net import free_port, wait_for_port
from tests.support.processes import REPO_ROOT, child_env, stop_process
from tests.support.stories import two_workers_one_fenced_off

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
# Where the documentation's screenshots go, only when asked (a path, relative to the repository).
SHOTS = os.environ.get("FENCEGATE_SCREENSHOTS")
KEY = "capture:inv-1:POST /v1/charges"
SECRETS = {"night-op": "operator-secret-0123456789", "watcher": "viewer-secret-0123456789",
           "other-op": "other-tenant-secret-012345"}  # fmt: skip
TOKENS_TOML = f"""
[[tokens]]
name = "night-op"
token = "{SECRETS["night-op"]}"
role = "operator"

[[tokens]]
name = "watcher"
token = "{SECRETS["watcher"]}"
role = "viewer"

[[tokens]]
name = "other-op"
token = "{SECRETS["other-op"]}"
role = "operator"
tenant = "other"
"""

NO_CHROMIUM = "needs Debian's chromium at /usr/bin/chromium (.ci/run installs it)"
pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not CHROMIUM.exists(), reason=NO_CHROMIUM),
]

T = 20_000  # ms for each browser wait: the machine is shared


def start_console(store_url: str, tmp_path: Path, *options: str) -> Iterator[str]:
    """`fencegate console` on the store; yields its base URL."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(TOKENS_TOML)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fencegate.cli", "console", "--database-url", store_url,
         "--port", str(port), "--tokens", str(tokens), "--refresh-seconds", "300", *options],
        env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        try:
            wait_for_port(port, timeout=30)
        except TimeoutError:
            stop_process(proc, timeout=5)
            pytest.fail(f"the console did not start: {proc.stdout.read() if proc.stdout else ''}")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc, timeout=10)


@pytest.fixture
def console(store_url: str, tmp_path: Path) -> Iterator[tuple[str, str, int]]:
    """The store with the story in it, and `fencegate console` serving it; (url, base, job)."""
    job, _, _ = asyncio.run(two_workers_one_fenced_off(store_url))
    # The story's request is not on its way: nothing to wait for before resolving.
    for base in start_console(store_url, tmp_path, "--release-margin", "0"):
        yield store_url, base, job


@pytest.fixture
def console_showing_payloads(
    console: tuple[str, str, int], tmp_path: Path
) -> Iterator[tuple[str, int]]:
    """A second console on the same story, started with --show-payloads; (base, job)."""
    store_url, _, job = console
    for base in start_console(store_url, tmp_path, "--show-payloads"):
        yield base, job


async def key_record(url: str) -> Any:
    store = await open_gateway_store(url, run_migrations=False, pool_max_size=1)
    try:
        return await store.get_key("acme", KEY, timeout=30)
    finally:
        await store.close()


async def audit_rows(url: str) -> list[dict[str, Any]]:
    inspector = await Inspector.open(url)
    try:
        return await inspector.audit_log(limit=10)
    finally:
        await inspector.close()


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    async with playwright_api.async_playwright() as p:
        chromium = await p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            await chromium.close()


async def signed_in(browser: Any, base: str, name: str) -> Any:
    context = await browser.new_context(viewport={"width": 1360, "height": 900})
    context.set_default_timeout(T)
    page = await context.new_page()
    await page.goto(f"{base}/")
    await expect(page).to_have_url(f"{base}/login?next=%2F")
    await page.fill("input[name=token]", SECRETS[name])
    await page.click("button[type=submit]")
    await expect(page.locator("header .who")).to_contain_text(name)
    return page


async def shot(page: Any, name: str, store_kind: str) -> None:
    if SHOTS and store_kind == "sqlite":  # one set of pictures is enough
        folder = REPO_ROOT / SHOTS
        folder.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(folder / f"{name}.png"), full_page=True)


async def test_operator_follows_the_stuck_key_to_its_trace_and_resolves_it(
    console: tuple[str, str, int], browser: Any, store_kind: str
) -> None:
    url, base, job = console
    page = await signed_in(browser, base, "night-op")
    stuck = page.locator("#unknown-keys tbody tr", has_text=KEY)
    await expect(stuck).to_have_count(1)
    await expect(page.locator("body")).to_contain_text("fenced off (412)")
    await shot(page, "overview", store_kind)

    await stuck.locator("a.trace-key").click()
    fenced = page.locator("#trace tr.fenced")
    await expect(fenced).to_have_count(1)  # worker-1's late request, with its old token
    await expect(fenced).to_contain_text("worker-1")
    await expect(page.locator("#trace tr", has_text="reserved")).to_contain_text("worker-2")
    await shot(page, "trace", store_kind)

    await page.click("#open-key")
    form = page.locator("#resolve form")
    await form.locator("input[name=status]").fill("201")
    await form.locator("textarea[name=body]").fill('{"id": "ch_1"}')
    await form.locator("input[name=reason]").fill("upstream shows ch_1")
    await shot(page, "key", store_kind)
    await form.locator("button[type=submit]").click()
    await expect(page.locator("h1")).to_contain_text("Confirm: resolve key")
    record = await key_record(url)
    assert record is not None and record.state == "outcome_unknown"  # not before confirming
    await page.click("#confirm")
    await expect(page.locator(".notice")).to_contain_text("completed")

    record = await key_record(url)
    assert (record.state, record.response_status) == ("completed", 201)
    [row] = await audit_rows(url)
    assert (row["actor"], row["action"], row["tenant"], row["subject"], row["reason"]) == (
        "console:night-op", "keys.resolve_completed", "acme", KEY, "upstream shows ch_1",
    )  # fmt: skip
    assert orjson.loads(row["before"])["state"] == "outcome_unknown"
    assert orjson.loads(row["after"])["state"] == "completed"

    await page.click("header nav >> text=Audit")
    await expect(page.locator("#audit")).to_contain_text("console:night-op")
    await shot(page, "audit", store_kind)
    await page.click("header nav >> text=Keys")
    await expect(page.locator("#keys")).to_contain_text(KEY)
    await shot(page, "keys", store_kind)
    await page.click("header nav >> text=Jobs")
    await expect(page.locator("#jobs tbody tr")).to_have_count(1)
    await shot(page, "jobs", store_kind)
    await page.click(f"#jobs a[href='/jobs/{job}']")
    await expect(page.locator("#attempts li")).to_have_count(2)
    await expect(page.locator("#attempts")).to_contain_text("lease_expired")
    await shot(page, "job", store_kind)


async def test_viewer_gets_no_forms_and_its_post_is_refused(
    console: tuple[str, str, int], browser: Any
) -> None:
    url, base, job = console
    page = await signed_in(browser, base, "watcher")
    await page.goto(f"{base}/key?tenant=acme&key={KEY}")
    await expect(page.locator("#key-fields")).to_contain_text("outcome_unknown")
    await expect(page.locator("#resolve")).to_have_count(0)
    await page.goto(f"{base}/jobs/{job}")
    await expect(page.locator("#attempts li")).to_have_count(2)
    await expect(page.locator("form[action$='/cancel'], form[action$='/retry']")).to_have_count(0)
    csrf = await page.locator("input[name=csrf]").first.input_value()  # the sign-out form's
    answer = await page.request.post(
        f"{base}/key/resolve",
        form={"csrf": csrf, "tenant": "acme", "key": KEY, "mode": "release", "step": "confirm"},
        headers={"origin": base},
    )
    assert answer.status == 403
    record = await key_record(url)
    assert record is not None and record.state == "outcome_unknown"


async def test_tenant_token_does_not_see_another_tenants_key(
    console: tuple[str, str, int], browser: Any
) -> None:
    _, base, _ = console
    page = await signed_in(browser, base, "other-op")
    await expect(page.locator("#unknown-keys")).not_to_contain_text(KEY)
    await expect(page.locator("header nav")).not_to_contain_text("Jobs")
    await page.goto(f"{base}/keys")
    await expect(page.locator("#keys")).not_to_contain_text(KEY)
    answer = await page.goto(f"{base}/key?tenant=acme&key={KEY}")
    assert answer is not None and answer.status == 404


async def test_post_without_the_csrf_token_is_refused(
    console: tuple[str, str, int], browser: Any
) -> None:
    url, base, _ = console
    page = await signed_in(browser, base, "night-op")
    answer = await page.request.post(
        f"{base}/key/resolve",
        form={"tenant": "acme", "key": KEY, "mode": "release", "step": "confirm"},
        headers={"origin": base},
    )
    assert answer.status == 403
    record = await key_record(url)
    assert record is not None and record.state == "outcome_unknown"
    assert await audit_rows(url) == []


async def test_state_filters_show_the_chosen_state_in_the_operators_vocabulary(
    console: tuple[str, str, int], browser: Any
) -> None:
    _, base, _ = console
    page = await signed_in(browser, base, "watcher")
    await page.goto(f"{base}/keys")
    await page.select_option("select[name=state]", "outcome_unknown")
    await page.click("form.filters button[type=submit]")
    await expect(page.locator("select[name=state]")).to_have_value("outcome_unknown")
    row = page.locator("#keys tbody tr", has_text=KEY)
    await expect(row).to_contain_text("outcome_unknown")
    await expect(row).to_contain_text("upstream_timeout")
    await page.goto(f"{base}/jobs")
    await page.select_option("select[name=state]", "failed")
    await page.click("form.filters button[type=submit]")
    await expect(page.locator("select[name=state]")).to_have_value("failed")
    await expect(page.locator("#jobs tbody tr")).to_have_count(1)
    await page.goto(f"{base}/key?tenant=acme&key={KEY}")
    await expect(page.locator("h1")).to_contain_text("upstream_timeout")


async def test_a_failed_job_says_why_and_the_full_message_only_when_payloads_are_shown(
    console: tuple[str, str, int], console_showing_payloads: tuple[str, int], browser: Any
) -> None:
    _, base, job = console
    page = await signed_in(browser, base, "watcher")
    await page.goto(f"{base}/jobs/{job}")
    error = page.locator("#job-error")
    await expect(error).to_contain_text("charge_timeout")
    await expect(error).to_contain_text("card <number> declined for c-1048")
    expired, failed = page.locator("#attempts li").nth(0), page.locator("#attempts li").nth(1)
    await expect(expired).to_contain_text("lease_expired")
    await expect(expired).to_contain_text("lease expired on attempt 1 of 3")
    await expect(expired).not_to_contain_text("error")
    await expect(failed).to_contain_text("card <number> declined")
    assert "4242" not in await page.content()
    await expect(page.locator("#error-in-full")).to_have_count(0)

    shown_base, shown_job = console_showing_payloads
    shown = await signed_in(browser, shown_base, "watcher")
    await shown.goto(f"{shown_base}/jobs/{shown_job}")
    await expect(shown.locator("#error-in-full")).to_contain_text(
        "card 4242 4242 4242 4242 declined for c-1048"
    )


async def test_the_favicon_is_served_and_no_page_resource_is_missing(
    console: tuple[str, str, int], browser: Any
) -> None:
    _, base, job = console
    page = await signed_in(browser, base, "watcher")
    missing: list[str] = []
    page.on("response", lambda r: missing.append(r.url) if r.status >= 400 else None)
    for path in ("/", "/keys", "/jobs", f"/jobs/{job}", "/audit"):
        await page.goto(f"{base}{path}")
        await page.wait_for_load_state("networkidle")
    icon = await page.request.get(f"{base}/favicon.ico")
    assert icon.status == 200
    assert icon.headers["content-type"] == "image/svg+xml"
    assert (await icon.body()).startswith(b"<svg")
    assert missing == []


def test_a_script_screenshots_a_page_with_the_token_in_its_url(
    console: tuple[str, str, int], tmp_path: Path
) -> None:
    """A headless browser's --screenshot cannot send a header: the page takes the token as
    RFC 6750's access_token parameter; a wrong one is refused, and no action takes it."""
    _, base, _ = console
    shot = tmp_path / "keys.png"
    dump = subprocess.run(
        [str(CHROMIUM), *CHROMIUM_ARGS, "--dump-dom",
         f"{base}/keys?access_token={SECRETS['watcher']}"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert KEY in dump.stdout and "Sign in" not in dump.stdout, dump.stdout[-2000:]
    taken = subprocess.run(
        [str(CHROMIUM), *CHROMIUM_ARGS, f"--screenshot={shot}", "--window-size=1200,800",
         f"{base}/keys?access_token={SECRETS['watcher']}"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert taken.returncode == 0 and shot.stat().st_size > 10_000, taken.stderr[-2000:]
    with pytest.raises(urllib.error.HTTPError) as wrong:
        urllib.request.urlopen(f"{base}/keys?access_token=not-a-token", timeout=30)
    assert wrong.value.code == 401
