"""Database work under a deadline: a pooled connection whose whole use ends in time or is
cut (bounded, sever), and repeating on another connection what failed transiently (transient,
again, retrying)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import psycopg
from psycopg import capabilities
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from .errors import DatabaseTimeout

__all__ = ["again", "bounded", "retrying", "sever", "transient"]

# The logger of runpool.db, where these lived first: operators' log filters name it.
logger = logging.getLogger("runpool.db")
T = TypeVar("T")


def transient(exc: BaseException) -> bool:
    """Worth repeating on another connection: the connection, the server or a concurrent
    transaction failed the statement (SQLSTATE classes 08, 40, 53, 57, 58, or no SQLSTATE:
    the client lost the connection), not the statement's own data (a value the database
    refuses fails the same way every time)."""
    if isinstance(exc, TimeoutError | PoolTimeout):
        return True
    if not isinstance(exc, psycopg.OperationalError):
        return False
    state = exc.sqlstate
    return state is None or state[:2] in ("08", "40", "53", "57", "58")


async def retrying(pool: AsyncConnectionPool, seconds: float,
                   op: Callable[[psycopg.AsyncConnection[Any], int], Awaitable[T]],
                   *, what: str, log: dict[str, str] | None = None) -> T:
    """Run `op(conn, try_number)` on a pooled connection, again on another one when it fails
    transiently, until it succeeds or `seconds` have passed (then its last error is raised).

    Only for operations that are safe to repeat: reads, and writes that tell "already done
    by me" from "refused" on a later try (which is what try_number is for)."""
    deadline = asyncio.get_running_loop().time() + seconds

    async def once(tries: int) -> T:
        left = max(deadline - asyncio.get_running_loop().time(), 0.001)
        async with bounded(pool, left) as conn:
            return await op(conn, tries)

    return await again(once, seconds, what=what, log=log)


async def again(op: Callable[[int], Awaitable[T]], seconds: float, *, what: str,
                log: dict[str, str] | None = None) -> T:
    """Run `op(try_number)` until it does not fail transiently, or `seconds` have passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    delay = 0.02
    tries = 0
    held = False
    while True:
        try:
            return await op(tries)
        except Exception as exc:
            tries += 1
            if not transient(exc) or loop.time() + delay >= deadline:
                raise
            if isinstance(exc.__cause__, psycopg.errors.LockNotAvailable):
                # A row held by another transaction: polled for, said once (a tenant's open
                # transaction would otherwise log a line per held row per second).
                if not held:
                    logger.warning("%s waits for a lock another transaction holds, polling: %s",
                                   what, exc, extra={"action": "db_row_held", "what": what,
                                                     **(log or {})})
                held = True
            else:
                logger.warning("%s failed (try %d), retrying on another connection: %r",
                               what, tries, exc,
                               extra={"action": "db_retry", "what": what, **(log or {})})
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


@asynccontextmanager
async def bounded(pool: AsyncConnectionPool, seconds: float
                  ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A pooled connection whose whole use must end within `seconds` (TimeoutError if not).

    A silent server — a black-holed network path, a peer that vanished mid-query — otherwise
    hangs a statement until TCP gives up, which can take many minutes: keepalives only probe
    idle connections. At the deadline the socket is shut down, so the statement fails at once
    like a connection the network broke, and the connection is closed rather than reused; a
    cancel request goes to the server in the background, so a server that is merely slow does
    not finish (or commit) the statement after we gave up. Cancelling the task instead would
    be slower than the fault: psycopg answers a cancelled statement by sending a cancel request
    and waiting for the server, up to ten seconds more on a silent path — longer than a lease.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    async with pool.connection(timeout=seconds) as conn:
        if loop.time() >= deadline:
            raise DatabaseTimeout(f"no database connection within {seconds:g}s")
        severed: list[bool] = []
        timer = loop.call_at(deadline, _sever_late, conn, severed)
        try:
            yield conn
        except psycopg.OperationalError as exc:
            if severed:
                raise DatabaseTimeout(f"database work did not finish within {seconds:g}s") from exc
            raise
        finally:
            timer.cancel()
            if severed:
                await conn.close()


# Background cancel requests, referenced until they finish.
_cancels: set[asyncio.Task[None]] = set()


def _sever_late(conn: psycopg.AsyncConnection[Any], severed: list[bool]) -> None:
    severed.append(True)
    # Only with libpq 17's non-blocking cancel: the older one blocks a thread for as long as a
    # silent path stays silent. The task's first step, which builds the cancel request from the
    # connection, runs before the caller can close it: it is scheduled ahead of the socket's
    # wake-up.
    if capabilities.has_cancel_safe():
        task = asyncio.get_running_loop().create_task(_cancel_quietly(conn))
        _cancels.add(task)
        task.add_done_callback(_cancels.discard)
    sever(conn)


async def _cancel_quietly(conn: psycopg.AsyncConnection[Any]) -> None:
    try:
        await conn.cancel_safe(timeout=5)
    except Exception:  # best effort: the server may be unreachable, which is why we are here
        pass


def sever(conn: psycopg.AsyncConnection[Any] | psycopg.Connection[Any]) -> None:
    """Break a connection as a network cut would: its next (or current) read fails at once."""
    try:
        fd = os.dup(conn.pgconn.socket)
    except (psycopg.OperationalError, OSError):
        return  # already closed
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        return
    # shutdown() acts on the socket, not the descriptor: the duplicate reaches psycopg's too.
    with sock, contextlib.suppress(OSError):  # OSError: not connected any more, nothing to cut
        sock.shutdown(socket.SHUT_RDWR)
