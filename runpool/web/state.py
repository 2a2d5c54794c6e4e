"""What every route of the web app shares: the connection pool, the tenant scope, the SQL."""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any, Final, LiteralString

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from starlette.exceptions import HTTPException
from starlette.requests import Request

from runpool.errors import InvalidInput
from runpool.live_hub import FollowHub

from .sql import SQL
from .tally import Tally

__all__ = ["TenantOf", "Web", "jsonable", "parse_run_id", "web_of"]

# tenant_of(request): the tenant a request acts for (None: refused), sync or async.
TenantOf = Callable[[Request], "str | Awaitable[str | None] | None"]

# Seconds a request may wait for a free connection before it is answered 503.
CHECKOUT_SECONDS: Final = 5.0


async def _no_pool() -> AsyncConnectionPool:
    raise RuntimeError("create_app sets how the pool opens")


@dataclass
class Web:
    """The app's shared state. Mutable (the pool, the stream counts, the tally change while
    the app serves), and only ever touched from the app's event loop."""

    dsn: str
    tenant_of: TenantOf | None
    # A read replica for the console's pages and /metrics (RUNPOOL_READ_DSN); None: `dsn`.
    read_dsn: str | None = None
    sql: dict[str, LiteralString] = field(default_factory=lambda: SQL)
    tally: Tally = field(default_factory=Tally)
    pool: AsyncConnectionPool | None = None
    # The replica's pool, opened with `pool` when read_dsn is set.
    read_pool: AsyncConnectionPool | None = None
    # Open event streams per tenant (None: the operator), for their caps.
    streams: dict[str | None, int] = field(default_factory=dict)
    # What the event streams follow through (events.py), opened with `pool` on `dsn`.
    hub: FollowHub | None = None
    # Opens the pool (app.py); set by create_app.
    open_pool: Callable[[], Awaitable[AsyncConnectionPool]] = field(default=_no_pool)
    _opening: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The operator app's background reader of the event log (app.py).
    tally_task: asyncio.Task[None] | None = None

    @asynccontextmanager
    async def connection(self, *, read: bool = False
                         ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A connection to the primary; with `read`, to the read replica if there is one
        (for what only reads and may lag: never before a write, nor to read one's own)."""
        pool = self.pool or await self._open_late()
        if read and self.read_pool is not None:
            pool = self.read_pool
        try:
            async with pool.connection(timeout=CHECKOUT_SECONDS) as conn:
                yield conn
        except PoolTimeout:
            raise HTTPException(503, "the database is busy: no connection free; try again"
                                ) from None

    async def _open_late(self) -> AsyncConnectionPool:
        """The pool, opened at the first request: Starlette runs no lifespan of a mounted app
        (a FastAPI service's app.mount), only the outer app's."""
        async with self._opening:
            if self.pool is None:
                self.pool = await self.open_pool()
        return self.pool

    async def close(self) -> None:
        if self.tally_task is not None:
            self.tally_task.cancel()
            await asyncio.gather(self.tally_task, return_exceptions=True)
            self.tally_task = None
        if self.hub is not None:
            await self.hub.close()
            self.hub = None
        if self.read_pool is not None:
            await self.read_pool.close()
            self.read_pool = None
        if self.pool is not None:
            await self.pool.close()
            self.pool = None

    async def rows(self, conn: psycopg.AsyncConnection[Any], name: str,
                   params: dict[str, Any]) -> list[dict[str, Any]]:
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(self.sql[name], params)
        return await cur.fetchall()

    async def scope(self, request: Request) -> str | None:
        """The tenant this request is confined to; None in the operator console. A product's
        tenant_of answering None is a 401."""
        if self.tenant_of is None:
            return None
        tenant = self.tenant_of(request)
        if inspect.isawaitable(tenant):
            tenant = await tenant
        if tenant is None:
            raise HTTPException(401, "not authenticated")
        if not isinstance(tenant, str):
            raise TypeError(f"tenant_of must return a str or None, not {type(tenant).__name__}")
        return tenant


def web_of(request: Request) -> Web:
    web: Web = request.app.state.web
    return web


def parse_run_id(text: str, field: str = "id") -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise InvalidInput(f"{field}: not a run id (a UUID): {text[:100]!r}") from None


def jsonable(value: Any) -> Any:
    """A database value as JSON: times as ISO 8601, UUIDs as text."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    return value

