"""Durable waits and child runs: the statements behind Run.wait_for / sleep / spawn / join,
and signal_run (Python twin of the SQL function).

A wait commits and ends the attempt without consuming it (migration 0013's runpool._wait):
the run becomes 'waiting', and the handler's coroutine is unwound with `Suspended`. When the
run is queued again (a signal, its time, its children's ends), the handler runs from the top;
its history comes back from checkpoints, and the same wait (numbered in the order the handler
waits) reads what resolved it.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Protocol, TypeVar

import psycopg

from . import faults, telemetry
from .codec import dumps, jsonb, loads_exact
from .db import require_utf8, translate_error
from .enqueue import RunSpec
from .errors import InvalidInput, LeaseLost, UsageError, WaitTimeout
from .limits import check_name, check_tenant
from .live import RunResult

__all__ = ["Suspended", "WaitAnswer", "WaitMethods", "Waits", "signal_run"]

T = TypeVar("T")


class Write(Protocol):
    """A fenced write of the attempt: (what, op(conn, tries)) -> op's answer."""

    def __call__(self, what: str,
                 op: Callable[[psycopg.AsyncConnection[Any], int], Awaitable[T]]
                 ) -> Awaitable[T]: ...

# The longest timeout or sleep: ten years (as enqueue's run_at); more is a unit mistake.
MAX_SECONDS: Final = 315_576_000.0
# Options of enqueue a child may be given (tenant and trace are the parent's; a serial key
# would make a child that cannot wait).
SPAWN_OPTIONS: Final = frozenset({"priority", "run_at", "max_attempts", "timeout", "deadline",
                                  "budget"})

# Commit (or read back) wait number `seq` of this attempt; see migration 0013. The payload as
# text, decoded as a run's input is (codec.loads_exact): SQL's signal_run stores any jsonb.
WAIT: Final = """
SELECT state, payload::text, until, seconds_left
FROM runpool._wait(%(run_id)s, %(attempt)s, %(seq)s, %(kind)s, %(name)s, %(children)s::uuid[],
                   %(timeout)s, %(stay)s)"""
# Spawn a child (idempotent per parent and call id; NULL: the attempt lost the run).
SPAWN: Final = """
SELECT runpool._spawn(%(parent)s, %(attempt)s, %(call_id)s, %(handler)s, %(input)s,
                      %(priority)s, %(run_at)s, %(max_attempts)s, %(traceparent)s, %(timeout)s,
                      %(deadline)s, %(budget)s)"""
# The joined children's ends, for join's answer.
CHILDREN: Final = """
SELECT id, status, result, error FROM runpool.runs WHERE id = ANY(%(ids)s::uuid[])"""
# The SQL API, called exactly as an application would.
SIGNAL: Final = "SELECT runpool.signal_run(%(run_id)s::uuid, %(name)s, %(payload)s, %(tenant)s)"


class Suspended(BaseException):  # BaseException, like CancelledError: control flow
    """The run's wait was committed: it left its slot, and this attempt is over. Raised out of
    the handler (a BaseException, so `except Exception` in a handler does not swallow it)."""


@dataclass(frozen=True, slots=True)
class WaitAnswer:
    # 'signalled', 'timed_out', 'woke', 'joined', 'waiting', 'cancelled' or 'lost'.
    state: str
    payload: Any
    until: datetime | None
    # Of a sleep short enough to sleep in the slot.
    seconds_left: float | None


def check_seconds(value: object, what: str, *, optional: bool) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or not 0 <= value <= MAX_SECONDS:
        raise InvalidInput(f"{what} must be a number of seconds from 0 to {MAX_SECONDS:.0f}"
                           f" (10 years), got {value!r}")
    return float(value)


def check_children(ids: Iterable[object]) -> list[uuid.UUID]:
    if isinstance(ids, str | bytes):
        raise InvalidInput("join takes a list of run ids, not one string")
    children: list[uuid.UUID] = []
    for one in ids:
        try:
            children.append(one if isinstance(one, uuid.UUID) else uuid.UUID(str(one)))
        except ValueError:
            raise InvalidInput(f"join: {one!r} is not a run id") from None
    if not 1 <= len(children) <= 10_000:
        raise InvalidInput("join takes 1 to 10000 run ids")
    return children


def spawn_params(tenant: str, handler: str, input: Any, options: dict[str, Any]
                 ) -> dict[str, Any]:
    """A child's enqueue parameters, checked as enqueue checks them (RunSpec)."""
    unknown = set(options) - SPAWN_OPTIONS
    if unknown:
        raise InvalidInput(f"spawn: unknown option(s) {', '.join(sorted(unknown))} (a child"
                           f" takes {', '.join(sorted(SPAWN_OPTIONS))}; its tenant and trace"
                           " are its parent's)")
    params = RunSpec(tenant, handler, {} if input is None else input, **options).params()
    return {k: params[k] for k in ("handler", "input", *SPAWN_OPTIONS)}


async def commit_wait(conn: psycopg.AsyncConnection[Any], *, run_id: uuid.UUID, attempt: int,
                      seq: int, kind: str, name: str | None = None,
                      children: Sequence[uuid.UUID] | None = None,
                      timeout: float | None = None,  # noqa: ASYNC109 - the wait's, in SQL
                      stay: float = 0.0) -> WaitAnswer:
    """Wait number `seq` of this attempt: its answer, or 'waiting' once committed."""
    try:
        cur = await conn.execute(WAIT, {
            "run_id": run_id, "attempt": attempt, "seq": seq, "kind": kind, "name": name,
            "children": None if children is None else list(children), "timeout": timeout,
            "stay": stay})
    except psycopg.errors.FeatureNotSupported as exc:
        raise InvalidInput(exc.diag.message_primary or str(exc)) from None
    except psycopg.Error as exc:
        raise translate_error(exc) from None
    row = await cur.fetchone()
    assert row is not None, "runpool._wait answers one row"
    state, text, until, seconds_left = row
    return WaitAnswer(state, None if text is None else decode_payload(text), until,
                      seconds_left)


def decode_payload(text: str) -> Any:
    """A signal's payload as the wait returns it: integers beyond 64 bits exact (as a run's
    input). One no decoder takes (nested past 1,024 levels, which jsonb stores) is InvalidInput:
    every attempt would read the same consumed payload, so the run fails once, not retried."""
    try:
        return loads_exact(text.encode())
    except ValueError as exc:  # orjson's JSONDecodeError is one
        raise InvalidInput(f"the signal payload cannot be decoded: {exc}") from None


async def spawn(conn: psycopg.AsyncConnection[Any], *, parent: uuid.UUID, attempt: int,
                call_id: str, params: dict[str, Any], traceparent: str | None
                ) -> uuid.UUID | None:
    """The child's id (the first one's, for a repeated call id); None: the lease is lost."""
    try:
        cur = await conn.execute(SPAWN, {
            "parent": parent, "attempt": attempt, "call_id": call_id,
            "traceparent": traceparent, **params})
    except psycopg.errors.ObjectNotInPrerequisiteState as exc:
        raise UsageError(exc.diag.message_primary or str(exc)) from None
    except psycopg.Error as exc:
        raise translate_error(exc) from None
    row = await cur.fetchone()
    return None if row is None or row[0] is None else uuid.UUID(str(row[0]))


async def results(conn: psycopg.AsyncConnection[Any], ids: Sequence[uuid.UUID]
                  ) -> list[RunResult]:
    """The ends of joined children, in the given order."""
    cur = await conn.execute(CHILDREN, {"ids": list(ids)})
    ends = {row[0]: RunResult(*row) for row in await cur.fetchall()}
    gone = [str(one) for one in ids if one not in ends]
    if gone:
        # Deleted since they ended (a purge of finished runs): every attempt would miss them.
        raise InvalidInput(f"join: child run(s) {', '.join(gone[:3])} no longer exist (purged"
                           " after they ended?): their results cannot be read")
    return [ends[one] for one in ids]


def signal_run(conn: psycopg.Connection[Any], run_id: uuid.UUID | str, name: str,
               payload: Any = None, *, tenant: str | None = None) -> str | None:
    """Send signal `name` with `payload` (JSON; None sends {}) to a run: 'delivered' (it was
    waiting for it and is queued again), 'stored' (kept until the run waits for `name`), the
    run's terminal status (nothing stored), or None for no such run (or another tenant's).
    Commits at once on an autocommit connection; inside the caller's transaction otherwise."""
    check_name(name, "signal name")
    check_tenant(tenant)
    require_utf8(conn)
    try:
        key = uuid.UUID(str(run_id))
    except ValueError:
        raise InvalidInput(f"signal_run: {run_id!r} is not a run id") from None
    data = dumps({} if payload is None else payload)
    try:
        row = conn.execute(SIGNAL, {"run_id": key, "name": name, "payload": jsonb(data),
                                    "tenant": tenant}).fetchone()
    except psycopg.Error as exc:
        raise translate_error(exc) from None
    return None if row is None else row[0]


class Waits:
    """The waits and children of one attempt (a Run's): waits are numbered in the order the
    handler makes them, one at a time. `write(what, op)` runs `op(conn, tries)` as a fenced
    write of the attempt (after the tool calls in flight, under its write lock)."""

    def __init__(self, *, run_id: uuid.UUID, tenant: str, attempt: int, traceparent: str | None,
                 short_sleep: float, write: Write, suspend: Callable[[], None],
                 cancelled: Callable[[], bool]) -> None:
        self._run_id = run_id
        self._tenant = tenant
        self._attempt = attempt
        self._traceparent = traceparent
        self._short_sleep = short_sleep
        self._write = write
        self._suspend = suspend
        self._cancelled = cancelled
        self._seq = 0
        self._busy = False

    async def _wait(self, kind: str, **args: Any) -> WaitAnswer:
        if self._busy:
            raise UsageError("a run waits for one thing at a time: its waits are numbered in"
                             " the order it makes them, which concurrent waits would not keep")
        if self._cancelled():
            raise asyncio.CancelledError(f"run {self._run_id} was cancelled")
        self._busy = True
        try:
            self._seq += 1
            seq = self._seq
            faults.hit("wait.committing")
            answer = await self._write(f"{kind} wait commit", lambda conn, _: commit_wait(
                conn, run_id=self._run_id, attempt=self._attempt, seq=seq, kind=kind, **args))
        finally:
            self._busy = False
        if answer.state == "lost":
            raise LeaseLost(f"attempt {self._attempt} of run {self._run_id} lost its lease")
        if answer.state in ("waiting", "cancelled"):
            # Committed: the run waits, or (its cancel requested) ended cancelled instead.
            self._suspend()
            faults.hit("wait.committed")
            raise Suspended(f"run {self._run_id} {answer.state} ({kind}, wait {seq})")
        return answer

    async def wait_for(self, name: str, timeout: float | None) -> Any:  # noqa: ASYNC109
        check_name(name, "signal name")
        seconds = check_seconds(timeout, "wait_for timeout", optional=True)
        answer = await self._wait("signal", name=name, timeout=seconds)
        if answer.state != "signalled":
            raise WaitTimeout(f"no signal {name!r} came within {seconds} seconds")
        return answer.payload

    async def sleep(self, seconds: float) -> None:
        length = check_seconds(seconds, "sleep", optional=False)
        answer = await self._wait("sleep", timeout=length, stay=self._short_sleep)
        if answer.seconds_left:
            # Short enough to stay in the slot (or what is left of it after a crash).
            await asyncio.sleep(answer.seconds_left)

    async def spawn(self, call_id: str, handler: str, input: Any,
                    options: dict[str, Any]) -> uuid.UUID:
        check_name(call_id, "spawn call_id")
        check_name(handler, "spawn handler")
        params = spawn_params(self._tenant, handler, input, options)
        if self._cancelled():
            raise asyncio.CancelledError(f"run {self._run_id} was cancelled")
        trace = telemetry.child_traceparent(self._run_id, self._traceparent)
        child = await self._write("spawn", lambda conn, _: spawn(
            conn, parent=self._run_id, attempt=self._attempt, call_id=call_id, params=params,
            traceparent=trace))
        if child is None:
            raise LeaseLost(f"attempt {self._attempt} of run {self._run_id} lost its lease")
        return child

    async def join(self, ids: Iterable[object],
                   timeout: float | None) -> list[RunResult]:  # noqa: ASYNC109
        children = check_children(ids)
        seconds = check_seconds(timeout, "join timeout", optional=True)
        answer = await self._wait("join", children=children, timeout=seconds)
        if answer.state != "joined":
            raise WaitTimeout(f"the children did not all end within {seconds} seconds")
        return await self._write("join read", lambda conn, _: results(conn, children))


class WaitMethods:
    """A Run's durable waits and child runs (runpool.Run inherits them): each delegates to
    the attempt's Waits."""

    @property
    def _waits(self) -> Waits:
        """The attempt's Waits (runpool.attempt makes it at the first use)."""
        raise NotImplementedError

    async def wait_for(self, name: str, timeout: float | None = None) -> Any:  # noqa: ASYNC109
        """The payload of the next signal `name` (runpool.signal_run); the run leaves its slot
        (status 'waiting') until it comes. WaitTimeout after `timeout` seconds."""
        return await self._waits.wait_for(name, timeout)

    async def sleep(self, seconds: float) -> None:
        """A durable sleep: the run leaves its slot unless the sleep is shorter than a third
        of the lease (then it sleeps in the slot)."""
        await self._waits.sleep(seconds)

    async def spawn(self, call_id: str, handler: str, input: Any = None,
                    **options: Any) -> uuid.UUID:
        """Enqueue a child run (options: priority, run_at, max_attempts, timeout, deadline,
        budget) in this run's tenant and trace; its id. Once per call_id: a repeat answers the
        same child."""
        return await self._waits.spawn(call_id, handler, input, options)

    async def join(self, ids: Sequence[uuid.UUID | str],
                   timeout: float | None = None) -> list[RunResult]:  # noqa: ASYNC109
        """Wait (out of the slot) until every child in `ids` ended; their results in order.
        WaitTimeout after `timeout` seconds."""
        return await self._waits.join(ids, timeout)
