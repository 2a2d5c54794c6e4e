"""Enqueue from Python, in the caller's transaction (commit is the caller's)."""

from __future__ import annotations

import asyncio
import math
import uuid
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final

import psycopg
from psycopg import pq
from psycopg.rows import tuple_row

from .codec import dumps, jsonb
from .db import require_utf8, translate_error
from .errors import InvalidInput
from .limits import check_text
from .telemetry import RUN_ID, enqueue_traceparent

__all__ = ["RunSpec", "enqueue", "enqueue_async", "enqueue_many"]

# Enqueue one run through the SQL API (validation and idempotency live there).
ENQUEUE: Final = """
SELECT runpool.enqueue(%(tenant)s, %(handler)s, %(input)s, %(priority)s,
                       %(idempotency_key)s, %(run_at)s, %(max_attempts)s, %(traceparent)s,
                       %(serial_key)s, %(timeout)s, %(deadline)s, %(budget)s)
"""
# Enqueue many runs in one set-based call (0016); ids come back in input order.
ENQUEUE_MANY: Final = "SELECT id FROM runpool.enqueue_many(%s) AS id"


# Distinct serial keys one enqueue_many may carry: the limit runpool.enqueue_many (0016)
# enforces. Each key holds an advisory lock until the caller commits (two once its run waits),
# and the server's lock table is shared and fixed (max_locks_per_transaction x max_connections:
# 6,400 entries by default): thousands of keys in one open transaction would fill it, and every
# session would then fail "out of shared memory" (README: Serial keys).
MAX_SERIAL_KEYS: Final = 1000


# PostgreSQL's integer: the type enqueue's priority and max_attempts are. psycopg sends a
# Python int beyond it as a bigint, which no enqueue takes (UndefinedFunction, not a refusal).
_INT_MIN: Final = -(2**31)
_INT_MAX: Final = 2**31 - 1


def _check_int(name: str, value: object) -> None:
    """An integer the database can take as one; its range is runpool.enqueue's to check."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{name} must be an integer, got {value!r}")
    if not _INT_MIN <= value <= _INT_MAX:
        raise InvalidInput(f"{name} is out of range, got {value}")


@dataclass(frozen=True, slots=True)
class RunSpec:
    tenant: str
    handler: str
    input: Any = field(default_factory=dict)
    priority: int = 0
    idempotency_key: str | None = None
    run_at: datetime | None = None
    max_attempts: int | None = None
    traceparent: str | None = None
    # Runs sharing (tenant, serial_key) run one at a time, in enqueue order.
    serial_key: str | None = None
    # Cost control: the longest one attempt may run (seconds or a timedelta), when the run
    # must have ended, and its budget ({"max_tokens"?, "max_cost"?, "max_tool_calls"?,
    # "max_turns"?}); validated by the database (runpool.enqueue).
    timeout: float | timedelta | None = None
    deadline: datetime | None = None
    budget: dict[str, Any] | None = None

    def _check(self) -> None:
        """What psycopg or jsonb could not carry to the database faithfully (its own checks,
        for one run or a batch alike, are runpool.enqueue's and enqueue_many's)."""
        for name in ("tenant", "handler", "idempotency_key", "traceparent", "serial_key"):
            value = getattr(self, name)
            if isinstance(value, str):  # other types are runpool.enqueue's to refuse
                check_text(name, value)
        _check_int("priority", self.priority)
        _check_int("max_attempts", self.max_attempts)

    def params(self) -> dict[str, Any]:
        self._check()
        # Serialised here so a value jsonb cannot hold fails before the database sees it.
        payload = dumps(self.input)
        return {
            "tenant": self.tenant,
            "handler": self.handler,
            "input": jsonb(payload),
            "priority": self.priority,
            "idempotency_key": self.idempotency_key,
            "run_at": self.run_at,
            "max_attempts": self.max_attempts,
            "traceparent": self.traceparent,
            "serial_key": self.serial_key,
            "timeout": _interval(self.timeout),
            "deadline": self.deadline,
            "budget": None if self.budget is None else jsonb(dumps(self.budget)),
        }

    def element(self) -> dict[str, Any]:
        """This run as one element of runpool.enqueue_many's array: only what differs from
        enqueue's defaults (a timeout in seconds; times as ISO text, naive ones read in the
        session's time zone as the single enqueue's are)."""
        self._check()
        out: dict[str, Any] = {"tenant": self.tenant, "handler": self.handler,
                               "input": self.input}
        for name in ("idempotency_key", "run_at", "max_attempts", "traceparent",
                     "serial_key", "deadline", "budget"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.priority != 0:
            out["priority"] = self.priority
        timeout = _interval(self.timeout)
        if timeout is not None:
            out["timeout"] = timeout.total_seconds()
        return out


def _interval(timeout: float | timedelta | None) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) \
            or not math.isfinite(timeout):
        raise InvalidInput(f"timeout must be a number of seconds or a timedelta, got"
                           f" {timeout!r}")
    if not 0 < timeout <= 366 * 86400:
        raise InvalidInput(f"timeout must be more than 0 and at most a year, got {timeout!r}")
    return timedelta(seconds=timeout)


def _rows(conn: psycopg.Connection[Any], query: str, params: Any) -> list[tuple[Any, ...]]:
    """query's rows on conn, in its transaction; the database's refusal of bad input as
    InvalidInput. Inside the caller's open transaction the call runs in a savepoint of its own
    (psycopg's transaction()), so a refusal, or an interruption while the answer is on its way,
    rolls back only the call and leaves that transaction usable. Rows are tuples whatever
    conn's row factory is."""
    require_utf8(conn)
    try:
        if conn.info.transaction_status != pq.TransactionStatus.INTRANS:
            return conn.cursor(row_factory=tuple_row).execute(query, params).fetchall()
        with conn.transaction():
            return conn.cursor(row_factory=tuple_row).execute(query, params).fetchall()
    except psycopg.Error as exc:
        raise translate_error(exc) from exc


# enqueue_async's calls on one connection, one at a time. Tasks sharing a connection would
# otherwise open their savepoints before any of them released its own (psycopg then raises
# OutOfOrderTransactionNesting), or see the connection busy with another task's statement,
# take it for one outside a transaction and run with no savepoint: a refusal then aborted
# every other task's call and the caller's transaction with them.
_ASYNC_CALLS: Final[weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], asyncio.Lock]] = \
    weakref.WeakKeyDictionary()


async def _arows(conn: psycopg.AsyncConnection[Any], query: str, params: Any
                 ) -> list[tuple[Any, ...]]:
    """The asyncio twin of _rows. Its savepoint, not a pipelined one (SAVEPOINT, the call and
    RELEASE behind one Sync), is what keeps a task cancelled after the server ended the call
    from leaving the run in the caller's transaction, and concurrent tasks sharing conn from
    interleaving their statements in one pipeline (tests/test_attack3_enqueue.py)."""
    require_utf8(conn)
    async with _ASYNC_CALLS.setdefault(conn, asyncio.Lock()):
        # The status with no other task's statement in flight (psycopg holds conn.lock
        # through each): ACTIVE would say nothing of the transaction.
        async with conn.lock:
            in_transaction = conn.info.transaction_status == pq.TransactionStatus.INTRANS
        try:
            if not in_transaction:
                cur = await conn.cursor(row_factory=tuple_row).execute(query, params)
                return await cur.fetchall()
            async with conn.transaction():
                cur = await conn.cursor(row_factory=tuple_row).execute(query, params)
                return await cur.fetchall()
        except psycopg.Error as exc:
            raise translate_error(exc) from exc


@contextmanager
def _enqueue_span(handler: str, tenant: str, traceparent: str | None
                  ) -> Iterator[tuple[Any, str | None]]:
    """The enqueue span, root of the run's trace, when the caller traces and gave no
    traceparent of its own; its context is stored on the run."""
    if traceparent is not None:
        yield None, traceparent
        return
    span, traceparent = enqueue_traceparent(handler, tenant)
    try:
        yield span, traceparent
    except BaseException as exc:
        if span is not None:
            span.record_exception(exc)
        raise
    finally:
        if span is not None:
            span.end()


def _label(span: Any, run_id: uuid.UUID) -> None:
    if span is not None:
        span.set_attribute(RUN_ID, str(run_id))


def enqueue(
    conn: psycopg.Connection[Any],
    tenant: str,
    handler: str,
    input: Any = None,
    *,
    priority: int = 0,
    idempotency_key: str | None = None,
    run_at: datetime | None = None,
    max_attempts: int | None = None,
    traceparent: str | None = None,
    serial_key: str | None = None,
    timeout: float | timedelta | None = None,
    deadline: datetime | None = None,
    budget: dict[str, Any] | None = None,
) -> uuid.UUID:
    """Enqueue a run on conn, joining its transaction; returns the run id (the existing one
    for a repeated idempotency key)."""
    with _enqueue_span(handler, tenant, traceparent) as (span, traceparent):
        spec = RunSpec(tenant, handler, {} if input is None else input, priority,
                       idempotency_key, run_at, max_attempts, traceparent, serial_key,
                       timeout, deadline, budget)
        ((run_id,),) = _rows(conn, ENQUEUE, spec.params())
        _label(span, run_id)
        return run_id  # type: ignore[no-any-return]


async def enqueue_async(
    conn: psycopg.AsyncConnection[Any],
    tenant: str,
    handler: str,
    input: Any = None,
    *,
    priority: int = 0,
    idempotency_key: str | None = None,
    run_at: datetime | None = None,
    max_attempts: int | None = None,
    traceparent: str | None = None,
    serial_key: str | None = None,
    # The run's timeout (DESIGN names it), not a bound on this call.
    timeout: float | timedelta | None = None,  # noqa: ASYNC109
    deadline: datetime | None = None,
    budget: dict[str, Any] | None = None,
) -> uuid.UUID:
    """The asyncio twin of enqueue()."""
    with _enqueue_span(handler, tenant, traceparent) as (span, traceparent):
        spec = RunSpec(tenant, handler, {} if input is None else input, priority,
                       idempotency_key, run_at, max_attempts, traceparent, serial_key,
                       timeout, deadline, budget)
        ((run_id,),) = await _arows(conn, ENQUEUE, spec.params())
        _label(span, run_id)
        return run_id  # type: ignore[no-any-return]


def enqueue_many(conn: psycopg.Connection[Any], specs: Iterable[RunSpec]) -> list[uuid.UUID]:
    """Enqueue many runs in one statement (all or none); ids in the order given. At most
    MAX_SERIAL_KEYS distinct serial keys per call (InvalidInput beyond, nothing written)."""
    elements = [spec.element() for spec in specs]
    if not elements:
        return []
    # Serialised here, in one pass: a value jsonb cannot hold fails before the database sees it.
    payload = jsonb(dumps(elements))
    return [row[0] for row in _rows(conn, ENQUEUE_MANY, [payload])]
