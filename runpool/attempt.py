"""Attempt: the state of one attempt of a run as its handler sees it (identity, committed
conversation, the worker's flags) and the fenced write every addition to it goes through."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool

from checkpoints import Message, Statement, ToolCall

from . import costs
from .codec import encode
from .commits import CommitGroup
from .control import RunControl
from .deadlines import retrying
from .errors import InvalidInput, LeaseLost, UsageError
from .waits import Waits

__all__ = ["TURN_ROLE", "Attempt", "Op"]

T = TypeVar("T")
Op = Callable[[psycopg.AsyncConnection[Any], int], Awaitable[T]]
# The role of a model turn's message: each one counts against the budget's max_turns.
TURN_ROLE = "assistant"


class Attempt:
    """The base of runpool.Run: its constructor, state and write primitives (the handler's
    methods are Run's, runpool.context, and ToolCalls', runpool.toolcalls)."""

    def __init__(
        self,
        *,
        id: uuid.UUID,
        tenant: str,
        handler: str,
        attempt: int,
        input: Any,
        pool: AsyncConnectionPool | None = None,
        max_message_bytes: int = 1 << 20,
        write_timeout: float = 30.0,
        messages: Sequence[Message] = (),
        tool_calls: dict[str, ToolCall] | None = None,
        control: RunControl | None = None,
        progress: Callable[[uuid.UUID, int, bytes], None] | None = None,
        budget: Mapping[str, Any] | None = None,
        usage: Mapping[str, Any] | None = None,
        traceparent: str | None = None,
        short_sleep: float = 0.0,
        commits: CommitGroup | None = None,
    ) -> None:
        self.id = id
        self.tenant = tenant
        self.handler = handler
        self.attempt = attempt
        self.input = input
        self._pool = pool
        # The worker's group commit of checkpoint writes (None: each write commits alone).
        self._commits = commits
        self._max_bytes = max_message_bytes
        self._write_timeout = write_timeout
        self._messages = list(messages)
        self._calls = dict(tool_calls or {})
        self._progress = progress  # the worker's progress outbox (see runpool.progress)
        # Calls being executed in this attempt: (name, arguments as committed, the outcome
        # other callers share).
        self._inflight: dict[str, tuple[str, Any, asyncio.Future[Any]]] = {}
        # Writes of one run are serialised: the message sequence is max + 1 under the fence.
        self._write_lock = asyncio.Lock()
        # The worker's flags for this attempt (cancelled, lease lost, closed, lease clock) and
        # its threads; a Run made by hand (a test, a script) gets its own, never set.
        if control is None:
            control = RunControl(asyncio.get_running_loop(), f"runpool-run-{id}")
        self._control = control
        self._loop = control.loop
        # The budget and the run's totals so far (turns counted from the committed history).
        self._meter = costs.Meter(budget, usage,
                                  sum(m.role == TURN_ROLE for m in self._messages))
        # For the durable waits and children (see _waits); sleeps under `short_sleep` seconds
        # stay in the slot.
        self._traceparent = traceparent
        self._short_sleep = short_sleep
        self._made_waits: Waits | None = None

    @property
    def _waits(self) -> Waits:
        """The attempt's durable waits and children (runpool.waits), made at the first use:
        most attempts never wait, and the Waits refers back to this Run, a reference cycle
        only the cyclic GC frees (15 objects per run, collected in every worker's gen-0 and
        gen-1 passes, see runpool.runner)."""
        if self._made_waits is None:
            self._made_waits = Waits(
                run_id=self.id, tenant=self.tenant, attempt=self.attempt,
                traceparent=self._traceparent, short_sleep=self._short_sleep,
                write=self._fenced, suspend=self._control.suspend,
                cancelled=lambda: self.cancelled)
        return self._made_waits

    # -- state set by the worker -----------------------------------------------------------

    @property
    def cancelled(self) -> bool:
        """True once a cancellation of this run reached the worker."""
        return self._control.cancelled

    # -- the conversation ------------------------------------------------------------------

    @property
    def messages(self) -> list[Message]:
        """The committed conversation, oldest first (restored on resume)."""
        return list(self._messages)

    @property
    def tool_calls(self) -> dict[str, ToolCall]:
        """Tool calls recorded so far (restored on resume), by call id."""
        return dict(self._calls)

    def _encode(self, value: Any, what: str) -> tuple[bytes, Any]:
        """The value's JSON text, and the value as it is committed (and read back on resume).
        InvalidInput: not JSON, NUL, lone surrogate, huge integer, over the size limit."""
        data, committed = encode(value)
        if len(data) > self._max_bytes:
            raise InvalidInput(f"{what} is {len(data)} bytes, over the limit of"
                               f" {self._max_bytes} bytes (RUNPOOL_MAX_MESSAGE_BYTES)")
        return data, committed

    def _writable(self) -> AsyncConnectionPool:
        if self._control.lost:
            raise LeaseLost(f"attempt {self.attempt} of run {self.id} lost its lease")
        if self._pool is None:
            raise UsageError("this Run is not attached to a database")
        return self._pool

    # -- the fenced write ------------------------------------------------------------------

    async def _db(self, pool: AsyncConnectionPool, what: str, op: Op[T],
                  statement: Statement | None = None) -> T:
        """A checkpoint write (each is safe to repeat, see checkpoints.store), on another
        connection if its first one broke: a finished tool's result is never thrown away
        because the pool handed out a connection the server had closed. `statement`: the
        write's first try as one statement, which group commit sends with others at once."""
        try:
            if self._commits is not None:
                return await self._commits.write(  # type: ignore[no-any-return]
                    op, self._write_timeout, what=what, log={"run_id": str(self.id)},
                    statement=statement, run_id=self.id)
            return await retrying(pool, self._write_timeout, op, what=what,
                                  log={"run_id": str(self.id)})
        except LeaseLost:
            self._control.lose()
            raise

    def _call_count(self) -> int:
        return len(self._calls.keys() | self._inflight.keys())

    def _stopped(self) -> str | None:
        c = self._control
        if c.cancelled or c.lost or c.closed is not None:
            return f"run {self.id} was stopped: {c.closed or 'cancelled or lease lost'}"
        return None

    async def _fenced(self, what: str, op: Op[T]) -> T:
        """A wait's or a spawn's write: after the tool calls in flight (their results are
        committed first), under the write lock."""
        pool = self._writable()
        while self._inflight:
            await asyncio.wait([shared for _, _, shared in self._inflight.values()])
        async with self._write_lock:
            return await self._db(pool, what, op)
