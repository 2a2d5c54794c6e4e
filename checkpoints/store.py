"""Reads and fenced writes of messages and tool calls.

Each write is one statement that first locks the run row *if and only if* the given attempt
still holds it (status running, same attempt) and writes nothing otherwise. A single
statement is atomic in any transaction mode: on its own (autocommit) it is one round trip;
inside the caller's transaction it commits or rolls back with the caller's other writes. The
lock makes a reclaim (which must update the run row) wait until the write commits; a write of
an attempt that lost the lease finds no row, adds nothing and raises LeaseLost.

Every write is safe to repeat by the attempt that made it (after a lost connection, say): a
repeat that finds its own earlier write already committed accepts it instead of writing again
(and instead of reporting "not in progress"). Only one attempt can write, so "written by this
attempt" is a fact the repeat can read back.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final

import orjson
import psycopg
from psycopg.rows import class_row
from psycopg.types.json import Jsonb

from .batch_sql import BATCH_FINISH, BATCH_INTENT, BATCH_MESSAGE
from .models import CallMismatch, Message, ToolCall, lease_lost

__all__ = [
    "Statement",
    "append_message",
    "commit_tool_result",
    "find_message",
    "intent_write",
    "load",
    "load_paged",
    "mark_tool_unknown",
    "message_write",
    "record_tool_intent",
    "result_write",
]

# Does this attempt still hold the run? (Only asked to explain a write that wrote nothing.)
# `lease_expires_at IS NOT NULL` is how a worker's statement says the run is running (the
# running_has_lease check makes the two the same), so that no plan reads the run through a
# partial index of running runs: see "How a worker's statement says running" in
# runpool/queries.sql.
HOLDS: Final = """
SELECT 1 FROM runpool.runs
WHERE id = %(run_id)s AND attempt = %(attempt)s AND lease_expires_at IS NOT NULL
"""
# The fence every write starts with: the run row, locked, only while this attempt holds it.
# (Static text joined to each statement below; nothing in it is dynamic.)
FENCE: Final = """
WITH fence AS (
    SELECT id, event_seq FROM runpool.runs
    WHERE id = %(run_id)s AND attempt = %(attempt)s AND lease_expires_at IS NOT NULL
    FOR SHARE
)"""
# The write's event seqs, after the fence (0018): the run's counter row advanced by
# %(events)s (made at the run's first write, from the run row's seq) and the run's doorbell
# rung, in the write's own statement. Under the fence's lock no status change comes in
# between, and a run's writes are one at a time (its attempt's), so seqs follow commit order.
# A write refused after the fence (a repeat, a call id reused) leaves a gap: seqs only ever
# increase.
EVENT: Final = """,
event AS (
    INSERT INTO runpool.event_seqs AS s (run_id, seq)
    SELECT fence.id, fence.event_seq + %(events)s FROM fence
    ON CONFLICT ON CONSTRAINT event_seqs_pkey DO UPDATE SET seq = s.seq + %(events)s
    RETURNING s.seq, runpool._ring(s.run_id)
)"""
# One page of a run's conversation: the messages after seq `after`, oldest first.
LOAD_MESSAGES: Final = """
SELECT seq, role, content, attempt, call_id FROM runpool.messages
WHERE run_id = %(run_id)s AND seq > %(after)s ORDER BY seq LIMIT %(limit)s
"""
# One page of a run's tool calls: those after call id `after`, in primary-key order.
LOAD_TOOL_CALLS: Final = """
SELECT call_id, name, arguments, status, result, attempt, executions, started_at, finished_at
FROM runpool.tool_calls WHERE run_id = %(run_id)s AND call_id > %(after)s
ORDER BY call_id LIMIT %(limit)s
"""
# Rows per page of a load: small enough that one page is a short statement and a modest
# buffer, large enough that a typical history (W8: 1,000 calls) is one or two round trips.
PAGE: Final = 2_000
# Append one message at the next sequence number, if the attempt holds the run.
INSERT_MESSAGE: Final = FENCE + EVENT + """
INSERT INTO runpool.messages (run_id, seq, role, content, attempt, call_id, event_seq)
SELECT fence.id,
       coalesce((SELECT max(seq) FROM runpool.messages WHERE run_id = %(run_id)s), 0) + 1,
       %(role)s, %(content)s, %(attempt)s, NULL, event.seq
FROM fence, event
RETURNING seq
"""
# Record that a tool is about to run (the same call, interrupted in an EARLIER attempt, is taken
# over), if the attempt holds the run; nothing for a call finished, started by this attempt, or
# recorded with another tool name or other arguments.
INSERT_INTENT: Final = FENCE + EVENT + """
INSERT INTO runpool.tool_calls AS t (run_id, call_id, name, arguments, status, attempt,
                                     started_seq)
SELECT fence.id, %(call_id)s, %(name)s, %(arguments)s, 'started', %(attempt)s, event.seq
FROM fence, event
ON CONFLICT (run_id, call_id) DO UPDATE
    SET attempt = excluded.attempt, started_at = now(), executions = t.executions + 1,
        started_seq = excluded.started_seq, finished_seq = NULL
    WHERE t.status = 'started' AND t.attempt < excluded.attempt
      AND t.name = excluded.name AND t.arguments = excluded.arguments
RETURNING executions
"""
# One tool call's recorded state (to explain a write that wrote nothing).
CALL_STATE: Final = """
SELECT status, attempt, executions, name = %(name)s AND arguments = %(arguments)s
FROM runpool.tool_calls WHERE run_id = %(run_id)s AND call_id = %(call_id)s
"""
# The tool message an attempt committed for a call (a repeated commit reads back its seq).
CALL_MESSAGE: Final = """
SELECT m.seq FROM runpool.tool_calls t
JOIN runpool.messages m ON m.run_id = t.run_id AND m.call_id = t.call_id
WHERE t.run_id = %(run_id)s AND t.call_id = %(call_id)s AND t.attempt = %(attempt)s
  AND t.status = ANY (%(statuses)s)
ORDER BY m.seq DESC LIMIT 1
"""
# Waits until no earlier try of this attempt's write is still in flight on the server: one sent
# before its connection was lost may commit after its sender gave up on it (a group commit's
# batch sends BEGIN, its writes and COMMIT at once), and until it ends it holds the run row
# share-locked. Only a repeat asks, before it reads back.
SETTLED: Final = "SELECT 1 FROM runpool.runs WHERE id = %(run_id)s FOR NO KEY UPDATE"
# A message this attempt already committed after `after` (a repeated append reads it back).
FIND_MESSAGE: Final = """
SELECT seq FROM runpool.messages
WHERE run_id = %(run_id)s AND seq > %(after)s AND attempt = %(attempt)s AND call_id IS NULL
  AND role = %(role)s AND content = %(content)s
ORDER BY seq LIMIT 1
"""
# Whether this attempt already closed a call as unknown.
MARKED_UNKNOWN: Final = """
SELECT 1 FROM runpool.tool_calls
WHERE run_id = %(run_id)s AND call_id = %(call_id)s AND attempt = %(attempt)s
  AND status = 'unknown'
"""
# Commit a started call's outcome and its tool message together, if the attempt holds the run;
# a call is finished once (a committed call is never overwritten). Two events: the call's close
# (seq - 1) and its message (seq).
FINISH_CALL: Final = FENCE + EVENT + """,
finished AS (
    UPDATE runpool.tool_calls SET status = %(status)s, result = %(result)s, finished_at = now(),
        finished_seq = (SELECT seq - 1 FROM event)
    WHERE run_id = (SELECT id FROM fence) AND call_id = %(call_id)s AND status = 'started'
    RETURNING run_id
)
INSERT INTO runpool.messages (run_id, seq, role, content, attempt, call_id, event_seq)
SELECT finished.run_id,
       coalesce((SELECT max(seq) FROM runpool.messages WHERE run_id = %(run_id)s), 0) + 1,
       %(role)s, %(content)s, %(attempt)s, %(call_id)s, event.seq
FROM finished, event
RETURNING seq
"""
# Close an interrupted call whose outcome is unknown (no message: the agent decides what to
# tell the model), if the attempt holds the run.
MARK_UNKNOWN: Final = FENCE + """
UPDATE runpool.tool_calls SET status = 'unknown', result = %(result)s, finished_at = now()
WHERE run_id = (SELECT id FROM fence) AND call_id = %(call_id)s AND status = 'started'
RETURNING 1
"""

async def _nothing_written(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID,
                           attempt: int, what: str) -> Exception:
    """Why a fenced write wrote nothing: the lease, or the call's state."""
    cur = await conn.execute(HOLDS, {"run_id": run_id, "attempt": attempt})
    if await cur.fetchone() is None:
        return lease_lost(f"attempt {attempt} of run {run_id} no longer holds its lease")
    return LookupError(what)


async def load(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID, *, page: int = PAGE
               ) -> tuple[list[Message], dict[str, ToolCall]]:
    """The committed conversation and tool calls of a run (what a resumed attempt starts from),
    read on `conn` in pages of `page` rows."""
    @asynccontextmanager
    async def same() -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        yield conn

    return await load_paged(same, run_id, page=page)


async def load_paged(connection: Callable[[], AbstractAsyncContextManager[
                         psycopg.AsyncConnection[Any]]],
                     run_id: uuid.UUID, *, page: int = PAGE
                     ) -> tuple[list[Message], dict[str, ToolCall]]:
    """load(), each page on a connection of its own from `connection()` (so each page can
    have its own deadline): a long run's history — tens of thousands of messages and calls —
    is never one huge result read under one deadline. Only the lease holder writes a run's
    history, and it is the one resuming, so the pages form one consistent history."""
    messages: list[Message] = []
    while True:
        async with connection() as conn, conn.cursor(row_factory=class_row(Message)) as cur:
            await cur.execute(LOAD_MESSAGES, {
                "run_id": run_id, "after": messages[-1].seq if messages else 0, "limit": page})
            rows = await cur.fetchall()
        messages += rows
        if len(rows) < page:
            break
    calls: list[ToolCall] = []
    while True:
        async with connection() as conn, conn.cursor(row_factory=class_row(ToolCall)) as cur:
            await cur.execute(LOAD_TOOL_CALLS, {
                "run_id": run_id, "after": calls[-1].call_id if calls else "", "limit": page})
            got = await cur.fetchall()
        calls += got
        if len(got) < page:
            break
    # Paged in key order; handed back in the order the calls were started.
    calls.sort(key=lambda c: (c.started_at, c.call_id))
    return messages, {c.call_id: c for c in calls}


@dataclass(frozen=True, slots=True)
class Statement:
    """A fenced write as its one statement and what makes the write's answer of the row the
    statement returned (reading back, or explaining, a write that wrote nothing): so a caller
    can send many writes at once (a pipeline) and read their answers after."""

    query: str
    params: dict[str, Any]
    answer: Callable[[psycopg.AsyncConnection[Any], Any], Awaitable[int]]
    # The same write as one element of a batch (the BATCH_* statement of its kind and this
    # write's element of its JSON array); None when the caller gave no encoded JSON.
    batch: str | None = None
    row: bytes = b""

    async def run(self, conn: psycopg.AsyncConnection[Any]) -> int:
        """The write on its own: the statement, then its answer."""
        cur = await conn.execute(self.query, self.params)
        return await self.answer(conn, await cur.fetchone())

    def batch_params(self, rows: list[bytes], *, ring: bool = True) -> dict[str, Any]:
        """The params of this write's batch statement carrying `rows` (writes of its kind,
        one per run): the rows as one JSON array, the event seqs each write takes, and
        whether the statement rings the runs' doorbells (`ring`; if not, its sender must,
        once it committed)."""
        return {"rows": Jsonb(b"[" + b",".join(rows) + b"]", dumps=_as_is),
                "events": self.params["events"], "ring": ring}


def _row(scalars: dict[str, Any], **encoded: bytes) -> bytes:
    """A write's element of a batch's JSON array: its scalar params (orjson writes a UUID as
    its text), then its JSON values as the caller encoded them (spliced in, not encoded
    again)."""
    row = orjson.dumps(scalars)[:-1]
    for key, value in encoded.items():
        row += b',"' + key.encode() + b'":' + value
    return row + b"}"


def _as_is(data: Any) -> Any:
    return data


def _written(params: dict[str, Any], refused: str, done: str | None = None
             ) -> Callable[[psycopg.AsyncConnection[Any], Any], Awaitable[int]]:
    """A fenced write's answer: its single returned value, or (when nothing was written) what
    `done` reads back of this attempt's own earlier write, or why nothing was written."""
    async def answer(conn: psycopg.AsyncConnection[Any], row: Any) -> int:
        if row is None and done is not None:
            cur = await conn.execute(done, params)
            row = await cur.fetchone()
        if row is None:
            raise await _nothing_written(conn, params["run_id"], params["attempt"], refused)
        return int(row[0])

    return answer


async def find_message(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID, attempt: int,
                       after: int, role: str, content: Any) -> int | None:
    """The seq of this message if this attempt already committed it after seq `after` (so an
    append repeated after a lost acknowledgement does not add it twice), read once any earlier
    try still in flight has ended (SETTLED: in its own statement, so the read's snapshot is
    taken after)."""
    await conn.execute(SETTLED, {"run_id": run_id})
    cur = await conn.execute(FIND_MESSAGE, {
        "run_id": run_id, "attempt": attempt, "after": after, "role": role,
        "content": content})
    row = await cur.fetchone()
    return None if row is None else int(row[0])


def message_write(run_id: uuid.UUID, attempt: int, role: str, content: Any, *,
                  encoded: bytes | None = None) -> Statement:
    """append_message() as a Statement; `encoded`, content's JSON text, makes it batchable."""
    params = {"run_id": run_id, "attempt": attempt, "role": role, "content": content,
              "events": 1}
    answer = _written(params, "no message written")
    if encoded is None:
        return Statement(INSERT_MESSAGE, params, answer)
    return Statement(INSERT_MESSAGE, params, answer, BATCH_MESSAGE,
                     _row({"run_id": run_id, "attempt": attempt, "role": role},
                          content=encoded))


async def append_message(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID, attempt: int,
                         role: str, content: Any) -> int:
    """Append a message (content: a psycopg Jsonb or any adaptable value); returns its seq."""
    return await message_write(run_id, attempt, role, content).run(conn)


def intent_write(run_id: uuid.UUID, attempt: int, call_id: str, name: str, arguments: Any,
                 *, encoded: bytes | None = None) -> Statement:
    """record_tool_intent() as a Statement; `encoded`, arguments' JSON text, makes it
    batchable."""
    params = {"run_id": run_id, "attempt": attempt, "call_id": call_id, "name": name,
              "arguments": arguments, "events": 1}

    async def answer(conn: psycopg.AsyncConnection[Any], row: Any) -> int:
        if row is not None:
            return int(row[0])
        return await _intent_refused(conn, params)

    if encoded is None:
        return Statement(INSERT_INTENT, params, answer)
    return Statement(INSERT_INTENT, params, answer, BATCH_INTENT,
                     _row({"run_id": run_id, "attempt": attempt, "call_id": call_id,
                           "name": name}, arguments=encoded))


async def record_tool_intent(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID,
                             attempt: int, call_id: str, name: str, arguments: Any) -> int:
    """Record that a tool call is starting; returns how many times it has been started.
    Raises CallMismatch if the call id was recorded for another tool or other arguments, and
    LookupError if the call was already finished."""
    return await intent_write(run_id, attempt, call_id, name, arguments).run(conn)


async def _intent_refused(conn: psycopg.AsyncConnection[Any], params: dict[str, Any]) -> int:
    """An intent that wrote nothing: this attempt's own, committed by an earlier try (its
    executions), or why not."""
    run_id, attempt, call_id = params["run_id"], params["attempt"], params["call_id"]
    cur = await conn.execute(CALL_STATE, params)
    state = await cur.fetchone()
    if state is not None and not state[3]:
        raise CallMismatch(call_id)
    if state is not None and state[0] == "started" and state[1] == attempt:
        return int(state[2])  # this attempt's own intent, committed by an earlier try
    raise await _nothing_written(conn, run_id, attempt,
                                 f"tool call {call_id!r} of run {run_id} is already finished")


def result_write(run_id: uuid.UUID, attempt: int, call_id: str, *, status: str, result: Any,
                 message_role: str, message_content: Any,
                 encoded: tuple[bytes, bytes] | None = None) -> Statement:
    """commit_tool_result() as a Statement; `encoded`, the JSON text of result and of
    message_content, makes it batchable."""
    params = {"run_id": run_id, "attempt": attempt, "call_id": call_id, "status": status,
              "result": result, "role": message_role, "content": message_content,
              "statuses": ["succeeded", "failed"], "events": 2}
    answer = _written(params, f"tool call {call_id!r} of run {run_id} is not in progress",
                      CALL_MESSAGE)
    if encoded is None:
        return Statement(FINISH_CALL, params, answer)
    return Statement(FINISH_CALL, params, answer, BATCH_FINISH,
                     _row({"run_id": run_id, "attempt": attempt, "call_id": call_id,
                           "status": status, "role": message_role},
                          result=encoded[0], content=encoded[1]))


async def commit_tool_result(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID,
                             attempt: int, call_id: str, *, status: str, result: Any,
                             message_role: str, message_content: Any) -> int:
    """Commit a tool's outcome (the checkpoint) and its tool message atomically; returns the
    message's seq (also when this attempt had already committed it)."""
    return await result_write(run_id, attempt, call_id, status=status, result=result,
                              message_role=message_role,
                              message_content=message_content).run(conn)


async def mark_tool_unknown(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID,
                            attempt: int, call_id: str, result: Any) -> None:
    """Close an interrupted call whose tool may not be retried: its outcome is unknown."""
    params = {"run_id": run_id, "attempt": attempt, "call_id": call_id, "result": result}
    await Statement(MARK_UNKNOWN, params, _written(
        params, f"tool call {call_id!r} of run {run_id} is not in progress", MARKED_UNKNOWN)
    ).run(conn)
