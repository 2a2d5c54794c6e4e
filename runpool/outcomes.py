"""What a finished attempt amounts to (an Outcome), and the writer that records outcomes in
batches: one statement for every outcome ready at the time."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import traceback
import uuid
from dataclasses import dataclass, replace
from typing import Any, Final, Literal, Protocol

from psycopg_pool import AsyncConnectionPool

from . import faults
from .claiming import ClaimedRun, PendingClaim, Statements, read_claimed
from .codec import dumps, loads
from .db import NO_JIT, one_trip
from .deadlines import bounded, transient
from .errors import (
    BudgetExceeded,
    Fail,
    InvalidInput,
    ToolOutcomeUnknown,
    WaitTimeout,
    describe,
    type_name,
)
from .pooled import Route
from .queries import QUERIES
from .trips import FunctionsUnusable, Rows, Trip, Via

__all__ = ["Outcome", "OutcomeWriter", "Refill", "error_doc", "finish_params", "from_exception",
           "from_result", "retry_after"]

logger = logging.getLogger("runpool.outcomes")

# Is the database there at all? (Asked after a batch failed transiently eight times.)
PROBE: Final = "SELECT 1"
# A batch's answers: each outcome's run's new status ('busy': its row was held), by (run id,
# attempt); an outcome without one was fenced (its attempt no longer held the run).
Statuses = dict[tuple[uuid.UUID, int], str]
# How soon an outcome whose row someone else held (finish_runs answered 'busy') is written
# again: after 5 ms, doubling to 0.2 s. The usual holder is another worker's claim, which keeps
# the lock of a run it passed over (taken since its snapshot) for the few milliseconds of its
# one round trip; a caller's open transaction usually ends within milliseconds too. A fixed
# 0.2 s held the slot 40 times longer than needed: W1 2 x 10, alternated, 3,058/3,532 runs/s
# with 0.2 s against 3,994/4,258 with 0.01 s (python -m runpool bench --workload W1).
BUSY_RETRY_FIRST: Final = 0.005
BUSY_RETRY_MAX: Final = 0.2

OutcomeKind = Literal["succeeded", "failed", "cancelled", "retry"]


@dataclass(frozen=True, slots=True)
class Outcome:
    run_id: uuid.UUID
    attempt: int
    kind: OutcomeKind
    # Pre-serialised JSON (bytes), so a value that cannot be stored never reaches a batch.
    result: bytes | None = None
    error: bytes | None = None
    retry_delay: float = 0.0

    @property
    def reason(self) -> str | None:
        return str(loads(self.error).get("reason")) if self.error else None


def error_doc(reason: str, message: str, **more: Any) -> bytes:
    """An error document that is always storable, whatever the exception text holds."""
    doc = {"reason": reason, "message": describe(message)}
    doc.update({k: describe(v) for k, v in more.items()})
    return dumps(doc)


def failed(run_id: uuid.UUID, attempt: int, reason: str, message: str, **more: Any) -> Outcome:
    return Outcome(run_id, attempt, "failed", error=error_doc(reason, message, **more))


def from_result(run_id: uuid.UUID, attempt: int, result: Any, *, max_bytes: int) -> Outcome:
    """A handler's return value: stored as the run's result if it is storable JSON of at most
    `max_bytes`, else a failure that says why (checked here, so a result that cannot be
    written never reaches a batch where it would fail everyone's outcomes)."""
    try:
        data = dumps(result)
    except InvalidInput as exc:
        return failed(run_id, attempt, "result_not_serializable",
                      f"the handler's result cannot be stored: {exc}")
    if len(data) > max_bytes:
        return failed(run_id, attempt, "result_too_large",
                      f"the handler's result is {len(data)} bytes, over the limit of"
                      f" {max_bytes} bytes (RUNPOOL_MAX_RESULT_BYTES)")
    return Outcome(run_id, attempt, "succeeded", result=data)


def from_exception(run_id: uuid.UUID, attempt: int, exc: BaseException, *, attempts_used: int,
                   backoff: float, no_retry: tuple[type[BaseException], ...]) -> Outcome:
    """A handler's exception: fail now when retrying cannot help, else retry after an
    exponential backoff with jitter (capped at an hour)."""
    if isinstance(exc, Fail):
        return failed(run_id, attempt, "failed", _read(exc, "reason"))
    if isinstance(exc, ToolOutcomeUnknown):
        # Retrying would meet the same unknown outcome: the handler had to handle it.
        return failed(run_id, attempt, "tool_outcome_unknown", describe(exc))
    if isinstance(exc, BudgetExceeded):
        # More attempts would spend more of what is already spent.
        return failed(run_id, attempt, "budget_exceeded", describe(exc),
                      limit=_read(exc, "limit"))
    if isinstance(exc, InvalidInput):
        # Bad data from the handler fails the same way on every attempt: no retry storm.
        return failed(run_id, attempt, "invalid_input", describe(exc))
    if isinstance(exc, WaitTimeout):
        # Its wait stays timed out in every attempt (the wait's answer is kept).
        return failed(run_id, attempt, "wait_timeout", describe(exc))
    if no_retry and isinstance(exc, no_retry):
        return failed(run_id, attempt, "non_retryable", describe(exc), type=type_name(exc))
    message = describe(exc)
    return retry_after(run_id, attempt, attempts_used, backoff, error_doc(
        "exception", message, type=type_name(exc), traceback=_traceback(exc, message)))


def _read(exc: BaseException, name: str) -> str:
    """An attribute of the handler's exception as text, or a placeholder if reading it raises
    (a subclass's property): a Fail still fails its run."""
    try:
        return describe(getattr(exc, name))
    except BaseException:
        return f"<{name} cannot be read>"


def _traceback(exc: BaseException, message: str) -> str:
    """The exception's last frames and its line, from `message` (its text, taken once: a
    `__str__` may be slow, huge or hostile, and traceback.format_exception would call it
    again)."""
    try:
        frames = "".join(traceback.format_tb(exc.__traceback__, limit=-4))
    except BaseException:  # a frame's hostile source or locals: the line alone
        frames = ""
    return f"{frames}{type_name(exc)}: {message}\n"


def retry_after(run_id: uuid.UUID, attempt: int, attempts_used: int, backoff: float,
                error: bytes) -> Outcome:
    """A failed attempt retried after an exponential backoff with jitter (capped at an hour);
    the run fails instead once its attempts are used up (finish_runs decides)."""
    delay = backoff * 2 ** max(attempts_used - 1, 0) * random.uniform(0.75, 1.25)
    return Outcome(run_id, attempt, "retry", retry_delay=min(delay, 3600.0), error=error)


def finish_params(outcomes: list[Outcome]) -> dict[str, str]:
    """finish_runs' six arrays as array literals, the text the server parses as the statement's
    casts say (a str parameter goes untyped). psycopg's list dumper looked up and called a
    dumper per element: ~220 us per batch of 10 on this machine, these ~15 us (micro-benchmark
    of cursor._convert_query). Every element is a uuid, a number, an outcome kind or quoted
    JSON text: nothing else needs quoting."""
    return {
        "ids": "{" + ",".join([str(o.run_id) for o in outcomes]) + "}",
        "attempts": "{" + ",".join([str(o.attempt) for o in outcomes]) + "}",
        "outcomes": "{" + ",".join([o.kind for o in outcomes]) + "}",
        "results": "{" + ",".join([_element(o.result) for o in outcomes]) + "}",
        "errors": "{" + ",".join([_element(o.error) for o in outcomes]) + "}",
        "delays": "{" + ",".join([repr(o.retry_delay) for o in outcomes]) + "}",
    }


def _element(data: bytes | None) -> str:
    """JSON text as an element of an array literal: quoted, its quotes and backslashes
    escaped; NULL for none."""
    if data is None:
        return "NULL"
    return '"' + data.decode().replace("\\", "\\\\").replace('"', '\\"') + '"'


class Unreachable(Exception):
    """The database stayed unreachable while writing outcomes."""


class Refill(Protocol):
    """Claims replacements for the slots a batch of outcomes frees, in the same transaction."""

    def capacity(self, freed: int) -> int:
        """The runs a batch freeing `freed` slots may claim (at most `freed`)."""

    async def statements(self, conn: Statements, limit: int) -> PendingClaim:
        """Queue the claim's statements on `conn` (a pipelined transaction's connection, or a
        worker session's trip), unread."""

    def started(self, claimed: list[ClaimedRun], sent: float) -> None:
        """Told after every refill's commit, even one that claimed nothing (`sent`: when the
        batch's transaction was asked for)."""


@dataclass(frozen=True, slots=True)
class Pending:
    """An outcome waiting in the writer's queue, and the future its submitter awaits."""

    outcome: Outcome
    serial: bool
    done: asyncio.Future[str | None]
    busy: int = 0  # how many times finish_runs answered 'busy' for it


class OutcomeWriter:
    """Batches outcomes from all slots of a worker.

    Batches form naturally: while one statement is in flight, the outcomes finished meanwhile
    wait in the queue and all go in the next one. With a `refill`, the same transaction also
    claims runs for the slots the batch frees: one commit per cycle instead of two.
    """

    def __init__(self, pool: AsyncConnectionPool, *, worker_id: uuid.UUID,
                 refill: Refill | None = None, via: Via | Route = "pipeline") -> None:
        self._pool = pool
        # How a batch's statements travel (runpool.trips.Via; claiming.claim says what each
        # needs): with "prepared" or "functions", a batch is one simple query. A worker's
        # Route, shared with its claims, may fall back from "functions" to "pipeline".
        self._route = via if isinstance(via, Route) else Route(via)
        self._worker_id = worker_id
        self._refill = refill
        self._queue: asyncio.Queue[Pending] = asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def submit(self, outcome: Outcome, *, serial: bool = False) -> str | None:
        """Record an outcome (`serial`: of a run with a serial key); returns the run's new
        status, or None if the attempt no longer held its lease (the write was fenced)."""
        loop = self._loop
        if loop is None:  # (asked once: asyncio.get_running_loop() costs a getpid on 3.11)
            loop = self._loop = asyncio.get_running_loop()
        done: asyncio.Future[str | None] = loop.create_future()
        await self._queue.put(Pending(outcome, serial, done))
        return await done

    async def run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            # One loop turn first: the runs a refill started together end together, but the
            # writer wakes at the first one's outcome; the others, queued a turn later, would
            # go in a trip of their own (W1 2 x 10: a third of the trips split 9 + 1 or 8 + 2).
            await asyncio.sleep(0)
            while not self._queue.empty() and len(batch) < 500:
                batch.append(self._queue.get_nowait())
            try:
                await self._write(batch, refill=True)
            except Exception:
                # A bug of ours must not stop every run of this worker from being recorded.
                logger.exception("writing %d outcomes failed", len(batch), extra={
                    "action": "outcome_writer_error", "worker_id": str(self._worker_id)})
                self._settle(batch, {})

    async def _write(self, batch: list[Pending], *, refill: bool) -> None:
        """Record a batch; one the database refuses is split until the refused outcome is
        alone, and that one is recorded as the run's failure (the others as they are)."""
        try:
            statuses = await self._commit(batch, refill)
        except Unreachable:
            # The leases expire and the runs are reclaimed elsewhere: the safe outcome.
            self._settle(batch, {})
        except Exception as exc:
            if len(batch) > 1:
                half = len(batch) // 2
                await self._write(batch[:half], refill=False)
                await self._write(batch[half:], refill=False)
            else:
                await self._reject(batch[0], exc)
        else:
            self._settle(batch, statuses)

    async def _reject(self, pending: Pending, exc: Exception) -> None:
        """The database refused this outcome: record the run failed with an error document
        that can always be stored (retrying the same outcome would be refused again)."""
        o = pending.outcome
        logger.error("the database refused the outcome of run %s: %r", o.run_id, exc, extra={
            "action": "outcome_rejected", "run_id": str(o.run_id),
            "worker_id": str(self._worker_id)})
        # The server's own words (not str(exc): from a hot function behind a pooler, that
        # carries the whole statement as its CONTEXT).
        said = getattr(getattr(exc, "diag", None), "message_primary", None) or str(exc)
        substitute = failed(o.run_id, o.attempt, "outcome_rejected",
                            f"the database refused this run's {o.kind} outcome: {said}",
                            sqlstate=getattr(exc, "sqlstate", None) or "")
        replaced = Pending(substitute, pending.serial, pending.done)
        try:
            statuses = await self._commit([replaced], refill=False)
        except Exception as again:
            logger.error("recording run %s as failed was refused too: %r", o.run_id, again,
                         extra={"action": "outcome_not_recorded", "run_id": str(o.run_id),
                                "worker_id": str(self._worker_id)})
            statuses = {}
        self._settle([pending], statuses)

    def _settle(self, batch: list[Pending], statuses: Statuses) -> None:
        for pending in batch:
            status = statuses.get((pending.outcome.run_id, pending.outcome.attempt))
            if status == "busy":
                # Its row is held by someone else (finish_runs skips it): write it again soon.
                delay = min(BUSY_RETRY_FIRST * 2 ** pending.busy, BUSY_RETRY_MAX)
                asyncio.get_running_loop().call_later(
                    delay, self._queue.put_nowait, replace(pending, busy=pending.busy + 1))
            elif not pending.done.done():
                pending.done.set_result(status)

    async def _commit(self, batch: list[Pending], refill: bool) -> Statuses:
        """Write a batch, trying again while the failure is transient; the runs' new statuses.
        Raises Unreachable when the database stayed away, or the refusal of the batch."""
        delay = 0.05
        last: Exception | None = None
        for attempt in range(8):
            # Refill only on the first try: a failing claim must not hold outcomes back. An
            # outcome frees its slot for a refill once, on its first write: one answered 'busy'
            # keeps its slot (and its live lease) and is written again later, and counting it
            # again then would let the worker hold runs beyond twice its concurrency (the
            # quota margin's premise, migration 0025; an attack held 90 leases at 5 slots).
            # Nor does one whose submitter was cancelled while it waited here (a lease loss
            # cancels the run's task whatever it is doing): its slot left the worker's table
            # then, which already counts it free.
            freed = sum(1 for p in batch if not p.busy and not p.done.cancelled())
            room = self._refill.capacity(freed) if self._refill and refill and not attempt \
                else 0
            try:
                return await self._statement(batch, room)
            except FunctionsUnusable as exc:
                # Rolled back whole: the next try goes the pipeline's way (without a refill).
                self._route.fall_back(exc)
                last = exc
                continue
            except Exception as exc:
                if not transient(exc):
                    if room > 0:
                        # The refill's claim may be what the database refused: once more
                        # without it (the next try's room is 0) before an outcome is blamed.
                        last = exc
                        continue
                    raise
                logger.warning(
                    "writing %d outcomes failed (try %d): %r", len(batch), attempt + 1, exc,
                    extra={"action": "outcome_write_failed", "worker_id": str(self._worker_id)},
                )
                last = exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        # Eight transient-looking failures: an unreachable database, or a batch the database
        # refuses with a transient-looking error (a statement timeout, say). Asking tells them
        # apart; a refused batch is split, never dropped.
        try:
            async with bounded(self._pool, 5) as conn:
                await conn.execute(PROBE)
        except Exception:
            raise Unreachable from last
        assert last is not None  # every try failed
        raise last

    async def _statement(self, batch: list[Pending], room: int) -> Statuses:
        outcomes = [p.outcome for p in batch]
        # Runs with serial keys: their keys are released set-based in the batch's transaction.
        serial = any(p.serial for p in batch)
        params = finish_params(outcomes)
        pending: PendingClaim | None = None
        sent = time.monotonic()
        async with bounded(self._pool, 10) as conn:
            faults.hit("outcome.committing", conn)
            via = self._route.via
            if via != "pipeline":
                # The finishes, the keys' release and the claim in one simple query, its one
                # implicit transaction; nothing is sent before send().
                trip = Trip(conn, functions=via == "functions")
                finished, pending = await self._batch_statements(trip, params, serial, room)
                await trip.send()
            elif room > 0:
                # BEGIN, the finishes, the keys' release, the claim and COMMIT travel in one
                # round trip.
                async with one_trip(conn):
                    await conn.execute(NO_JIT)
                    finished, pending = await self._batch_statements(
                        conn, params, serial, room)
            else:
                finished = await conn.execute(QUERIES["finish_runs"], params)
            # The claimed runs are read (and handed over) only after the commit.
            claimed = await read_claimed(pending) if pending is not None else None
            statuses = {(run_id, attempt): status
                        for run_id, attempt, status in await finished.fetchall()}
        if claimed is not None:
            assert self._refill is not None
            self._refill.started(claimed, sent)
        return statuses

    async def _batch_statements(self, conn: Statements, params: dict[str, str], serial: bool,
                                room: int) -> tuple[Rows, PendingClaim | None]:
        """The batch's statements, unread: the finishes and, with `room` to refill, the serial
        keys' release and the refill's claim (None: no claim)."""
        if room <= 0:
            return await conn.execute(QUERIES["finish_runs"], params), None
        assert self._refill is not None
        if serial:
            await conn.execute(QUERIES["defer_serial_release"])
        finished = await conn.execute(QUERIES["finish_runs"], params)
        if serial:
            await conn.execute(QUERIES["lock_ended_serial_keys"], params)
            await conn.execute(QUERIES["release_serial_keys"], params)
        return finished, await self._refill.statements(conn, room)
