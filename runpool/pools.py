"""The worker's connection pools: sessions set up once, the one returned last handed out first,
and a closed idle session noticed at its checkout without a round trip."""

from __future__ import annotations

import select
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool

from .codec import configure
from .db import STATELESS_OPTIONS, WORKER_SESSION, connection_options
from .tasks import finish_anyway

__all__ = ["open_pool"]


async def _configure_pooled(conn: psycopg.AsyncConnection[Any]) -> None:
    configure(conn)
    # Single statements commit on their own (one round trip); multi-statement work opens an
    # explicit transaction.
    await conn.set_autocommit(True)
    await conn.execute(WORKER_SESSION)


async def _configure_stateless(conn: psycopg.AsyncConnection[Any]) -> None:
    configure(conn)
    await conn.set_autocommit(True)
    # Explicit transactions begin with BEGIN ISOLATION LEVEL READ COMMITTED: no session state.
    await conn.set_isolation_level(psycopg.IsolationLevel.READ_COMMITTED)


class _MostRecentFirst(deque[Any]):
    """A pool's idle connections, the one returned last taken first. psycopg_pool takes from
    the left and returns to the right: every connection in turn, so a worker's trips visit all
    its server sessions, each cold in the CPU's caches when its turn comes back (W1 at 2 x 10:
    faster this way in ten pairs of ten, the medians 1.2x; see docs/performance.md). Returned to the
    left, the session just used serves the next trip, and the others only work beside it.
    (A session the server closed while it sat idle is found at its checkout: _still_open.)"""

    def append(self, conn: Any) -> None:
        self.appendleft(conn)


async def _still_open(conn: psycopg.AsyncConnection[Any]) -> None:
    """The pool's check at each checkout, without a round trip: an idle session has nothing to
    say, so something to read on its socket is the server's goodbye (a restart, a failover,
    pg_terminate_backend, a pooler's idle timeout) or the end of the stream. Such a session is
    closed here, which makes the pool replace it instead of handing it out again (first, as
    the connection returned last), and the checkout takes another; no statement meets it.
    Without this, the sessions a restart broke and the pool's order keeps at the back would
    fail the statements of the next burst of work, however long after."""
    fd = conn.pgconn.socket
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            readable = bool(poller.poll(0))
        else:  # (Windows, for an embedded pool: no poll there, but select takes sockets)
            readable = bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):
        return  # cannot tell: the session is handed out, and a statement finds out
    if readable:
        await conn.close()
        raise psycopg.OperationalError("the server closed this pooled session while it was idle")


async def open_pool(dsn: str, *, size: int, name: str, connect_timeout: int | None = None,
                    stateless: bool = False,
                    prepare: Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]] | None
                    = None) -> AsyncConnectionPool:
    """Open the worker's pool. A checkout costs no round trip (a check would cost one on every
    claim), and the server's idle_session_timeout does not apply to pooled sessions
    (WORKER_SESSION). A connection broken otherwise (a restart, a failover,
    pg_terminate_backend) fails its statement; the pool replaces it, and the operations that
    are safe to repeat retry on another connection (see retrying).
    `connect_timeout` (seconds, at least 2; default CONNECT_TIMEOUT unless the DSN sets one)
    bounds each new connection's attempt: one started while the network is silent would
    otherwise wait for as long as it stays silent. `stateless`: the connections may go through
    a transaction-mode pooler (see STATELESS_OPTIONS). `prepare`: run on each new session
    after its setup (not on a stateless one, whose prepared statements are not its own)."""

    async def configure_pooled(conn: psycopg.AsyncConnection[Any]) -> None:
        await _configure_pooled(conn)
        if prepare is not None:
            await prepare(conn)

    pool: AsyncConnectionPool = AsyncConnectionPool(
        dsn,
        min_size=size,
        max_size=size,
        name=name,
        open=False,
        # Named after the pool (unless the DSN names its connections): an operator can tell a
        # worker's connections in pg_stat_activity.
        kwargs={**connection_options(dsn, connect_timeout),
                **(STATELESS_OPTIONS if stateless else {}),
                **({} if "application_name" in conninfo_to_dict(dsn)
                   else {"application_name": name})},
        configure=_configure_stateless if stateless else configure_pooled,
        check=_still_open,
        max_idle=300,
        reconnect_timeout=3600,
    )
    pool._pool = _MostRecentFirst()  # (before open: it fills the pool through append)
    try:
        await pool.open(wait=True, timeout=30)
    except BaseException:
        # Cancelled (a pool stopped while it was starting: its heartbeat's own pool opens
        # then) or failed: closed to its end, else its maintenance tasks outlive it, and the
        # event loop's shutdown waited on them for good (a test's asyncio.run, now and then).
        await finish_anyway(pool.close())
        raise
    return pool


