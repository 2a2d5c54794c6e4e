"""Takes the README's screenshots of the web console (docs/console-*.png).

    python docs/screenshots.py --dsn postgresql://postgres@127.0.0.1:5432/postgres

Makes a scratch database on that server, runs an embedded pool of a small research agent with
a few tenants' worth of runs, serves runpool.web with uvicorn, and photographs the pages with
Playwright driving Debian's Chromium (/usr/bin/chromium). The database is dropped afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import threading
from pathlib import Path
from typing import Any

import psycopg
import uvicorn
from playwright.async_api import async_playwright
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import runpool
from runpool.db import connect
from runpool.migrate import migrate
from runpool.web import create_app

HERE = Path(__file__).resolve().parent
DATABASE = "runpool_screenshots"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

app = runpool.App()

QUESTIONS = ["Which EU regulations apply to our new battery supplier?",
             "Summarise last quarter's churn drivers for the board",
             "Find three vendors for SOC 2 audit automation",
             "Draft a migration plan from MySQL 5.7 to PostgreSQL 16"]


@app.handler("research")
async def research(run: runpool.Run) -> Any:
    question = run.input["question"]
    await run.add_message("user", question)
    for turn in range(int(run.input.get("turns", 12))):
        await run.add_message("assistant", f"Step {turn + 1}: looking for sources on"
                              f" \u201c{question[:40]}\u2026\u201d")
        found = await run.tool(f"search-{turn}", "web_search",
                               {"query": question, "page": turn}, _search)
        await run.add_message("assistant", f"Found {found['hits']} results; reading the two"
                              " most relevant before the next step.")
        await asyncio.sleep(float(run.input.get("think", 1.5)))
    return {"answer": "see conversation"}


def _search(arguments: Any, key: str) -> Any:
    return {"hits": 3 + arguments["page"] * 2, "top": f"https://example.org/{key[-6:]}"}


@app.handler("summarize")
async def summarize(run: runpool.Run) -> Any:
    await asyncio.sleep(0.2)
    return {"summary": "ok"}


@app.handler("triage")
async def triage(run: runpool.Run) -> Any:
    raise runpool.Fail("ticket 4411: customer record not found in CRM")


def _with_db(dsn: str, dbname: str) -> str:
    params = conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return make_conninfo(**params)  # type: ignore[arg-type]


def _seed(dsn: str) -> str:
    """Runs of four tenants; returns the id of a research run to photograph."""
    rnd = random.Random(7)
    with connect(dsn, autocommit=True) as conn:
        migrate(conn)
        conn.execute("SELECT runpool.set_tenant_quota('acme', 3)")
        conn.execute("SELECT runpool.set_tenant_quota('initech', 0)")
        featured = runpool.enqueue(conn, "acme", "research",
                                   {"question": QUESTIONS[0], "turns": 40, "think": 1.2})
        for i in range(4):
            runpool.enqueue(conn, "acme", "research",
                            {"question": QUESTIONS[i % 4], "turns": 30, "think": 2})
        for i in range(2):
            runpool.enqueue(conn, "globex", "research",
                            {"question": QUESTIONS[(i + 1) % 4], "turns": 30, "think": 2})
        for _ in range(60):
            runpool.enqueue(conn, "globex", "summarize", {"doc": rnd.randint(1, 999)},
                            priority=-5)
        for _ in range(3):
            runpool.enqueue(conn, "umbrella", "triage", {"ticket": rnd.randint(4000, 4999)})
        for _ in range(6):
            runpool.enqueue(conn, "initech", "summarize", {"doc": 1})
        conn.execute("SELECT runpool.enqueue('umbrella', 'summarize', '{}',"
                     " run_at => now() + interval '2 hours') FROM generate_series(1, 12)")
    return str(featured)


async def _shoot(url: str, featured: str) -> None:
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path="/usr/bin/chromium",
                                          args=CHROMIUM_ARGS)
        page = await browser.new_page(viewport={"width": 1280, "height": 760})
        await page.goto(url + "/")
        await page.screenshot(path=str(HERE / "console-tenants.png"))
        await page.goto(url + "/runs")
        await page.screenshot(path=str(HERE / "console-in-flight.png"))
        await page.goto(url + "/dead")
        await page.screenshot(path=str(HERE / "console-dead-letters.png"))
        await page.goto(f"{url}/runs/{featured}")
        await page.wait_for_timeout(4000)  # a few turns arrive live
        await page.screenshot(path=str(HERE / "console-run.png"), full_page=False)
        await browser.close()


async def _main(dsn: str) -> None:
    featured = _seed(dsn)
    server = uvicorn.Server(uvicorn.Config(create_app(dsn), host="127.0.0.1", port=0,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    async with runpool.Pool(app, dsn=dsn, concurrency=8):
        while not server.started:
            await asyncio.sleep(0.05)
        await asyncio.sleep(6)  # runs start, some finish, the failures land
        port = server.servers[0].sockets[0].getsockname()[1]
        await _shoot(f"http://127.0.0.1:{port}", featured)
    server.should_exit = True
    thread.join(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", required=True, help="a server where it may create a database")
    args = parser.parse_args()
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(DATABASE)))
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))
    try:
        asyncio.run(_main(_with_db(args.dsn, DATABASE)))
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(DATABASE)))
    print("wrote", *sorted(p.name for p in HERE.glob("console-*.png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
