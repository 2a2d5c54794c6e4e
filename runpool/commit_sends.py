"""How a batch of checkpoint writes goes (runpool.commits decides which writes go together):
alone, as one batch statement in autocommit, as batch statements in one trip, or as a
transaction of pipelined statements; and what a failure in a batch does. In a batch each run's
write is its own statement in the shared transaction:

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
COMMIT behind one Sync, one round trip (three before: BEGIN, the pipeline, COMMIT), or on a
worker session one simple query of the statements it prepared (batch_sends.send_all); their
answers are read after the commit (W11cpu: ~27 writes a batch, three statements). A batch
statement carries at most MAX_BATCH_BYTES of JSON (more goes in further statements of its
kind), and skips a run row another transaction holds: that write, unanswered, goes again in
a later batch after a pause, and alone in a waiting lane (runpool.commits) if its row stays held.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from typing import Any

import psycopg
from psycopg import pq
from psycopg_pool import AsyncConnectionPool

from .batch_sends import (
    MAX_SKIPS,
    SKIP_PAUSE,
    Statement,
    Write,
    answer,
    answers,
    fits_trip,
    kinds,
    send,
    send_all,
)
from .deadlines import bounded
from .doorbells import Doorbells
from .lane_locks import (
    FIRST_WAIT,
    LOCK_TIMEOUT,
    POLL_WAIT,
    discard,
    held_error,
    locked,
    locking_briefly,
    refused,
    retryable,
    still_held,
    transiently,
    unprepared,
)
from .pooled import Route
from .trips import FunctionsUnusable, Rows, Via

__all__ = ["BatchSends", "batchable"]


class _Held(Exception):
    """The write's run row is held by another transaction: it polls."""


class _Paused(Exception):
    """The write's run row is held: it goes again after a pause (see _pause)."""


class _Retry(Exception):
    """A statement of the batch failed: roll it back (the failed write has its answer)."""


class BatchSends(ABC):
    """The ways a batch goes, with what they counted; the group's lanes requeue what a batch
    left unanswered (_requeue)."""

    def __init__(self, pool: AsyncConnectionPool, *, via: Via | Route,
                 doorbells: Doorbells | None) -> None:
        self._pool = pool
        self._doorbells = doorbells if doorbells is not None else Doorbells(pool)
        self._route = via if isinstance(via, Route) else Route(via)
        # Commits made, writes they carried, of those the ones sent in a pipeline, and the
        # statements those were sent as (a batch statement carries many runs' writes).
        self.commits = 0
        self.writes = 0
        self.pipelined = 0
        self.statements = 0
        # Batches rolled back and sent again (a statement failed, or met a held row).
        self.rollbacks = 0

    @abstractmethod
    def _requeue(self, batch: list[Write]) -> None:
        """The writes of a batch not answered yet go again (runpool.commits.CommitGroup)."""

    async def _single(self, w: Write, seconds: float, ring: bool) -> None:
        """A first try alone: its batch statement (one row) on its own, in autocommit: one
        statement and one round trip, as the write's single statement would be, but one that
        skips its run row if another transaction holds it (the write then goes again after
        a pause, see MAX_SKIPS) instead of waiting for it in a batch lane."""
        (kind,) = kinds([w]) or [[]]
        if not kind:
            return  # its caller gave up meanwhile
        results: list[tuple[Write, Any]] = []
        async with bounded(self._pool, seconds) as conn:
            try:
                # Not as a trip (send_all): for one statement psycopg's prepared one costs
                # less (W7, a run's lone writes: p50 2.6 -> 3.0 ms, 18 % more client CPU).
                cur = await send(conn, kind, ring=ring)
                self.statements += 1
                await answers(conn, kind, cur, results)
            except Exception as exc:
                answer(w, exc=retryable(exc))
                if unprepared(exc):
                    await discard(conn)
                return
        if results:
            self.commits += 1
            self.writes += 1
            self._ring_after(results, ring)
            answer(w, result=results[0][1])
        self._requeue([w])  # skipped: again after a pause, or alone

    async def _alone(self, w: Write, seconds: float, waiting: bool) -> None:
        """A write alone in a transaction of its own (locking_briefly): its run row held, or
        another lock held past the lane's timeout, answers it with an error its caller
        repeats (polling); in a batch lane, a held run row first pauses it (MAX_SKIPS)."""
        # See lane_locks.LOCK_TIMEOUT.
        lock_wait = LOCK_TIMEOUT if not waiting else POLL_WAIT if w.held else FIRST_WAIT
        try:
            async with bounded(self._pool, seconds) as conn:
                try:
                    # A poll of a held row asks first, in one statement that waits for nothing.
                    if w.held and w.run_id is not None and await still_held(conn, w.run_id):
                        raise _Held
                    async with locking_briefly(conn, _runs([w]), lock_wait) as held:
                        if held and not waiting and _pause(w):
                            raise _Paused
                        if held:
                            raise _Held
                        result = await w.op(conn, w.tries)
                except _Paused:
                    self._requeue([w])
                    return
                except _Held:
                    answer(w, exc=held_error(f"run {w.run_id}'s row",
                                             psycopg.errors.LockNotAvailable("the row is locked")))
                    return
                except Exception as exc:
                    if unprepared(exc):
                        await discard(conn)
                    raise
        except Exception as exc:  # past `bounded`: a deadline that cut the write is a timeout
            answer(w, exc=retryable(exc))
            return
        self.commits += 1
        self.writes += 1
        answer(w, result=result)

    async def _together(self, batch: list[Write], seconds: float, ring: bool) -> None:
        if all(batchable(w.statement) for w in batch):  # none waits: see _one_trip
            await self._one_trip(batch, seconds, ring)
            return
        results: list[tuple[Write, Any]] = []
        piped = [w for w in batch if w.statement is not None]
        rest = [w for w in batch if w.statement is None] if len(piped) > 1 else batch
        piped_ok = 0
        failed = False
        async with bounded(self._pool, seconds) as conn:
            try:
                async with locking_briefly(conn, _runs(rest), LOCK_TIMEOUT) as held:
                    for w in rest:
                        if w.run_id in held and not _pause(w):
                            w.alone = True  # its run row still held: polls alone, not here
                    if len(piped) > 1:
                        failed = bool(await self._pipelined(conn, piped, results, ring))
                        if failed:
                            raise _Retry
                        piped_ok = len(results)
                    for w in rest:
                        if w.done.done() or w.alone or w.pause:
                            continue
                        try:
                            results.append((w, await w.op(conn, w.tries)))
                        except psycopg.Error as exc:
                            if conn.info.transaction_status != pq.TransactionStatus.INERROR:
                                raise  # the connection itself: every write is answered with it
                            if locked(exc):
                                # A held row: this write and the batch's others without a
                                # statement form (those are what can meet one) go alone from
                                # now on, so a tenant's several held writes cost one round.
                                for v in rest:
                                    v.alone = True
                            else:
                                answer(w, exc=retryable(exc))
                            raise _Retry from exc
                        except Exception as exc:
                            # Refused without an error (LeaseLost, CallMismatch), or with the
                            # database's error translated by the op (a wait's InvalidInput):
                            # then the transaction is aborted, and the others go again.
                            answer(w, exc=exc)
                            if conn.info.transaction_status == pq.TransactionStatus.INERROR:
                                raise _Retry from exc
            except _Retry as exc:
                # Rolled back: every write of the batch not answered yet goes again (the
                # pipelined ones one by one), not only those of the failed statement.
                self.rollbacks += 1
                if failed or unprepared(exc.__cause__):
                    await discard(conn)  # its pipeline failed, or its prepared statements
                self._requeue(batch)
                return
        self.commits += 1
        self.writes += len(results)
        self.pipelined += piped_ok
        self._ring_after(results, ring)
        for w, result in results:
            answer(w, result=result)
        self._requeue(batch)  # those a batch statement skipped: again after a pause, or alone

    def _ring_after(self, results: list[tuple[Write, Any]], ring: bool) -> None:
        """Committed: the doorbells of the runs whose batch statements were told not to ring."""
        if not ring:
            self._doorbells.ring(_rung(results))

    async def _one_trip(self, batch: list[Write], seconds: float, ring: bool) -> None:
        """A batch of first tries (each a Statement) in one round trip and one transaction (a
        batch statement per kind, batch_sends.send_all), then their answers read.
        If the database failed one, nothing was committed: the writes go again one by one."""
        async with bounded(self._pool, seconds) as conn:
            sent: list[tuple[list[tuple[Write, Statement]], Rows]] = []
            try:
                # No LOCK_TIMEOUT: a batch statement skips a held run row, and the rows it
                # writes besides (a run's tool calls, messages, event counter) are locked
                # only by transactions holding the run row.
                batch_kinds = kinds(batch)
                via = self._route.via if fits_trip(batch) else "pipeline"
                sent = list(zip(batch_kinds, await send_all(conn, batch_kinds, via=via,
                                                            ring=ring), strict=True))
            except FunctionsUnusable as exc:
                # Rolled back whole: the writes go again, first tries still, the pipeline's way.
                self.rollbacks += 1
                self._route.fall_back(exc)
                self._requeue(batch)
                return
            except psycopg.Error as exc:
                was_refused = refused(conn, exc)
                await discard(conn)  # may hold unread results if not marked broken
                if not was_refused:
                    # Each write answered with it and repeated, reading back first: even one
                    # write's bad data seen as the connection broke must not end the others.
                    retry = transiently(exc)
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
            results: list[tuple[Write, Any]] = []
            for kind, cur in sent:
                await answers(conn, kind, cur, results)
        self.writes += len(results)
        self.pipelined += len(results)
        self._ring_after(results, ring)
        for w, result in results:
            answer(w, result=result)
        self._requeue(batch)  # those a batch statement skipped: again after a pause, or alone

    async def _pipelined(self, conn: psycopg.AsyncConnection[Any], piped: list[Write],
                         results: list[tuple[Write, Any]], ring: bool) -> list[Write]:
        """Send the statements at once, then read their answers into `results`. If the
        database failed one (in a pipeline, the error may surface at any of them): the writes
        to go again one by one, the batch to be rolled back."""
        try:
            async with conn.pipeline():
                sent = [(kind, await send(conn, kind, ring=ring)) for kind in kinds(piped)]
                self.statements += len(sent)
                for kind, cur in sent:
                    await answers(conn, kind, cur, results)
        except psycopg.Error:
            if conn.broken or conn.closed:
                raise  # the connection itself: every write is answered with it
            again: list[Write] = []
            # Every one not answered yet: the error may have surfaced while sending (a
            # pipeline reads results as it goes), before some were sent.
            for w in piped:
                if not w.done.done():
                    w.statement = None
                    again.append(w)
            return again
        return []


def _pause(w: Write) -> bool:
    """A write found its run row held in a batch lane: pause it before it goes again in a
    batch (True), as a skipped batch statement's write does (a heartbeat holds rows for
    moments), or, past MAX_SKIPS, not (it goes alone and polls)."""
    w.skips += 1
    if w.skips > MAX_SKIPS:
        return False
    w.pause = SKIP_PAUSE * 2 ** (w.skips - 1)
    return True


def _runs(writes: list[Write]) -> list[uuid.UUID]:
    """The runs whose rows the writes lock (those that said: CommitGroup.write's run_id)."""
    return [w.run_id for w in writes if w.run_id is not None and not w.done.done()]


def batchable(statement: Statement | None) -> bool:
    return statement is not None and statement.batch is not None


def _rung(results: list[tuple[Write, Any]]) -> list[uuid.UUID]:
    """The runs whose writes went in batch statements (sent told not to ring: see _flush)."""
    return [w.statement.params["run_id"] for w, _ in results
            if w.statement is not None and w.statement.batch is not None]
