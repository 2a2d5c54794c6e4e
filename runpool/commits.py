"""Group commit of checkpoint writes: the writes of a worker's runs that wait at the same time
share one transaction, so thousands of runs in flight cost a commit per batch, not per write.

A write is `op(conn, try_number)`, one fenced statement of runpool.checkpoints (safe to
repeat: a later try reads back what an earlier one committed). While fewer than MAX_INFLIGHT
batches are in flight a write goes at once, alone and in autocommit, exactly as it would
without this module; past that, the writes arriving meanwhile wait and go together in the next
batch. In a batch each run's write is its own statement in the shared transaction:

- a write refused without an error (a lost lease, a call id reused) is answered at once and
  leaves the transaction intact;
- a statement the database fails aborts the transaction: that write gets its error (nothing
  of it was committed, as on its own), the batch is rolled back and the others go again
  (rolled back, so nothing of theirs was committed either);
- a connection or commit that fails transiently answers every write of the batch with that
  error, and each is repeated by `again` on its try count (it may have committed).

A write given as a Statement (one statement, then what makes its answer of the returned row:
checkpoints.Statement) is sent with the batch's other statements at once, in a pipeline, and
their answers are read after: a batch costs one round trip, not one per write (W11: ~20
writes a batch). A statement the database fails in a pipeline cannot be told from the others
it aborted: the batch is rolled back and its statements go again one by one, as above.

A write whose Statement has a batch form (checkpoints.store BATCH_*: the write as one element
of a JSON array) goes with the batch's other writes of its kind in one statement: a batch of
first tries is BEGIN, a statement per kind (a message, a tool call's start, its end) and
COMMIT behind one Sync, one round trip (three before: BEGIN, the pipeline, COMMIT); their
answers are read after the commit (W11cpu: ~27 writes a batch, three statements). A batch
statement carries at most MAX_BATCH_BYTES of JSON (more goes in further statements of its
kind), and skips a run row another transaction holds: that write, unanswered, goes again in a
batch of its own (its single statement waits for the row; only it waits).

The writes of one run are serialised by the run (Run._write_lock): a run is in at most one
batch at a time, and a batch's row locks are of distinct runs, so batches never wait for each
other.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

import psycopg
from psycopg import pq
from psycopg_pool import AsyncConnectionPool

from .db import one_trip
from .deadlines import again, bounded, transient

__all__ = ["CommitGroup", "Statement"]

T = TypeVar("T")
Op = Callable[[psycopg.AsyncConnection[Any], int], Awaitable[Any]]


class Statement(Protocol):
    """A write as one statement and what makes its answer of the row it returned (the shape
    of checkpoints.Statement)."""

    @property
    def query(self) -> str: ...
    @property
    def params(self) -> dict[str, Any]: ...
    @property
    def answer(self) -> Callable[[psycopg.AsyncConnection[Any], Any], Awaitable[Any]]: ...
    @property
    def batch(self) -> str | None: ...
    @property
    def row(self) -> bytes: ...
    def batch_params(self, rows: list[bytes]) -> dict[str, Any]: ...

# Batches in flight at once before writes start to wait and group: few enough that a loaded
# worker's writes batch (W11: 2,000 runs in flight), and a pool's other users (claims,
# heartbeats, outcomes) keep connections.
MAX_INFLIGHT: Final = 4
# The most writes in one transaction: each holds its run's row (share-locked by the fence)
# until the commit, and a heartbeat skips a locked row, so a batch is kept short.
MAX_BATCH: Final = 64
# The most JSON one batch statement carries: the server parses its array whole (and each
# write's values again as its rows), so a batch of large writes (64 tool results of 1 MB:
# ~520 MB in one backend) goes as several statements, each a bounded cost; a larger write
# goes alone.
MAX_BATCH_BYTES: Final = 4 << 20


@dataclass(slots=True)
class _Write:
    op: Op
    tries: int
    deadline: float
    done: asyncio.Future[Any]
    # The write as a statement to pipeline (a first try only: a repeat reads back first).
    statement: Statement | None
    # In a batch of its own: a batch statement skipped it (its run row held by another
    # transaction), so its single statement may wait, and would hold up a batch with it.
    alone: bool = False


class _Retry(Exception):
    """A statement of the batch failed: roll it back (the failed write has its answer)."""


class CommitGroup:
    """One per worker: checkpoint writes of all its runs, committed in groups under load."""

    def __init__(self, pool: AsyncConnectionPool) -> None:
        self._pool = pool
        self._queue: deque[_Write] = deque()
        self._inflight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        # Commits made, writes they carried, of those the ones sent in a pipeline, and the
        # statements those were sent as (a batch statement carries many runs' writes).
        self.commits = 0
        self.writes = 0
        self.pipelined = 0
        self.statements = 0

    async def write(self, op: Op, seconds: float, *, what: str,
                    log: dict[str, str] | None = None,
                    statement: Statement | None = None) -> Any:
        """Run `op` in the next batch, again when it fails transiently, within `seconds`;
        `statement`, if given, is `op`'s first try as a statement (pipelined in a batch)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds

        async def once(tries: int) -> Any:
            done: asyncio.Future[Any] = loop.create_future()
            self._queue.append(_Write(op, tries, deadline, done,
                                      statement if tries == 0 else None))
            self._kick()
            return await done

        return await again(once, seconds, what=what, log=log)

    def _kick(self) -> None:
        while self._queue and self._inflight < MAX_INFLIGHT:
            batch: list[_Write] = []
            while self._queue and len(batch) < MAX_BATCH:
                w = self._queue.popleft()
                if w.done.done():  # its caller gave up (cancelled): never sent
                    continue
                if w.alone and batch:
                    self._queue.appendleft(w)
                    break
                batch.append(w)
                if w.alone:
                    break
            if not batch:
                return
            self._inflight += 1
            task = asyncio.get_running_loop().create_task(self._flush(batch))
            self._tasks.add(task)
            task.add_done_callback(self._flushed)

    def _flushed(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._inflight -= 1
        self._kick()

    async def _flush(self, batch: list[_Write]) -> None:
        loop = asyncio.get_running_loop()
        left = max(min(w.deadline for w in batch) - loop.time(), 0.001)
        try:
            if len(batch) == 1:
                await self._alone(batch[0], left)
            else:
                await self._together(batch, left)
        except BaseException as exc:
            for w in batch:
                _answer(w, exc=exc)
            if not isinstance(exc, Exception):
                raise

    async def _alone(self, w: _Write, seconds: float) -> None:
        async with bounded(self._pool, seconds) as conn:
            try:
                result = await w.op(conn, w.tries)
            except Exception as exc:
                _answer(w, exc=_retryable(exc))
                if _unprepared(exc):
                    await _discard(conn)
                return
        self.commits += 1
        self.writes += 1
        _answer(w, result=result)

    async def _together(self, batch: list[_Write], seconds: float) -> None:
        if all(w.statement is not None for w in batch):
            await self._one_trip(batch, seconds)
            return
        results: list[tuple[_Write, Any]] = []
        piped = [w for w in batch if w.statement is not None]
        rest = [w for w in batch if w.statement is None] if len(piped) > 1 else batch
        piped_ok = 0
        failed = False
        async with bounded(self._pool, seconds) as conn:
            try:
                async with conn.transaction():
                    if len(piped) > 1:
                        failed = bool(await self._pipelined(conn, piped, results))
                        if failed:
                            raise _Retry
                        piped_ok = len(results)
                    for w in rest:
                        if w.done.done():
                            continue
                        try:
                            results.append((w, await w.op(conn, w.tries)))
                        except psycopg.Error as exc:
                            if conn.info.transaction_status != pq.TransactionStatus.INERROR:
                                raise  # the connection itself: every write is answered with it
                            _answer(w, exc=_retryable(exc))
                            raise _Retry from exc
                        except Exception as exc:
                            # Refused without an error (LeaseLost, CallMismatch): nothing
                            # written.
                            _answer(w, exc=exc)
            except _Retry as exc:
                # Rolled back: every write of the batch not answered yet goes again (the
                # pipelined ones one by one), not only those of the failed statement.
                if failed or _unprepared(exc.__cause__):
                    await _discard(conn)  # its pipeline failed, or its prepared statements
                self._requeue(batch)
                return
        self.commits += 1
        self.writes += len(results)
        self.pipelined += piped_ok
        for w, result in results:
            _answer(w, result=result)
        self._requeue(batch)  # those a batch statement skipped, to go alone

    def _requeue(self, batch: list[_Write]) -> None:
        """The writes of a rolled-back batch not answered yet, first in the queue again."""
        self._queue.extendleft(reversed([w for w in batch if not w.done.done()]))

    async def _one_trip(self, batch: list[_Write], seconds: float) -> None:
        """A batch of first tries (each a Statement) in one round trip: BEGIN, its statements
        (a batch statement per kind) and COMMIT behind one Sync, then their answers read.
        If the database failed one, nothing was committed: the writes go again one by one."""
        async with bounded(self._pool, seconds) as conn:
            sent: list[tuple[list[tuple[_Write, Statement]], psycopg.AsyncCursor[Any]]] = []
            try:
                async with one_trip(conn):
                    for kind in _kinds(batch):
                        sent.append((kind, await _send(conn, kind)))
            except psycopg.Error as exc:
                refused = _refused(conn, exc)
                await _discard(conn)  # may hold unread results if not marked broken
                if not refused:
                    # Each write answered with it and repeated, reading back first: even one
                    # write's bad data seen as the connection broke must not end the others.
                    retry = _transiently(exc)
                    if retry is exc:
                        raise
                    raise retry from exc
                for w in batch:
                    w.statement = None
                self._requeue(batch)
                return
            self.commits += 1
            self.statements += len(sent)
            # Committed: the answers (reading back, or explaining, a write that wrote nothing
            # on this connection, after the commit: what they read no longer changes).
            results: list[tuple[_Write, Any]] = []
            for kind, cur in sent:
                await _answers(conn, kind, cur, results)
        self.writes += len(results)
        self.pipelined += len(results)
        for w, result in results:
            _answer(w, result=result)
        self._requeue(batch)  # those a batch statement skipped, to go alone

    async def _pipelined(self, conn: psycopg.AsyncConnection[Any], piped: list[_Write],
                         results: list[tuple[_Write, Any]]) -> list[_Write]:
        """Send the statements at once, then read their answers into `results`. If the
        database failed one (in a pipeline, the error may surface at any of them): the writes
        to go again one by one, the batch to be rolled back."""
        try:
            async with conn.pipeline():
                sent = [(kind, await _send(conn, kind)) for kind in _kinds(piped)]
                self.statements += len(sent)
                for kind, cur in sent:
                    await _answers(conn, kind, cur, results)
        except psycopg.Error:
            if conn.broken or conn.closed:
                raise  # the connection itself: every write is answered with it
            again: list[_Write] = []
            # Every one not answered yet: the error may have surfaced while sending (a
            # pipeline reads results as it goes), before some were sent.
            for w in piped:
                if not w.done.done():
                    w.statement = None
                    again.append(w)
            return again
        return []


_NONE: Final = object()


def _refused(conn: psycopg.AsyncConnection[Any], exc: psycopg.Error) -> bool:
    """Did the server refuse a statement of a batch sent with its COMMIT (nothing committed:
    its writes may go again as first tries)? Anything else may come after the COMMIT: a cut
    once surfaced as "cannot exit pipeline mode while busy" (no SQLSTATE, the connection not
    marked broken), and the committed batch, sent again, stored its messages twice."""
    return (not (conn.broken or conn.closed) and exc.sqlstate is not None
            and not transient(exc))


async def _discard(conn: psycopg.AsyncConnection[Any]) -> None:
    """Close a connection whose pipeline the database failed (the pool replaces it). Seen
    once after failed batch pipelines: InvalidSqlStatementName ("_pg3_1" does not exist),
    psycopg's prepared-statement cache out of step with the server's; not reproduced in
    isolation (psycopg 3.3.9 forgets a skipped prepare), so a failed pipeline's connection,
    rare once JSON nulls no longer fail a batch, is not trusted again."""
    await conn.close()


def _unprepared(exc: BaseException | None) -> bool:
    """A prepared statement the server does not have: the connection's state, not the
    write's."""
    return isinstance(exc, psycopg.errors.InvalidSqlStatementName)


def _retryable(exc: Exception) -> Exception:
    """A write's error as its caller gets it: _unprepared as transient, so the write is
    repeated on another connection (this one is closed)."""
    return _transiently(exc) if _unprepared(exc) else exc


def _transiently(exc: Exception) -> Exception:
    """`exc` as an error `again` repeats (an OperationalError without SQLSTATE)."""
    if transient(exc):
        return exc
    retry = psycopg.OperationalError(f"connection closed after: {exc}")
    retry.__cause__ = exc
    return retry


def _kinds(piped: list[_Write]) -> list[list[tuple[_Write, Statement]]]:
    """The writes to send, by statement: those of one batch kind together (one per run: a
    run's second write in a batch, never made by a worker, goes alone after) in batch
    statements of at most MAX_BATCH_BYTES, a write without a batch form alone."""
    kinds: dict[str, list[list[tuple[_Write, Statement]]]] = {}
    size: dict[str, int] = {}
    alone: list[list[tuple[_Write, Statement]]] = []
    runs: set[Any] = set()
    for w in piped:
        statement = w.statement
        if statement is None or w.done.done():
            continue
        if statement.batch is None or statement.params["run_id"] in runs:
            alone.append([(w, statement)])
            continue
        runs.add(statement.params["run_id"])
        chunks = kinds.setdefault(statement.batch, [[]])
        if chunks[-1] and size[statement.batch] + len(statement.row) > MAX_BATCH_BYTES:
            chunks.append([])
            size[statement.batch] = 0
        chunks[-1].append((w, statement))
        size[statement.batch] = size.get(statement.batch, 0) + len(statement.row)
    return [*(c for chunks in kinds.values() for c in chunks), *alone]


async def _send(conn: psycopg.AsyncConnection[Any], kind: list[tuple[_Write, Statement]]
                ) -> psycopg.AsyncCursor[Any]:
    """Send the writes of one kind (_kinds): as their batch statement, or one alone."""
    first = kind[0][1]
    if first.batch is None:
        return await conn.execute(first.query, first.params)
    # A batchable write alone too: its batch statement skips a run row another transaction
    # holds, where its single statement would hold up the whole batch waiting for it.
    return await conn.execute(first.batch, first.batch_params([st.row for _, st in kind]))


async def _answers(conn: psycopg.AsyncConnection[Any], kind: list[tuple[_Write, Statement]],
                   cur: psycopg.AsyncCursor[Any], results: list[tuple[_Write, Any]]) -> None:
    """The answers of the writes of one kind sent by _send, into `results`."""
    if kind[0][1].batch is None:
        w, statement = kind[0]
        await _answer_from(conn, w, statement, await cur.fetchone(), results)
        return
    # A batch returns (run id, value) of each write it made. One it did not make (its run
    # row held by another transaction and skipped, or the write refused) is left unanswered,
    # to be sent again alone (its single statement waits for the row, or explains).
    made = {key: value for key, value in await cur.fetchall()}
    for w, statement in kind:
        value = made.get(statement.params["run_id"], _NONE)
        if value is _NONE:
            w.statement = None
            w.alone = True
        else:
            await _answer_from(conn, w, statement, (value,), results)


async def _answer_from(conn: psycopg.AsyncConnection[Any], w: _Write, statement: Statement,
                       row: Any, results: list[tuple[_Write, Any]]) -> None:
    """A pipelined write's answer of the row its statement returned, into `results`."""
    try:
        results.append((w, await statement.answer(conn, row)))
    except psycopg.Error:
        raise
    except Exception as exc:
        # Refused without an error (LeaseLost, CallMismatch): nothing written.
        _answer(w, exc=exc)


def _answer(w: _Write, *, result: Any = None, exc: BaseException | None = None) -> None:
    if w.done.done():
        return
    if exc is not None:
        w.done.set_exception(exc)
    else:
        w.done.set_result(result)
