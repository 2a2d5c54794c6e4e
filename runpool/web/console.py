"""The operator console: server-rendered pages over bounded queries (console.sql), a little
JavaScript for the live run page and the Retry and Cancel buttons (static/console.js)."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, Final

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from runpool import health
from runpool.errors import InvalidInput
from runpool.live import TERMINAL

from .state import parse_run_id, web_of

__all__ = ["FAILED_CAP", "PAGE_ROWS", "TEMPLATES", "TENANT_CAP", "routes"]

# Rows a list page shows; tenants a tenants page shows.
PAGE_ROWS: Final = 100
# A tenant's queued runs are counted up to this many ("10,000+"), its runs failed in the
# last day up to FAILED_CAP.
TENANT_CAP: Final = 10_000
FAILED_CAP: Final = 1000
# A run page shows at most this many messages, tool calls and events (it says so).
RUN_ROWS: Final = 500

# The first page of a list in time order starts after these (beyond every run).
_FAR_FUTURE: Final = datetime(9999, 1, 1, tzinfo=UTC)
_LAST_ID: Final = uuid.UUID(int=2**128 - 1)


def duration(seconds: float | None) -> str:
    """A duration an operator reads at a glance: 850 ms, 12.4 s, 3 min 5 s, 2 h 10 min."""
    if seconds is None or math.isnan(seconds):
        return "–"
    sign, s = ("-" if seconds < 0 else ""), abs(seconds)
    if s < 1:
        text = f"{s * 1000:.0f} ms"
    elif s < 60:
        text = f"{s:.1f} s"
    elif s < 3600:
        text = f"{int(s // 60)} min {int(s % 60)} s"
    elif s < 86400:
        text = f"{int(s // 3600)} h {int(s % 3600 // 60)} min"
    else:
        text = f"{int(s // 86400)} d {int(s % 86400 // 3600)} h"
    return sign + text


def when(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return str(value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"))


def pretty(value: Any) -> str:
    """Message content as text: a string as it is, anything else as indented JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def short(run_id: Any) -> str:
    """A run id's first eight characters: enough to tell runs on one page apart."""
    return str(run_id)[:8]


def capped(count: int, cap: bool) -> str:
    return f"{count:,}+" if cap else f"{count:,}"


TEMPLATES = Environment(loader=PackageLoader("runpool.web", "templates"),
                   autoescape=select_autoescape(default=True, default_for_string=True),
                   trim_blocks=True, lstrip_blocks=True)
TEMPLATES.filters.update(duration=duration, when=when, pretty=pretty, short=short)
TEMPLATES.globals.update(capped=capped)


def _page(request: Request, template: str, **context: Any) -> Response:
    # Mounted under a prefix (root_path), every link and script carries it.
    root = request.scope.get("root_path", "")
    html = TEMPLATES.get_template(template).render(
        root=root, path=request.url.path.removeprefix(root) or "/", **context)
    return HTMLResponse(html, headers={"cache-control": "no-store"})


async def tenants(request: Request) -> Response:
    web = web_of(request)
    after = request.query_params.get("after", "")
    async with web.connection(read=True) as conn:
        rows = await web.rows(conn, "tenants", {"after": after, "limit": PAGE_ROWS,
                                                "cap": TENANT_CAP, "failed_cap": FAILED_CAP})
        workers = await web.rows(conn, "live_workers", {})
    # A snapshot held for minutes stops vacuum of the whole queue: said first thing. The
    # primary's sessions pin it (a replica's pg_stat_activity shows only its own).
    async with web.connection() as conn:
        warnings = await health.xmin_warnings(conn)
    for row in rows:
        row["wait_p95_s"] = web.tally.wait_p95(row["tenant"])
    more = rows[-1]["tenant"] if len(rows) == PAGE_ROWS else None
    return _page(request, "tenants.html", tenants=rows, workers=workers[0], after=after,
                 more=more, cap=TENANT_CAP, failed_cap=FAILED_CAP, warnings=warnings)


def _listing(query: str, template: str, key: str) -> Callable[[Request], Awaitable[Response]]:
    """A page listing one statement's first PAGE_ROWS rows."""

    async def page(request: Request) -> Response:
        web = web_of(request)
        async with web.connection(read=True) as conn:
            rows = await web.rows(conn, query, {"limit": PAGE_ROWS})
        return _page(request, template, limit=PAGE_ROWS, **{key: rows})

    return page


in_flight = _listing("in_flight", "in_flight.html", "runs")
stuck = _listing("stuck", "stuck.html", "runs")
workers = _listing("workers", "workers.html", "workers")
schedules = _listing("schedules", "schedules.html", "schedules")


async def dead_letters(request: Request) -> Response:
    web = web_of(request)
    tenant = request.query_params.get("tenant") or None
    before_text = request.query_params.get("before") or ""
    try:
        before = datetime.fromisoformat(before_text) if before_text else _FAR_FUTURE
    except ValueError:
        raise InvalidInput(f"before: not an ISO 8601 time: {before_text[:60]!r}") from None
    if before.tzinfo is None:
        raise InvalidInput("before: give a time zone")
    before_id = parse_run_id(request.query_params.get("before_id") or str(_LAST_ID),
                             "before_id")
    params = {"before": before, "before_id": before_id, "limit": PAGE_ROWS, "tenant": tenant}
    async with web.connection(read=True) as conn:
        rows = await web.rows(conn, "dead_letters_of_tenant" if tenant else "dead_letters",
                              params)
    more = ({"before": rows[-1]["finished_at"].isoformat(), "before_id": str(rows[-1]["id"])}
            | ({"tenant": tenant} if tenant else {})) if len(rows) == PAGE_ROWS else None
    return _page(request, "dead.html", runs=rows, tenant=tenant, more=more)


async def run_page(request: Request) -> Response:
    web = web_of(request)
    run_id = parse_run_id(request.path_params["id"])
    params = {"id": run_id, "tenant": None, "limit": RUN_ROWS}
    # Its live stream (events.py) then follows on the primary from the seq read here: a
    # lagging replica only means the stream replays a little more.
    async with web.connection(read=True) as conn, conn.transaction():
        await conn.execute(web.sql["snapshot"])
        found = await web.rows(conn, "run", params)
        if not found:
            raise HTTPException(404, "no such run")
        explain = await web.rows(conn, "explain", params)
        messages = await web.rows(conn, "messages", params)
        tool_calls = await web.rows(conn, "tool_calls", params)
        events = await web.rows(conn, "run_events", params)
    run = found[0]["run"]
    return _page(request, "run.html", run=run, attempts_left=found[0]["attempts_left"],
                 explain=explain[0]["explain_run"] if explain else None,
                 messages=messages[::-1], tool_calls=tool_calls[::-1], events=events,
                 limit=RUN_ROWS, after=run.get("event_seq", 0),
                 terminal=run["status"] in TERMINAL)


def routes() -> list[Route]:
    return [
        Route("/", tenants),
        Route("/runs", in_flight),
        Route("/runs/{id}", run_page),
        Route("/stuck", stuck),
        Route("/dead", dead_letters),
        Route("/workers", workers),
        Route("/schedules", schedules),
    ]
