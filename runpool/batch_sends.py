"""How a group commit's writes go as batch statements (runpool.commits): a write as the
group holds it, grouped by kind into batch statements, sent, and answered from what each
statement returned (a write its batch statement skipped is left unanswered, to go again)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import psycopg

from .db import one_trip
from .trips import Rows, Trip, Via

__all__ = ["MAX_BATCH_BYTES", "MAX_SKIPS", "SKIP_PAUSE", "TRIP_MAX_BYTES", "Op", "Statement",
           "Write", "answer", "answers", "fits_trip", "kinds", "send", "send_all"]

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
    def batch_params(self, rows: list[bytes], *, ring: bool = True) -> dict[str, Any]: ...

# The most JSON one batch statement carries: the server parses its array whole (and each
# write's values again as its rows), so a batch of large writes (64 tool results of 1 MB:
# ~520 MB in one backend) goes as several statements, each a bounded cost; a larger write
# goes alone.
MAX_BATCH_BYTES: Final = 4 << 20
# The most JSON a batch sent as a trip carries (fits_trip); a larger batch goes in psycopg's
# pipeline. W11's writes are ~100 bytes each.
TRIP_MAX_BYTES: Final = 256 << 10


# A first try its batch statement skipped (its run row held: most often by a heartbeat, which
# holds a worker's rows ~15-20 ms a beat at 1,000 runs) goes again in a batch after a pause,
# SKIP_PAUSE doubling (5, 10, 20, 40, 80 ms), MAX_SKIPS times before it goes to a waiting lane:
# each skipped write sent alone there put W11's tool call p99 at 330-590 ms.
SKIP_PAUSE: Final = 0.005
MAX_SKIPS: Final = 5

@dataclass(slots=True)
class Write:
    op: Op
    tries: int
    deadline: float
    done: asyncio.Future[Any]
    # The write as a statement to pipeline (a first try only: a repeat reads back first).
    statement: Statement | None
    # In a waiting lane, alone: its run row was held by another transaction (a batch
    # statement skipped it, or its transaction found it held), a lock timed out, or it is
    # a repeat.
    alone: bool = False
    # Times its batch statement skipped it, and the pause before it goes in a batch again.
    skips: int = 0
    pause: float = 0.0
    # Its run (when the caller said), and whether its last try found the run row held (its
    # poll then first asks whether it still is).
    run_id: uuid.UUID | None = None
    held: bool = False


_NONE: Final = object()


def kinds(piped: list[Write]) -> list[list[tuple[Write, Statement]]]:
    """The writes to send, by statement: those of one batch kind together (one per run: a
    run's second write in a batch, never made by a worker, goes alone after) in batch
    statements of at most MAX_BATCH_BYTES, a write without a batch form alone."""
    kinds: dict[str, list[list[tuple[Write, Statement]]]] = {}
    size: dict[str, int] = {}
    alone: list[list[tuple[Write, Statement]]] = []
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


async def send(conn: psycopg.AsyncConnection[Any] | Trip, kind: list[tuple[Write, Statement]],
               *, ring: bool = True) -> Rows:
    """Send the writes of one kind (_kinds): as their batch statement, or one alone (not in
    a Trip, which takes only prepared statements' parameters: runpool.trips). `ring`: the
    batch statement rings its runs' doorbells (if not, the caller does once it committed;
    a write's single statement always does)."""
    first = kind[0][1]
    if first.batch is None:
        assert not isinstance(conn, Trip)
        return await conn.execute(first.query, first.params)
    # A batchable write alone too: its batch statement skips a run row another transaction
    # holds, where its single statement would hold up the whole batch waiting for it.
    return await conn.execute(first.batch, first.batch_params([st.row for _, st in kind],
                                                              ring=ring))


def fits_trip(batch: list[Write]) -> bool:
    """Whether a batch may go as a trip (send_all): at most TRIP_MAX_BYTES of JSON. The
    server keeps a simple query's statements, literals and all, until its end: large tool
    results (64 of 1 MB) grew a backend by 386 MB as one trip, against the pipeline's one
    statement of at most MAX_BATCH_BYTES at a time."""
    return sum(len(w.statement.row) for w in batch
               if w.statement is not None) <= TRIP_MAX_BYTES


async def send_all(conn: psycopg.AsyncConnection[Any], batch: list[list[tuple[Write, Statement]]],
                   *, via: Via, ring: bool = True) -> list[Rows]:
    """Send the kinds of a batch (kinds()) in one round trip, as one transaction, their
    answers unread. `via` (runpool.trips.Via) "prepared", on a worker session, or "functions",
    behind a pooler: they go as one simple query of the statements the session prepared, or
    of calls to their functions (runpool.trips), whose implicit transaction an error rolls
    back whole: psycopg's pipeline costs ~35-55 us of client CPU a statement, and a W11
    worker spent ~0.76 ms of CPU a commit. "pipeline": a lone statement in autocommit,
    several with BEGIN and COMMIT behind one Sync (db.one_trip). `ring`: as send's."""
    if via != "pipeline":
        statements = Trip(conn, functions=via == "functions")
        sent = [await send(statements, kind, ring=ring) for kind in batch]
        await statements.send()
        return sent
    if len(batch) == 1:
        return [await send(conn, batch[0], ring=ring)]
    async with one_trip(conn):
        return [await send(conn, kind, ring=ring) for kind in batch]


async def answers(conn: psycopg.AsyncConnection[Any], kind: list[tuple[Write, Statement]],
                  cur: Rows, results: list[tuple[Write, Any]]) -> None:
    """The answers of the writes of one kind sent by _send, into `results`."""
    if kind[0][1].batch is None:
        w, statement = kind[0]
        await answer_from(conn, w, statement, await cur.fetchone(), results)
        return
    # A batch returns (run id, value) of each write it made. One it did not make (its run
    # row held by another transaction and skipped, or the write refused) is left unanswered,
    # to be sent again alone (its single statement waits for the row, or explains).
    made = {key: value for key, value in await cur.fetchall()}
    for w, statement in kind:
        value = made.get(statement.params["run_id"], _NONE)
        if value is _NONE:
            w.skips += 1
            if w.skips > MAX_SKIPS:
                w.statement = None
                w.alone = True
            else:
                w.pause = SKIP_PAUSE * 2 ** (w.skips - 1)
        else:
            await answer_from(conn, w, statement, (value,), results)


async def answer_from(conn: psycopg.AsyncConnection[Any], w: Write, statement: Statement,
                       row: Any, results: list[tuple[Write, Any]]) -> None:
    """A pipelined write's answer of the row its statement returned, into `results`."""
    try:
        results.append((w, await statement.answer(conn, row)))
    except psycopg.Error:
        raise
    except Exception as exc:
        # Refused without an error (LeaseLost, CallMismatch): nothing written.
        answer(w, exc=exc)


def answer(w: Write, *, result: Any = None, exc: BaseException | None = None) -> None:
    if w.done.done():
        return
    if exc is not None:
        w.done.set_exception(exc)
    else:
        w.done.set_result(result)
