"""The console in a real browser: Debian's Chromium driven by Playwright, against a real pool
and database through a real uvicorn server. Skipped (naming the package) without
/usr/bin/chromium, unless RUNPOOL_TEST_REQUIRE_SYSTEM=1 (CI), where that fails."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, Route, expect, sync_playwright

from runpool.web import create_app
from tests.helpers import running_pool, status_of, wait_for
from tests.system import require_program
from tests.webserver import serving

pytestmark = pytest.mark.slow
# A page's expectations wait for what the page will show; Playwright's 5 s default is short for
# a machine at load 20 (a bound, not a pace: a passing expectation returns at once).
expect.set_options(timeout=15_000)

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    chromium = require_program("/usr/bin/chromium", "chromium")
    with sync_playwright() as p:
        # Debian's Chromium: `playwright install` (a download) is never needed.
        launched = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


def _watch_errors(page: Page) -> list[str]:
    """Every JavaScript error and console error the page reports."""
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
    page.on("console", lambda msg: errors.append(f"console: {msg.text}")
            if msg.type == "error" else None)
    return errors


def _enqueue(conn: Any, tenant: str, handler: str, input: str = "{}") -> uuid.UUID:
    row = conn.execute("SELECT runpool.enqueue(%s, %s, %s)", (tenant, handler, input)).fetchone()
    return row[0]  # type: ignore[no-any-return]


def test_browser_console__tenants_live_run_and_cancel(browser: Browser, dsn: str, conn) -> None:
    chatty = _enqueue(conn, "acme", "chat", '{"every": 0.4}')
    dead = _enqueue(conn, "acme", "fails")
    for _ in range(2):
        _enqueue(conn, "globex", "nobody_serves_this")
    with running_pool(dsn, app="tests.web_apps:app", concurrency=2), \
            serving(create_app(dsn)) as url:
        wait_for(lambda: status_of(conn, chatty) == "running" and status_of(conn, dead) == "failed",
                 what="the chat run to start and the other to fail")
        page = browser.new_page()
        errors = _watch_errors(page)

        page.goto(url + "/")
        acme = page.locator('tr[data-tenant="acme"]')
        expect(acme.locator('[data-col="running"]')).to_have_text("1")
        expect(page.locator('tr[data-tenant="globex"] [data-col="queued"]')).to_have_text("2")

        page.click("text=In flight")
        page.click(f'a[href="/runs/{chatty}"]')
        expect(page.locator("#status")).to_have_text("running")
        # A marker on this document: it is still there later only if the page never reloaded.
        page.evaluate("window.__sameDocument = true")
        messages = page.locator("#conversation li")
        expect(messages.first).to_be_visible()
        seen = messages.count()
        # New messages arrive over the stream (the page is never reloaded: see the marker).
        page.wait_for_function("n => document.querySelectorAll('#conversation li').length >= n",
                               arg=seen + 2, timeout=10_000)
        expect(page.locator("#conversation li").last).to_contain_text("still thinking")
        expect(page.locator("#tool-calls tbody tr").first).to_be_visible()
        assert page.evaluate("window.__sameDocument") is True

        page.click("#cancel")
        expect(page.locator("#status")).to_have_text("cancelled", timeout=15_000)
        expect(page.locator("#cancel")).to_be_hidden()
        assert status_of(conn, chatty) == "cancelled"
        assert page.evaluate("window.__sameDocument") is True

        # The dead letter, retried from its list.
        page.click("text=Dead letters")
        row = page.locator("#dead tbody tr", has_text="refused by handler")
        row.get_by_role("button", name="Retry").click()
        expect(row.locator(".badge")).to_have_text("queued")
        wait_for(lambda: status_of(conn, dead) == "failed"
                 and conn.execute("SELECT attempt FROM runpool.runs WHERE id = %s",
                                  (dead,)).fetchone()[0] == 2, what="the retried run to run")
        page.close()
        assert errors == [], errors


def test_browser_console__a_late_cancel_answer_never_takes_the_streamed_end_back(
        browser: Browser, dsn: str, conn) -> None:
    """The cancel's own response ("running": cancel requested) can arrive after the stream has
    told "cancelled" (CI at load 20 saw it): the page keeps "cancelled" and hides Cancel."""
    chatty = _enqueue(conn, "acme", "chat", '{"every": 0.4}')
    with running_pool(dsn, app="tests.web_apps:app", concurrency=2), \
            serving(create_app(dsn)) as url:
        wait_for(lambda: status_of(conn, chatty) == "running", what="the chat run to start")
        page = browser.new_page()
        errors = _watch_errors(page)
        held: list[Route] = []
        page.route("**/api/runs/*/cancel", lambda route: held.append(route))  # answered late
        page.goto(f"{url}/runs/{chatty}")
        expect(page.locator("#status")).to_have_text("running")
        with page.expect_request("**/api/runs/*/cancel"):
            page.click("#cancel")
        # Playwright hands the held route over only inside its own calls: evaluate lets it.
        wait_for(lambda: held or page.evaluate("false"), what="the cancel request held")
        conn.execute("SELECT runpool.cancel_run(%s, 'test')", (chatty,))
        expect(page.locator("#status")).to_have_text("cancelled", timeout=15_000)
        held[0].fulfill(status=200, json={"id": str(chatty), "status": "running"})
        expect(page.locator('#cancel[data-answer="running"]')).to_be_attached()
        expect(page.locator("#status")).to_have_text("cancelled")
        expect(page.locator("#cancel")).to_be_hidden()
        expect(page.locator("#retry")).to_be_visible()
        page.close()
        assert errors == [], errors
