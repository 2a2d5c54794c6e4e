"""Hostile review of runpool.trips / runpool.warmup (d342fd9..2efc51c): defects found by
experiment. Each test failed on 2efc51c; its docstring says whether 1e93f8e (the code before
trips) had the defect too. (Also found: a trip's literals show the runs' results in
pg_stat_activity and, when a batch fails, in the server log's STATEMENT line; README,
Performance, says what an operator can do.)"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg

import runpool
from runpool.claiming import claim
from runpool.db import aconnect
from runpool.outcomes import OutcomeWriter, from_result
from runpool.pools import open_pool
from runpool.warmup import plan_ahead

from .helpers import run_row


def _sql_ascii(conn: psycopg.Connection) -> None:
    """The database's sessions speak client_encoding SQL_ASCII (what a SQL_ASCII database's
    clients get by default, or an ALTER DATABASE/ROLE ... SET client_encoding)."""
    db = conn.info.dbname
    conn.execute(f'ALTER DATABASE "{db}" SET client_encoding = \'SQL_ASCII\'')


def test_sql_ascii_session__non_ascii_result_is_recorded_not_rejected(
        conn: psycopg.Connection, dsn: str) -> None:
    """With client_encoding SQL_ASCII, psycopg sends str parameters as UTF-8 (its dumpers
    treat 'ascii' as utf-8), so before trips (1e93f8e, and 0979afc) a result {"text": "café"}
    was stored. A Trip encodes its literals with conn.info.encoding ('ascii'): the batch raises
    UnicodeEncodeError, the writer splits it and records the run FAILED (outcome_rejected):
    every non-ASCII result (or exception message: retries too) of a worker on such a database
    is lost. Defect new in 2efc51c. Since session 10 runpool's own connections say
    client_encoding UTF8 at connect, which wins over the database's setting."""
    _sql_ascii(conn)
    run_id = runpool.enqueue(conn, "acme", "noop")

    async def main() -> Any:
        pool = await open_pool(dsn, size=1, name="attack5-ascii")
        try:
            async with pool.connection() as c:
                assert c.info.encoding == "utf-8"
                (run,) = await claim(c, limit=1, via="prepared", worker_id=uuid.uuid4(),
                                     lease_seconds=30, handlers=["noop"])
            writer = OutcomeWriter(pool, worker_id=uuid.uuid4(), via="prepared")
            task = asyncio.create_task(writer.run())
            try:
                return await asyncio.wait_for(writer.submit(from_result(
                    run.id, run.attempt, {"text": "café ☃"}, max_bytes=1 << 20)), 30)
            finally:
                task.cancel()
        finally:
            await pool.close()

    asyncio.run(main())
    row = run_row(conn, run_id)
    assert (row["status"], row["result"]) == ("succeeded", {"text": "café ☃"}), row


def test_sql_ascii_session__non_ascii_handler_can_claim(
        conn: psycopg.Connection, dsn: str) -> None:
    """A handler named 'résumé' on a SQL_ASCII-client database: every pinned claim raises
    UnicodeEncodeError building its literals (the claim never reaches the server: the worker
    can claim nothing, ever). 1e93f8e claimed fine (psycopg dumps str as UTF-8). New in
    2efc51c."""
    _sql_ascii(conn)
    run_id = runpool.enqueue(conn, "acme", "résumé")

    async def main() -> list[Any]:
        async with await aconnect(dsn, autocommit=True) as c:
            await c.execute("SELECT set_config('default_transaction_isolation',"
                            " 'read committed', false)")
            return await claim(c, limit=1, via="prepared", worker_id=uuid.uuid4(),
                               lease_seconds=30, handlers=["résumé"])

    claimed = asyncio.run(main())
    assert [r.id for r in claimed] == [run_id]


def test_sql_ascii_session__plan_ahead_error_is_only_logged(
        conn: psycopg.Connection, dsn: str) -> None:
    """plan_ahead promises "errors are logged and ignored unless the connection broke", but it
    catches psycopg.Error only: the UnicodeEncodeError of a non-ASCII handler name on a
    SQL_ASCII-client session escapes it, fails the pool's configure callback on every
    connection, and the worker's open_pool ends in PoolTimeout after 30 s ("pool
    initialization incomplete") instead of starting (experiment: a worker with handler
    'résumé'). 1e93f8e's plan_ahead (psycopg execute, UTF-8) ran fine. New in 2efc51c."""
    _sql_ascii(conn)

    async def main() -> None:
        async with await aconnect(dsn, autocommit=True) as c:
            await plan_ahead(c, worker_id=uuid.uuid4(), lease_seconds=30,
                             handlers=["noop", "résumé"])

    asyncio.run(main())  # must not raise: planning ahead is only an optimisation
