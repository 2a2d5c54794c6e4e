"""Reads and fenced writes of messages and tool calls.

Every write takes the caller's connection and runs in the caller's transaction (opening one
when the connection has none), and first locks the run row *if and only if* the given attempt
still holds it: a reclaim (which must update that row) waits until the write commits, and a
write from an attempt that lost the lease finds no row and raises LeaseLost, so it adds nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final

import psycopg
from psycopg import pq
from psycopg.rows import class_row

from .models import LeaseLost, Message, ToolCall

__all__ = [
    "append_message",
    "commit_tool_result",
    "load",
    "mark_tool_unknown",
    "record_tool_intent",
]

# The fence: lock the run row while this attempt holds it, or return nothing.
FENCE: Final = """
SELECT 1 FROM runpool.runs
WHERE id = %(run_id)s AND attempt = %(attempt)s AND status = 'running'
FOR SHARE
"""
# A run's conversation, oldest first.
LOAD_MESSAGES: Final = """
SELECT seq, role, content, attempt, call_id FROM runpool.messages
WHERE run_id = %(run_id)s ORDER BY seq
"""
# A run's tool calls, in the order they were started.
LOAD_TOOL_CALLS: Final = """
SELECT call_id, name, arguments, status, result, attempt, executions, started_at, finished_at
FROM runpool.tool_calls WHERE run_id = %(run_id)s ORDER BY started_at, call_id
"""
# Append one message at the next sequence number of the run.
INSERT_MESSAGE: Final = """
INSERT INTO runpool.messages (run_id, seq, role, content, attempt, call_id)
SELECT %(run_id)s, coalesce(max(seq), 0) + 1, %(role)s, %(content)s, %(attempt)s, %(call_id)s
FROM runpool.messages WHERE run_id = %(run_id)s
RETURNING seq
"""
# Record that a tool is about to run; a call interrupted in an earlier attempt is taken over.
INSERT_INTENT: Final = """
INSERT INTO runpool.tool_calls AS t (run_id, call_id, name, arguments, status, attempt)
VALUES (%(run_id)s, %(call_id)s, %(name)s, %(arguments)s, 'started', %(attempt)s)
ON CONFLICT (run_id, call_id) DO UPDATE
    SET attempt = excluded.attempt, started_at = now(), executions = t.executions + 1
    WHERE t.status = 'started'
RETURNING executions
"""
# Commit a started call's outcome (only once: a committed call is never overwritten).
FINISH_CALL: Final = """
UPDATE runpool.tool_calls SET status = %(status)s, result = %(result)s, finished_at = now()
WHERE run_id = %(run_id)s AND call_id = %(call_id)s AND status = 'started'
"""


@asynccontextmanager
async def _in_callers_transaction(conn: psycopg.AsyncConnection[Any]) -> AsyncIterator[None]:
    """Atomic, inside whatever transaction the caller has: a savepoint in an open one (so a
    refusal leaves it usable), the implicit transaction the caller will commit on an idle
    non-autocommit connection, and a transaction of its own in autocommit mode."""
    if conn.autocommit or conn.info.transaction_status == pq.TransactionStatus.INTRANS:
        async with conn.transaction():
            yield
    else:
        yield


async def _fenced(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID, attempt: int) -> None:
    cur = await conn.execute(FENCE, {"run_id": run_id, "attempt": attempt})
    if await cur.fetchone() is None:
        raise LeaseLost(f"attempt {attempt} of run {run_id} no longer holds its lease")


async def load(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID
               ) -> tuple[list[Message], dict[str, ToolCall]]:
    """The committed conversation and tool calls of a run (what a resumed attempt starts from)."""
    params = {"run_id": run_id}
    async with conn.cursor(row_factory=class_row(Message)) as cur:
        await cur.execute(LOAD_MESSAGES, params)
        messages = await cur.fetchall()
    async with conn.cursor(row_factory=class_row(ToolCall)) as cur:
        await cur.execute(LOAD_TOOL_CALLS, params)
        calls = {c.call_id: c for c in await cur.fetchall()}
    return messages, calls


async def append_message(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID, attempt: int,
                         role: str, content: Any, *, call_id: str | None = None) -> int:
    """Append a message (content: a psycopg Jsonb or any adaptable value); returns its seq."""
    async with _in_callers_transaction(conn):
        await _fenced(conn, run_id, attempt)
        cur = await conn.execute(INSERT_MESSAGE, {
            "run_id": run_id, "role": role, "content": content, "attempt": attempt,
            "call_id": call_id})
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def record_tool_intent(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID,
                             attempt: int, call_id: str, name: str, arguments: Any) -> int:
    """Record (and commit, if the caller has no transaction) that a tool call is starting;
    returns how many times it has been started. Raises LookupError if it was committed."""
    async with _in_callers_transaction(conn):
        await _fenced(conn, run_id, attempt)
        cur = await conn.execute(INSERT_INTENT, {
            "run_id": run_id, "call_id": call_id, "name": name, "arguments": arguments,
            "attempt": attempt})
        row = await cur.fetchone()
    if row is None:
        raise LookupError(f"tool call {call_id!r} of run {run_id} is already finished")
    return int(row[0])


async def commit_tool_result(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID,
                             attempt: int, call_id: str, *, status: str, result: Any,
                             message_role: str, message_content: Any) -> int:
    """Commit a tool's outcome, its tool message and the checkpoint in one transaction;
    returns the message's seq."""
    async with _in_callers_transaction(conn):
        await _fenced(conn, run_id, attempt)
        cur = await conn.execute(FINISH_CALL, {
            "run_id": run_id, "call_id": call_id, "status": status, "result": result})
        if cur.rowcount != 1:
            raise LookupError(f"tool call {call_id!r} of run {run_id} is not in progress")
        cur = await conn.execute(INSERT_MESSAGE, {
            "run_id": run_id, "role": message_role, "content": message_content,
            "attempt": attempt, "call_id": call_id})
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def mark_tool_unknown(conn: psycopg.AsyncConnection[Any], run_id: uuid.UUID,
                            attempt: int, call_id: str, result: Any) -> None:
    """Close an interrupted call whose tool may not be retried: its outcome is unknown."""
    async with _in_callers_transaction(conn):
        await _fenced(conn, run_id, attempt)
        await conn.execute(FINISH_CALL, {
            "run_id": run_id, "call_id": call_id, "status": "unknown", "result": result})
