"""The documentation site as a newcomer meets it: built by `mkdocs build --strict` (as CI builds
it: a broken link, anchor or reference part fails the build), served by a real HTTP server on
a loopback port, and opened in Debian's Chromium. From the home page the reader follows the
way to Getting started and finds its commands; every internal link of the built site answers
200 from the server and lands on an anchor that exists; the reference pages rendered from the
code are there, and so are the pages other work fills in (their paths are reserved in the nav).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import urldefrag, urljoin, urlsplit

import pytest
from playwright import async_api as playwright_api
from playwright.async_api import expect

from fencegate.cli import SUBCOMMANDS
from tests.support.net import free_port, wait_for_port
from tests.support.processes import REPO_ROOT, child_env, stop_process

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
NO_CHROMIUM = "needs Debian's chromium at /usr/bin/chromium (.ci/run installs it)"
NO_MKDOCS = "needs mkdocs-material (pip install -e '.[docs]'; .ci/run installs it)"
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not CHROMIUM.exists(), reason=NO_CHROMIUM),
    pytest.mark.skipif(importlib.util.find_spec("material") is None, reason=NO_MKDOCS),
]

T = 20_000  # ms for each browser wait: the machine is shared
# Pages other changes write; the nav reserves them so that their content lands in its place.
RESERVED = [
    "operations/connections/",
    "reference/errors/",
    "protocol/model/",
    "operations/safe-release/",
    "guides/reconciliation/",
]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built as CI builds it, into a directory outside the checkout."""
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(REPO_ROOT / "mkdocs.yml"), "--site-dir", str(out)],
        cwd=REPO_ROOT, env=child_env({"NO_MKDOCS_2_WARNING": "1"}),
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stderr}"
    return out


@pytest.fixture(scope="module")
def base(site: Path) -> Iterator[str]:
    """A real HTTP server (the standard library's) serving the built site on a free port."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
         "--directory", str(site)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_port(port, timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc, timeout=10)


@pytest.fixture
async def page() -> AsyncIterator[Any]:
    async with playwright_api.async_playwright() as p:
        chromium = await p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = await chromium.new_context(viewport={"width": 1360, "height": 900})
            context.set_default_timeout(T)
            yield await context.new_page()
        finally:
            await chromium.close()


class _Links(HTMLParser):
    """The ids, links and images of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if found.get("id"):
            self.ids.add(str(found["id"]))
        target = found.get("href") if tag in ("a", "link") else found.get("src")
        if target and tag in ("a", "link", "img", "script"):
            self.links.append(target)


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as answer:
            return answer.status, answer.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""


async def test_a_newcomer_follows_getting_started_from_the_home_page(page: Any, base: str) -> None:
    await page.goto(f"{base}/")
    await expect(page.locator("article h1")).to_contain_text("fencegate")
    await expect(page.locator("article")).to_contain_text("Neither half alone is exactly-once")

    await page.locator("article").get_by_role("link", name="Getting started").click()
    await expect(page).to_have_url(f"{base}/getting-started/")
    await expect(page.locator("article h1")).to_contain_text("Getting started")
    headings = await page.locator("article h2").all_inner_texts()
    assert [h.strip("¶").strip() for h in headings] == [
        "Install", "Run the demo", "Try the checks by hand", "Three more examples",
        "Run the tests", "Next",
    ]  # fmt: skip
    code = page.locator("article pre")
    await expect(code.filter(has_text="pip install .")).to_have_count(1)
    await expect(code.filter(has_text="fencegate demo")).to_be_visible()
    await expect(code.filter(has_text="Verdict: 1 capture executed")).to_be_visible()
    await expect(code.filter(has_text="python -m pytest -q")).to_be_visible()
    await expect(code.filter(has_text="X-Execution-Fence: 6")).to_be_visible()

    # Its next step leads on, and the sidebar knows where the reader is.
    await page.locator("article").get_by_role("link", name="leases").last.click()
    await expect(page).to_have_url(f"{base}/concepts/leases/")
    await expect(page.locator("article h1")).to_contain_text("Leases")
    await expect(page.locator("nav a.md-nav__link--active", has_text="Leases")).to_be_visible()


def test_every_internal_link_answers_and_lands_on_its_anchor(site: Path, base: str) -> None:
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= 30
    parsed: dict[str, _Links] = {}
    for html in pages:
        links = _Links()
        links.feed(html.read_text(encoding="utf-8"))
        parsed["/" + str(html.relative_to(site)).removesuffix("index.html")] = links

    broken: list[str] = []
    answered: dict[str, int] = {}
    for where, links in parsed.items():
        for link in links.links:
            url = urljoin(f"{base}{where}", link)
            if urlsplit(url).netloc != urlsplit(base).netloc:
                continue  # the theme's links to elsewhere: not ours to check
            target, anchor = urldefrag(url)
            path = urlsplit(target).path
            if target not in answered:
                answered[target] = fetch(target)[0]
            if answered[target] != 200:
                broken.append(f"{where}: {link} -> {answered[target]}")
            elif anchor and path in parsed and anchor not in parsed[path].ids:
                broken.append(f"{where}: {link} -> no #{anchor}")
    assert broken == []
    assert len(answered) > len(pages)  # the pages, and their images, scripts, stylesheets


async def test_the_reference_rendered_from_the_code_is_there(page: Any, base: str) -> None:
    await page.goto(f"{base}/reference/cli/")
    for name in SUBCOMMANDS:
        await expect(page.locator(f"article h2#fencegate-{name}")).to_be_visible()
    await expect(page.locator("article h3#fencegate-keys-resolve")).to_contain_text(
        "fencegate keys resolve"
    )
    await expect(page.locator("article")).to_contain_text("--release")

    # The environment table links each variable to the commands that read it.
    await page.goto(f"{base}/reference/configuration/")
    row = page.locator("article tr", has_text="FENCEGATE_CONSOLE_TOKENS_FILE")
    await expect(row).to_have_count(1)
    await row.get_by_role("link", name="console").click()
    await expect(page).to_have_url(f"{base}/reference/cli/#fencegate-console")
    await expect(page.locator("article h2#fencegate-console")).to_be_in_viewport()


async def test_reserved_pages_are_in_the_nav_and_the_console_pictures_load(
    page: Any, base: str
) -> None:
    await page.goto(f"{base}/")
    for path in RESERVED:
        await expect(page.locator(f'nav.md-nav--primary a[href$="{path}"]')).to_have_count(1)
        status, _ = fetch(f"{base}/{path}")
        assert status == 200, path

    await page.goto(f"{base}/operations/console/")
    pictures = page.locator("article img")
    await expect(pictures).to_have_count(7)
    for index in range(7):
        picture = pictures.nth(index)
        await picture.scroll_into_view_if_needed()
        await expect(picture).to_have_js_property("complete", True)
        width = await picture.evaluate("img => img.naturalWidth")
        assert width > 0, await picture.get_attribute("src")


async def test_search_finds_a_page_offline(page: Any, base: str) -> None:
    await page.goto(f"{base}/")
    search = page.locator("input.md-search__input")
    await search.click()
    await search.press_sequentially("outcome unknown", delay=20)  # keystrokes, as typed
    result = page.locator(".md-search-result__item a", has_text="Outcome unknown").first
    await expect(result).to_be_visible()
    await result.click()
    await expect(page.locator("article h1")).to_contain_text("Outcome unknown")
