"""Live runs: wait for a run's result, or follow its events as they happen.

Both hold no transaction open while they wait: they LISTEN on the run's own channel
(`runpool_run_<32 hex digits>`, rung with an empty payload by every stored event, by a terminal
status and by progress) on the caller's connection, read what is new, and wait again; a poll every
`poll` seconds is the fallback, so a lost notification delays them by at most `poll`.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncGenerator, Generator, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal

import psycopg
from psycopg import sql

from .errors import InvalidInput, NotFound
from .limits import check_tenant
from .live_io import Answer, Nap, Read, aexecute, anap, aperform, aquiet, idle, perform, quiet

__all__ = ["EVENTS", "READ_SECONDS", "TERMINAL", "RunEvent", "RunResult", "Stream", "Then",
           "channel", "follow", "page_size", "reads", "wait", "wait_async"]

TERMINAL: Final = frozenset({"succeeded", "failed", "cancelled"})
# Messages per page of a follower's read (their content may be large); status events and tool
# calls of a run are few and come whole.
PAGE: Final = 500
# The largest `after` accepted (a seq is a bigint).
MAX_SEQ: Final = 2**62
# A read the server leaves unanswered this long (a silent network: a dead NAT entry, a
# partition; no error, no answer, and TCP gives up only after many minutes) is cut: the
# connection fails as if the network had broken it, so a follower or a waiter without a
# timeout reconnects instead of hanging. Each read is one small statement.
READ_SECONDS: Final = 30.0
# How long past its timeout a wait whose read is still unanswered is cut (TimeoutError).
GRACE_SECONDS: Final = 1.0

# The run's status, result and error (no row: no such run, or another tenant's).
RESULT: Final = """
SELECT status, result, error FROM runpool.runs
WHERE id = %(run_id)s AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
"""
# Followers' reads, one statement for any number of them (a FollowHub reads the runs whose
# doorbells rang together at once; follow() reads one): for each (run_id, after, tenant), row
# number i, the run's header (kind 'run': its status and last seq, from its checkpoint counter
# once it has one (see 0009); no row for i: no such run, or another tenant's), its stored
# events after seq `after` (status changes from status_history's two tables, 0017; the
# 'queued' of seq 1 is the run's creation, not a row), and its current progress (kind
# 'progress', seq = its version).
# One statement, one snapshot: a header's last seq covers exactly the events returned.
EVENTS: Final = """
SELECT q.i, e.kind, e.seq, e.data, e.at
FROM unnest(%(run_ids)s::uuid[], %(afters)s::bigint[], %(tenants)s::text[])
     WITH ORDINALITY AS q(run_id, after, tenant, i)
JOIN LATERAL (
    SELECT r.id, r.status, r.attempt, r.created_at,
           coalesce((SELECT s.seq FROM runpool.event_seqs s WHERE s.run_id = r.id), r.event_seq)
               AS event_seq
    FROM runpool.runs r
    WHERE r.id = q.run_id AND (q.tenant IS NULL OR r.tenant = q.tenant)
) AS run ON true
CROSS JOIN LATERAL (
    SELECT 'run' AS kind, run.event_seq AS seq, to_jsonb(run.status) AS data,
           run.created_at AS at
    UNION ALL
    SELECT 'status', 1, '{"status": "queued", "attempt": 0}'::jsonb, run.created_at
    WHERE q.after < 1
    UNION ALL
    SELECT 'status', s.seq,
           jsonb_strip_nulls(jsonb_build_object('status', s.status, 'attempt', s.attempt,
                                                'reason', s.reason)), s.at
    FROM (
        -- status_history's two tables, each probed through its run index. Joined through
        -- the view, run_events was scanned whole on every read: PostgreSQL does not flatten
        -- a UNION ALL branch that has a WHERE, so the run id never reached its index (W12's
        -- reads took 7-8 ms beside 45,000 events, tests/test_live_hub.py).
        SELECT h.seq, h.at, h.status, h.attempt, h.reason FROM runpool.status_events h
        WHERE h.run_id = run.id AND h.seq > q.after
        UNION ALL
        SELECT h.seq, h.at, h.status, h.attempt, h.reason FROM runpool.run_events h
        WHERE h.run_id = run.id AND h.seq > q.after
    ) AS s
    UNION ALL
    (SELECT 'message', m.event_seq, jsonb_build_object('role', m.role, 'content', m.content),
            m.created_at
     FROM runpool.messages m
     WHERE m.run_id = run.id AND m.event_seq > q.after
     ORDER BY m.event_seq LIMIT %(page)s)
    UNION ALL
    SELECT 'tool_call', c.seq, c.data, c.at
    FROM runpool.tool_calls t
    CROSS JOIN LATERAL (VALUES
        (t.started_seq, jsonb_build_object('call_id', t.call_id, 'name', t.name,
                                           'status', 'started'), t.started_at),
        (t.finished_seq, jsonb_build_object('call_id', t.call_id, 'name', t.name,
                                            'status', t.status, 'result', t.result),
         t.finished_at)
    ) AS c(seq, data, at)
    WHERE t.run_id = run.id AND coalesce(t.finished_seq, t.started_seq) > q.after
      AND c.seq > q.after
    UNION ALL
    SELECT 'progress', p.version, p.data, p.at
    FROM runpool.progress p
    WHERE p.run_id = run.id AND p.attempt = run.attempt AND run.status = 'running'
) AS e
"""


@dataclass(frozen=True)
class RunResult:
    """A finished run: its terminal status, its result (succeeded) or error (failed,
    cancelled: {"reason", "message", ...} or None)."""

    id: uuid.UUID
    status: str
    result: Any
    error: Any


@dataclass(frozen=True)
class RunEvent:
    """One event of a run. kind 'status': {"status", "attempt", "reason"?}; 'message':
    {"role", "content"}; 'tool_call': {"call_id", "name", "status", "result"?}; 'progress':
    the handler's data, with the seq of the last stored event (not stored itself)."""

    seq: int
    kind: str
    data: Any
    at: datetime


def channel(run_id: uuid.UUID) -> str:
    """The run's doorbell (see migration 0009): its id in the name, never in a payload."""
    return f"runpool_run_{run_id.hex}"


def _run_id(value: Any) -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    if isinstance(value, str):
        try:
            return uuid.UUID(value)
        except ValueError:
            pass
    raise InvalidInput(f"run_id must be a UUID, not {value!r:.80}")


def _after(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEQ:
        raise InvalidInput(f"after must be an integer seq from 0 to {MAX_SEQ}, not {value!r:.80}")
    return value


def _seconds(value: Any, what: str, *, allow_none: bool, low: float) -> float | None:
    if value is None and allow_none:
        return None
    if (isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value)
            or value < low or math.isinf(value)):
        raise InvalidInput(f"{what} must be a finite number of seconds >= {low:g}, not"
                           f" {value!r:.80}")
    return float(value)


def _listen(run_id: uuid.UUID, on: bool) -> sql.Composed:
    return sql.SQL("LISTEN {}" if on else "UNLISTEN {}").format(sql.Identifier(channel(run_id)))


def _result(run_id: uuid.UUID, row: tuple[Any, ...] | None) -> RunResult | None:
    if row is None:
        raise NotFound(f"no run {run_id}")
    status, result, error = row
    return RunResult(run_id, status, result, error) if status in TERMINAL else None


def _poll(value: Any) -> float:
    poll = _seconds(value, "poll", allow_none=False, low=0.01)
    assert poll is not None
    return poll


def _deadline(timeout: float | None) -> float:
    return math.inf if timeout is None else time.monotonic() + timeout


def _nap(run_id: uuid.UUID, deadline: float, poll: float, timeout: float | None) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"run {run_id} did not finish within {timeout:g} s")
    return min(poll, left)


_Steps = Generator[Read | Nap, Answer, RunResult]


def _waiting(run_id: uuid.UUID, timeout: float | None, poll: float, tenant: str | None,
             listen: bool) -> _Steps:
    """The whole logic of a wait, without its I/O: the steps it takes, each answered by its
    driver (wait, wait_async) with a row, None, or the step's psycopg.OperationalError; it
    returns the RunResult. The driver UNLISTENs once it ends."""
    deadline = _deadline(timeout)
    if listen:
        answer = yield Read(_read_bound(deadline), _listen(run_id, True))
        _check(run_id, deadline, timeout, answer)
    while True:
        answer = yield Read(_read_bound(deadline), RESULT, {"run_id": run_id, "tenant": tenant})
        done = _result(run_id, _check(run_id, deadline, timeout, answer))
        if done is not None:
            return done
        _check(run_id, deadline, timeout, (yield Nap(_nap(run_id, deadline, poll, timeout))))


class _Wait:
    """One wait (its arguments checked): _waiting's steps, fed the answers of its driver."""

    def __init__(self, run_id: Any, timeout: Any, poll: Any, tenant: Any, listen: bool) -> None:
        self.run_id = _run_id(run_id)
        self._steps = _waiting(self.run_id, _seconds(timeout, "timeout", allow_none=True, low=0),
                               _poll(poll), check_tenant(tenant), listen)
        self.step = next(self._steps)
        self.result: RunResult | None = None

    def answer(self, answer: Answer) -> None:
        try:
            self.step = self._steps.send(answer)
        except StopIteration as stop:
            self.result = stop.value


# The contract names `timeout` (the twin of wait()'s); asyncio.timeout around it works too.
async def wait_async(aconn: psycopg.AsyncConnection[Any], run_id: uuid.UUID | str,
                     timeout: float | None = None, poll: float = 1.0,  # noqa: ASYNC109
                     *, tenant: str | None = None, listen: bool = True) -> RunResult:
    """Wait until the run is terminal and return its RunResult; TimeoutError after `timeout`
    seconds (also when the server stops answering: the connection is then cut); NotFound for
    no such run (or, with `tenant`, another tenant's run). The connection is used for nothing
    else meanwhile; it is left outside any transaction, as it was.
    listen=False polls only (a transaction-mode pooler, where LISTEN cannot work)."""
    pending = _Wait(run_id, timeout, poll, tenant, listen)
    idle(aconn)
    try:
        while pending.result is None:
            pending.answer(await aperform(aconn, pending.step, listen))
        return pending.result
    finally:
        if listen:
            await aquiet(aconn, READ_SECONDS, _listen(pending.run_id, False))


def wait(conn: psycopg.Connection[Any], run_id: uuid.UUID | str, timeout: float | None = None,
         poll: float = 1.0, *, tenant: str | None = None, listen: bool = True) -> RunResult:
    """wait_async() for a blocking connection."""
    pending = _Wait(run_id, timeout, poll, tenant, listen)
    idle(conn)
    try:
        while pending.result is None:
            pending.answer(perform(conn, pending.step, listen))
        return pending.result
    finally:
        if listen:
            quiet(conn, READ_SECONDS, _listen(pending.run_id, False))


def _check(run_id: uuid.UUID, deadline: float, timeout: float | None,
           answer: Answer) -> tuple[Any, ...] | None:
    """A step's answer, unless it is a broken connection: past the wait's deadline its read
    was cut for the timeout (TimeoutError); before, the error is the caller's."""
    if not isinstance(answer, psycopg.OperationalError):
        return answer
    if timeout is not None and time.monotonic() >= deadline:
        raise TimeoutError(f"run {run_id} did not finish within {timeout:g} s (the server"
                           f" did not answer: the connection was cut)") from answer
    raise answer


def _read_bound(deadline: float) -> float:
    """How long a wait's read may go unanswered: READ_SECONDS, and no later than its
    deadline's grace."""
    return min(READ_SECONDS, max(deadline - time.monotonic(), 0) + GRACE_SECONDS)


async def follow(aconn: psycopg.AsyncConnection[Any], run_id: uuid.UUID | str, after: int = 0,
                 *, poll: float = 1.0, tenant: str | None = None, listen: bool = True
                 ) -> AsyncGenerator[RunEvent, None]:
    """The run's events after seq `after`, as they are committed, then ends once the run is
    terminal and every stored event was delivered. Stored events (status, message, tool_call)
    come exactly once each, in commit order, whatever crashes and reclaims happen meanwhile:
    resume a cut stream with after=<the last seq seen>. Progress events come as they are
    published, best effort (a follower that reads slower sees only the latest). NotFound for
    no such run (or, with `tenant`, another tenant's). A broken connection, or one whose
    server leaves a read unanswered for READ_SECONDS (it is then cut), raises the driver's
    psycopg.OperationalError. Use `contextlib.aclosing` to stop early and have the connection
    UNLISTEN at once. listen=False polls only."""
    stream = Stream(run_id, after, poll, tenant)
    idle(aconn)
    try:
        if listen:
            await aexecute(aconn, READ_SECONDS, _listen(stream.run_id, True))
        while True:
            cur = await aexecute(aconn, READ_SECONDS, EVENTS, stream.params())
            events, then = stream.take(await cur.fetchall())
            for event in events:
                yield event
            if then == "end":
                return
            if then == "wait":
                await anap(aconn, stream.poll, listen)
    finally:
        if listen:
            await aquiet(aconn, READ_SECONDS, _listen(stream.run_id, False))


# What a follower does after a read: read again at once (a full page: more messages wait),
# wait for a notification or its poll, or end (the run is terminal and all was delivered).
Then = Literal["read", "wait", "end"]


class Stream:
    """A follower's place in a run's events (follow's, and runpool.live_hub's): what its next
    read asks for, and what a read's rows give it to deliver."""

    def __init__(self, run_id: Any, after: Any, poll: Any, tenant: Any) -> None:
        self.run_id, self.last = _run_id(run_id), _after(after)
        self.poll, self.tenant = _poll(poll), check_tenant(tenant)
        self._progress: int | None = None  # the version of the progress last delivered
        # Whether its last read brought all there was (not a full page): a FollowHub reads
        # such streams together, and one still catching up alone, with a whole page.
        self.caught_up = False

    def params(self) -> dict[str, Any]:
        """The parameters of its next read alone (EVENTS)."""
        return reads([self])

    def take(self, rows: Iterable[tuple[int, str, int, Any, datetime]], size: int = PAGE
             ) -> tuple[list[RunEvent], Then]:
        """Its rows of a read (EVENTS' with `size` messages a run at most), to deliver in seq
        order, and what to do next."""
        page = _Page(rows, size)
        if page.status is None:
            raise NotFound(f"no run {self.run_id}")
        events = page.events
        if events:
            self.last = events[-1].seq
        self.caught_up = not page.full
        if page.full:
            return events, "read"
        if page.status in TERMINAL and self.last >= page.last_seq:
            return events, "end"
        if page.progress is not None and page.progress[0] != self._progress:
            self._progress = page.progress[0]
            events = [*events, RunEvent(self.last, "progress", page.progress[1],
                                        page.progress[2])]
        return events, "wait"


def page_size(streams: int) -> int:
    """Messages a run at most in one read for this many streams: a read brings no more
    messages than one follower's page (PAGE), however many it serves (each may be large)."""
    return max(1, PAGE // streams)


def reads(streams: Sequence[Stream]) -> dict[str, Any]:
    """The parameters of one read (EVENTS) for all these streams: row i is streams[i - 1]'s."""
    return {"run_ids": [s.run_id for s in streams], "afters": [s.last for s in streams],
            "tenants": [s.tenant for s in streams], "page": page_size(len(streams))}


class _Page:
    """One read of a follower, sorted into its parts."""

    def __init__(self, rows: Iterable[tuple[int, str, int, Any, datetime]], size: int) -> None:
        self.status: str | None = None
        self.last_seq = 0
        self.progress: tuple[int, Any, datetime] | None = None
        events: list[RunEvent] = []
        messages = 0
        for _, kind, seq, data, at in rows:
            if kind == "run":
                self.status, self.last_seq = data, seq
            elif kind == "progress":
                self.progress = (seq, data, at)
            else:
                events.append(RunEvent(seq, kind, data, at))
                messages += kind == "message"
        events.sort(key=lambda e: e.seq)
        # A full page of messages: the events past its last message wait for the next read
        # (one of them may be a message after it that this page did not bring).
        self.full = messages >= size
        if self.full:
            bound = max(e.seq for e in events if e.kind == "message")
            events = [e for e in events if e.seq <= bound]
        self.events = events
