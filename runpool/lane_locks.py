"""What a group commit's lane does about locks and failures (runpool.commits): its
transactions wait at most LOCK_TIMEOUT for a lock, and a failed write's error is told apart as
the database's refusal, a held row (polled for), or a connection's failure (repeated)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final

import psycopg

from .db import BEGIN, COMMIT, ROLLBACK
from .deadlines import transient
from .errors import DatabaseTimeout

__all__ = ["FIRST_WAIT", "LOCK_TIMEOUT", "POLL_WAIT", "discard", "held_error", "locked",
           "locking_briefly", "refused", "retryable", "still_held", "transiently",
           "unprepared"]

# The longest a write waits for a lock other than its run row's (whose holder it never waits
# for: BEGIN_WRITES): in a batch lane, LOCK_TIMEOUT; on its first try in a waiting lane,
# FIRST_WAIT, long enough for another transaction of the worker's on a shared row (a tenant's
# usage rollup rows, which the worker's own batches hold for moments: usage writes cut at 2 ms
# there polled for seconds); when it polls, POLL_WAIT, so that a lock a tenant can hold (a
# serial key a spawn takes) costs a waiting lane little (polls waiting 100 ms each, 40 such
# writes kept both waiting lanes busy: an attack).
LOCK_TIMEOUT: Final = "20ms"
FIRST_WAIT: Final = "50ms"
POLL_WAIT: Final = "2ms"
# LOCK_TIMEOUT for the rest of the current transaction (not the session: safe behind a
# transaction-mode pooler), and back to the session's own before its COMMIT: a notifying
# commit waits for the NOTIFY queue's lock (every few ms under load), which a lock timeout
# would fail. BEGIN_WRITES also share-locks the rows of the given runs that no other
# transaction holds (skipping, not waiting for, the others) and says which of them exist.
BEGIN_WRITES: Final = """
SELECT set_config('lock_timeout', %(timeout)s, true),
       ARRAY(SELECT id FROM runpool.runs WHERE id = ANY(%(run_ids)s)),
       ARRAY(SELECT id FROM runpool.runs WHERE id = ANY(%(run_ids)s) ORDER BY id
             FOR SHARE SKIP LOCKED)
"""
RESET_LOCK_TIMEOUT: Final = "SET LOCAL lock_timeout TO DEFAULT"


def refused(conn: psycopg.AsyncConnection[Any], exc: psycopg.Error) -> bool:
    """Did the server refuse a statement of a batch sent with its COMMIT (nothing committed:
    its writes may go again as first tries)? Anything else may come after the COMMIT: a cut
    once surfaced as "cannot exit pipeline mode while busy" (no SQLSTATE, the connection not
    marked broken), and the committed batch, sent again, stored its messages twice."""
    return (not (conn.broken or conn.closed) and exc.sqlstate is not None
            and not transient(exc))


async def discard(conn: psycopg.AsyncConnection[Any]) -> None:
    """Close a connection whose pipeline the database failed (the pool replaces it). Seen
    once after failed batch pipelines: InvalidSqlStatementName ("_pg3_1" does not exist),
    psycopg's prepared-statement cache out of step with the server's; not reproduced in
    isolation (psycopg 3.3.9 forgets a skipped prepare), so a failed pipeline's connection,
    rare once JSON nulls no longer fail a batch, is not trusted again."""
    await conn.close()


def unprepared(exc: BaseException | None) -> bool:
    """A prepared statement the server does not have: the connection's state, not the
    write's."""
    return isinstance(exc, psycopg.errors.InvalidSqlStatementName)


@asynccontextmanager
async def locking_briefly(conn: psycopg.AsyncConnection[Any], run_ids: list[uuid.UUID],
                          lock_wait: str) -> AsyncIterator[set[uuid.UUID]]:
    """A transaction whose statements wait at most `lock_wait` for a lock (its COMMIT as long
    as it must: see BEGIN_WRITES), with the rows of `run_ids` share-locked first, never
    waited for: it yields those another transaction holds (their writes must not go on here).
    On an error it is rolled back keeping the session's prepared statements: psycopg answers
    a ROLLBACK it sees with DEALLOCATE ALL, and the worker's trips would prepare anew."""
    try:
        # Two round trips besides the body's: BEGIN with BEGIN_WRITES, the reset with COMMIT.
        async with conn.pipeline():
            await conn.execute(BEGIN)
            cur = await conn.execute(BEGIN_WRITES, {"timeout": lock_wait, "run_ids": run_ids})
            row = await cur.fetchone()
        yield _held(row)
        async with conn.pipeline():
            await conn.execute(RESET_LOCK_TIMEOUT)
            await conn.execute(COMMIT)
    except BaseException:
        threshold = conn.prepare_threshold
        conn.prepare_threshold = None  # psycopg then neither counts nor checks the ROLLBACK
        try:
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                await conn.execute(ROLLBACK)
        except psycopg.Error:
            await conn.close()  # the pool replaces it
        finally:
            conn.prepare_threshold = threshold
        raise


def locked(exc: BaseException | None) -> bool:
    """A row lock still held at LOCK_TIMEOUT (or a NOWAIT refused): another transaction's,
    not the write's."""
    return isinstance(exc, psycopg.errors.LockNotAvailable)


async def still_held(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID) -> bool:
    """Is the run row held by another transaction, while the run exists? A held-row poll's
    question: BEGIN_WRITES alone, in autocommit (its lock ends with it; it waits for nothing)."""
    cur = await conn.execute(BEGIN_WRITES, {"timeout": POLL_WAIT, "run_ids": [run_id]})
    return bool(_held(await cur.fetchone()))


def _held(row: Any) -> set[uuid.UUID]:
    """The runs of a BEGIN_WRITES row that exist but another transaction holds."""
    existing, free = (row[1], row[2]) if row else ([], [])
    return set(existing) - set(free)


def held_error(what: str, cause: BaseException) -> DatabaseTimeout:
    """A write's answer while a lock it needs stays held (`what` says which): a timeout its
    caller repeats (polls), and raises at the write's deadline."""
    error = DatabaseTimeout(f"{what} is held by another transaction (an open transaction of"
                            f" the API on this run?): {cause}")
    error.__cause__ = cause
    return error


def retryable(exc: Exception) -> Exception:
    """A write's error as its caller gets it: unprepared as transient, so the write is
    repeated on another connection (this one is closed); locked as a timeout, which its
    caller repeats after a pause (polling for the row, out of the lanes) and raises at the
    write's deadline."""
    if locked(exc):
        return held_error("a lock the run's write needs", exc)
    return transiently(exc) if unprepared(exc) else exc


def transiently(exc: Exception) -> Exception:
    """`exc` as an error `again` repeats (an OperationalError without SQLSTATE)."""
    if transient(exc):
        return exc
    retry = psycopg.OperationalError(f"connection closed after: {exc}")
    retry.__cause__ = exc
    return retry
