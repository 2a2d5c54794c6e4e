"""A live reader's connection I/O (runpool.live's wait, wait_async and follow): one
statement at a time, committed at once and cut when left unanswered; naps until a
notification; the steps of a wait performed on a blocking or an async connection.

What to read and when is runpool.live's; this module knows no runs."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from .db import require_utf8
from .deadlines import sever
from .errors import UsageError

__all__ = ["Answer", "Nap", "Read", "aexecute", "anap", "aperform", "aquiet", "execute",
           "idle", "perform", "quiet"]


@dataclass(frozen=True)
class Read:
    """A step: run one statement, cut after `bound` seconds unanswered; answered with its
    first row (None for a statement without rows)."""

    bound: float
    query: Any
    params: dict[str, Any] | None = None


@dataclass(frozen=True)
class Nap:
    """A step: wait for a notification of the connection's channels, `seconds` at most (not
    listening: just the seconds); answered with None."""

    seconds: float


# A step's answer: a row, None, or the connection's failure (the caller judges it).
Answer = tuple[Any, ...] | None | psycopg.OperationalError


def idle(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Waiting inside the caller's transaction would hold it open (and its LISTEN would only
    take effect at its commit): refused."""
    require_utf8(conn)
    if conn.info.transaction_status != TransactionStatus.IDLE:
        raise UsageError("wait and follow need a connection outside any transaction: they"
                         " hold none open while they wait (commit or roll back first)")


async def aperform(aconn: psycopg.AsyncConnection[Any], step: Read | Nap,
                   listen: bool) -> Answer:
    """One step of a wait on an async connection; its answer."""
    try:
        if isinstance(step, Nap):
            await anap(aconn, step.seconds, listen)
            return None
        cur = await aexecute(aconn, step.bound, step.query, step.params)
        return await cur.fetchone() if cur.description is not None else None
    except psycopg.OperationalError as exc:
        return exc


def perform(conn: psycopg.Connection[Any], step: Read | Nap, listen: bool) -> Answer:
    """aperform() for a blocking connection."""
    try:
        if isinstance(step, Nap):
            nap(conn, step.seconds, listen)
            return None
        cur = execute(conn, step.bound, step.query, step.params)
        return cur.fetchone() if cur.description is not None else None
    except psycopg.OperationalError as exc:
        return exc


async def aexecute(aconn: psycopg.AsyncConnection[Any], bound: float, query: Any,
                   params: dict[str, Any] | None = None) -> psycopg.AsyncCursor[Any]:
    """One statement, committed at once when the connection is not in autocommit: nothing is
    held open between reads. Unanswered after `bound` seconds, the connection is cut."""
    timer = asyncio.get_running_loop().call_later(bound, sever, aconn)
    try:
        cur = await aconn.cursor(row_factory=tuple_row).execute(query, params)
        if not aconn.autocommit:
            await aconn.commit()
    finally:
        timer.cancel()
    return cur


def execute(conn: psycopg.Connection[Any], bound: float, query: Any,
            params: dict[str, Any] | None = None) -> psycopg.Cursor[Any]:
    """aexecute() for a blocking connection."""
    with _cut_after(conn, bound):
        cur = conn.cursor(row_factory=tuple_row).execute(query, params)
        if not conn.autocommit:
            conn.commit()
    return cur


@contextmanager
def _cut_after(conn: psycopg.Connection[Any], seconds: float) -> Iterator[None]:
    """Cut the connection if the block still runs after `seconds` (the blocking twin of
    aexecute's timer: a blocked read can only be woken from another thread)."""
    timer = threading.Timer(seconds, sever, (conn,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


async def anap(aconn: psycopg.AsyncConnection[Any], seconds: float, listen: bool) -> None:
    """Until a notification of this connection's channels arrives, or `seconds` pass.
    Notifications that arrived while reading are kept by psycopg and end the wait at once."""
    if not listen:
        await asyncio.sleep(seconds)
        return
    async for _ in aconn.notifies(timeout=seconds, stop_after=1):
        pass


def nap(conn: psycopg.Connection[Any], seconds: float, listen: bool) -> None:
    """anap() for a blocking connection."""
    if not listen:
        time.sleep(seconds)
        return
    for _ in conn.notifies(timeout=seconds, stop_after=1):
        pass


async def aquiet(aconn: psycopg.AsyncConnection[Any], bound: float, unlisten: Any) -> None:
    """Run the UNLISTEN `unlisten` as a reader ends, if its connection can still take it."""
    try:
        if not aconn.closed and aconn.info.transaction_status == TransactionStatus.IDLE:
            await aexecute(aconn, bound, unlisten)
    except psycopg.Error:
        pass  # a broken connection listens to nothing any more


def quiet(conn: psycopg.Connection[Any], bound: float, unlisten: Any) -> None:
    """aquiet() for a blocking connection."""
    try:
        if not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE:
            execute(conn, bound, unlisten)
    except psycopg.Error:
        pass  # a broken connection listens to nothing any more
