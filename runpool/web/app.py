"""create_app(): the ASGI application — the run API, and without a tenant_of the operator
console and /metrics as well."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from importlib.resources import files
from typing import Any, Final

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runpool.db import connect, connection_options, set_up
from runpool.errors import InvalidInput, UsageError
from runpool.live_hub import FollowHub
from runpool.migrate import check

from . import api, console, events, metrics
from .state import TenantOf, Web
from .tally import READ_LIMIT

__all__ = ["create_app"]

logger = logging.getLogger("runpool.web")

# Seconds any statement of the app may run: every query is bounded, so one that is not done
# by then is stuck behind a lock, and the request is better answered with an error.
STATEMENT_TIMEOUT: Final = "10s"
# Database connections of one app (its event streams' hub has its own: see events.py).
POOL_SIZE: Final = 8
# How often the operator app reads the event log into its tally (metrics, wait p95).
TALLY_SECONDS: Final = 5.0

# The app's sessions: runpool's session settings, and a bound on every statement.
WEB_SESSION: Final = "SELECT set_config('statement_timeout', %s, false)"

# The console's pages may only load what the app itself serves: no inline script, no CDN.
CSP: Final = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
              " connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'")


async def _configure(conn: psycopg.AsyncConnection[Any]) -> None:
    await set_up(conn)
    # Read here, not at import: a test may shorten it.
    await conn.execute(WEB_SESSION, (STATEMENT_TIMEOUT,))


def _check_schema(dsn: str) -> None:
    with connect(dsn, autocommit=True) as conn:
        check(conn)


async def _tally_forever(web: Web) -> None:
    """Keep the tally current, whether or not anyone scrapes."""
    while True:
        try:
            async with web.connection(read=True) as conn:
                read = await web.tally.refresh(conn)
        except Exception as exc:  # the database may be away: try again next round
            logger.warning("reading the event log failed: %r", exc,
                           extra={"action": "tally_failed"})
            read = 0
        # A full page read means a backlog: read the next page at once.
        if read < READ_LIMIT:
            await asyncio.sleep(TALLY_SECONDS)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    # JSON for the API, wherever the app is mounted (root_path: the mount's prefix).
    path = request.url.path.removeprefix(request.scope.get("root_path", ""))
    if path.startswith("/api/"):
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code,
                            headers=exc.headers)
    return PlainTextResponse(f"{exc.status_code}: {exc.detail}", status_code=exc.status_code)


async def _invalid(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": str(exc)}, status_code=400)


async def _busy(request: Request, exc: Exception) -> Response:
    """A statement that ran out its statement_timeout: every query here is bounded, so it
    waited for a lock (a caller's open transaction holding the run's row, say)."""
    logger.warning("%s %s: %r", request.method, request.url.path, exc,
                   extra={"action": "web_statement_timeout"})
    return await _http_error(request, HTTPException(
        503, "the database did not answer in time (the run may be locked by another"
             " transaction); try again"))


async def _unavailable(request: Request, exc: Exception) -> Response:
    """The database cannot be reached (down, restarting, a failover): a 503, which load
    balancers and clients retry, rather than a 500."""
    logger.warning("%s %s: database unavailable: %r", request.method, request.url.path, exc,
                   extra={"action": "web_database_unavailable"})
    return await _http_error(request, HTTPException(503, "the database is unavailable"))


async def _healthz(request: Request) -> Response:
    web: Web = request.app.state.web
    async with web.connection() as conn:
        await conn.execute(web.sql["healthz"])
    return PlainTextResponse("ok")


def create_app(dsn: str | None = None, tenant_of: TenantOf | None = None, *,
               read_dsn: str | None = None) -> Starlette:
    """The run API over HTTP (see DESIGN.md, "HTTP: the run API and the web console").

    dsn: the database (default RUNPOOL_DSN, else DATABASE_URL). tenant_of(request) -> str |
    None, sync or async: every route acts for the tenant it returns (another tenant's run is
    a 404, a None answer a 401), and the console and /metrics are not served. Without it the
    app is the operator console over every tenant: serve it to operators only.

    read_dsn: a read replica (default RUNPOOL_READ_DSN, when `dsn` is not given either) for
    the console's pages and /metrics, which may then lag behind the primary by the replica's
    delay. The run API (its reads too: a client reads the run it just created), the event
    streams (LISTEN) and /healthz stay on `dsn`.
    """
    if dsn is None:
        read_dsn = read_dsn or os.environ.get("RUNPOOL_READ_DSN") or None
    dsn = dsn or os.environ.get("RUNPOOL_DSN") or os.environ.get("DATABASE_URL")
    if not dsn:
        raise UsageError("create_app needs a dsn (or RUNPOOL_DSN / DATABASE_URL)")
    web = Web(dsn, tenant_of, read_dsn)

    def new_pool(target: str, name: str) -> AsyncConnectionPool:
        return AsyncConnectionPool(
            target, min_size=1, max_size=POOL_SIZE, name=name, open=False,
            kwargs={**connection_options(target), "application_name": name},
            configure=_configure, max_idle=300)

    async def open_pool() -> AsyncConnectionPool:
        # Refuse to serve a schema this code does not match, as the pool does (a replica
        # still behind a migration too).
        for target in (dsn, read_dsn):
            if target is not None:
                await asyncio.to_thread(_check_schema, target)
        pool = new_pool(dsn, "runpool-web")
        await pool.open(wait=True, timeout=30)
        web.hub = FollowHub(dsn, name=events.APPLICATION_NAME)
        await web.hub.open()
        if read_dsn is not None:
            web.read_pool = new_pool(read_dsn, "runpool-web-read")
            await web.read_pool.open(wait=True, timeout=30)
        if tenant_of is None:
            web.tally_task = asyncio.create_task(_tally_forever(web), name="runpool-web-tally")
        return pool

    web.open_pool = open_pool

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Served on its own (python -m runpool ui, uvicorn): open now, close at shutdown.
        # Mounted in another app, whose lifespan this is not, it opens at the first request.
        async with web.connection():
            pass
        try:
            yield
        finally:
            await web.close()

    routes: list[BaseRoute] = [
        Route("/healthz", _healthz),
        Route("/api/runs", api.create_run, methods=["POST"]),
        Route("/api/runs/{id}", api.read_run),
        Route("/api/runs/{id}/events", events.run_events),
        Route("/api/runs/{id}/cancel", api.cancel_run, methods=["POST"]),
        Route("/api/runs/{id}/retry", api.retry_run, methods=["POST"]),
        Route("/api/runs/{id}/signals/{name}", api.signal_run, methods=["POST"]),
    ]
    if tenant_of is None:
        static = files("runpool.web") / "static"
        routes += [
            Route("/metrics", metrics.metrics),
            *console.routes(),
            Mount("/static", StaticFiles(directory=str(static)), name="static"),
        ]
    app = Starlette(
        routes=routes, lifespan=lifespan, middleware=[Middleware(_SecurityHeaders)],
        exception_handlers={HTTPException: _http_error, InvalidInput: _invalid,
                            pg_errors.QueryCanceled: _busy,
                            psycopg.OperationalError: _unavailable})
    app.state.web = web
    return app


class _SecurityHeaders:
    """Adds the console's security headers to every response (plain ASGI, so an event
    stream passes through untouched)."""

    HEADERS: Final = [
        (b"content-security-policy", CSP.encode()),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),
    ]

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *self.HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)
