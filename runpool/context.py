"""Run: what a handler receives — the run's identity, its committed conversation, and the
fenced ways to add to it (messages and checkpointed tool calls, runpool.toolcalls)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any, Final, TypeVar

import psycopg

import checkpoints
from checkpoints import Message

from . import costs, telemetry
from .attempt import TURN_ROLE
from .codec import jsonb
from .errors import UsageError
from .limits import check_name
from .progress import encode as encode_progress
from .toolcalls import ToolCalls, ToolFn
from .waits import WaitMethods

__all__ = ["Run", "ToolFn"]

T = TypeVar("T")

# The longest message role (the messages table's check).
ROLE_MAX_LENGTH: Final = 64


class Run(ToolCalls, WaitMethods):
    """One attempt of a run, as its handler sees it.

    The worker owns this attempt: it sets the cancellation and lease-loss flags (from a NOTIFY,
    a heartbeat or its lease clock) on the attempt's RunControl, which this Run reads; the
    handler reads them too and calls the methods below. `control` is the worker's internal
    interface (runpool.control): a Run made by hand, in a test say, leaves it out.
    """

    # -- the conversation ------------------------------------------------------------------

    async def add_message(self, role: str, content: Any) -> Message:
        """Commit one message to the conversation (fenced by the lease)."""
        check_name(role, "message role", ROLE_MAX_LENGTH)
        data, committed = self._encode(content, "message content")
        pool = self._writable()

        first = checkpoints.message_write(self.id, self.attempt, role, jsonb(data),
                                          encoded=data)

        async def append(conn: psycopg.AsyncConnection[Any], tries: int) -> int:
            if tries:  # the earlier try may have committed before its connection broke
                seq = await checkpoints.find_message(
                    conn, self.id, self.attempt, after, role, jsonb(data))
                if seq is not None:
                    return seq
            return await first.run(conn)

        turn = role == TURN_ROLE
        async with self._write_lock:
            if turn and self._meter.budget:
                # A turn over max_turns (or past a spent budget) is refused before it is written;
                # other messages (a wrap-up note, say) are always accepted.
                self._meter.check(self._call_count(), more_turns=1)
            after = self._messages[-1].seq if self._messages else 0
            seq = await self._db(pool, "message write", append, first)
            if turn:
                self._meter.turned()
        # The committed JSON value, the same as a resumed attempt will read.
        message = Message(seq, role, committed, self.attempt)
        self._messages.append(message)
        return message

    async def progress(self, data: Any) -> None:
        """Tell whoever follows the run now (not stored; coalesced, best effort): never
        waits, never fails the run once `data` is valid; InvalidInput (nothing sent) for data
        that is not JSON or over progress.MAX_PROGRESS_BYTES."""
        encoded = encode_progress(data)
        if self._progress is None:
            raise UsageError("this Run is not attached to a pool: nothing would hear its progress")
        if not self._control.lost:  # a zombie's progress would be dropped by the database anyway
            self._progress(self.id, self.attempt, encoded)
        # A yield, not a wait: a handler reporting in a loop that awaits nothing else would
        # otherwise hold the worker's event loop (its other runs, heartbeat, cancel notices).
        await asyncio.sleep(0)

    def model_call(self, model: str, provider: str | None = None
                   ) -> AbstractContextManager[Any]:
        """Wrap a model call: a `chat {model}` span (GenAI conventions) when tracing is on;
        record_usage inside it reports the call's tokens on that span."""
        return telemetry.model_span(model, provider)

    # -- cost --------------------------------------------------------------------------------

    @property
    def usage(self) -> dict[str, Any]:
        """The run's totals across its attempts: input_tokens, output_tokens, cost,
        tool_calls, turns."""
        return self._meter.totals(self._call_count()).as_dict()

    async def record_usage(self, *, model: str | None = None, input_tokens: int = 0,
                           output_tokens: int = 0, cost: float = 0.0,
                           provider: str | None = None) -> dict[str, Any]:
        """Add a model call's usage to the run's totals, committed and fenced by the lease (a
        zombie adds nothing); returns the totals. Raises BudgetExceeded once a total is over
        its maximum (the usage is recorded: it was spent)."""
        pool = self._writable()
        if provider is None and model and ":" in model:
            provider = model.split(":", 1)[0]
        calls = self._call_count()
        totals = await self._meter.record(
            lambda op: self._db(pool, "usage write", op), run_id=self.id, attempt=self.attempt,
            calls=calls, input_tokens=input_tokens, output_tokens=output_tokens, cost=cost)
        telemetry.usage(input_tokens, output_tokens, provider)
        self._meter.check(calls)
        return totals.as_dict()

    async def acquire(self, key: str, units: float = 1) -> float:
        """Wait until rate limit `key` (runpool.set_rate_limit) admits `units`: one statement
        reserves them, in arrival order across every host, then this waits holding nothing;
        returns the seconds the reservation said to wait (0: admitted at once). A cancelled
        (or timed-out) run stops waiting (CancelledError)."""
        pool = self._writable()
        return await costs.acquire(pool, self._write_timeout, key, units, self._stopped)

    # -- for plain (threaded) handlers -----------------------------------------------------

    def _sync(self, make: Callable[[], Awaitable[T]]) -> T:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:  # blocking the loop on itself would hang the whole worker
            raise UsageError("the *_sync methods are for plain `def` handlers; an async"
                               " handler awaits add_message() and tool()")
        closed = self._control.closed
        if closed is not None:
            # The worker is stopping this run (drain past its grace) or exiting: nothing more
            # of it may be written, and the loop may not answer any more.
            raise asyncio.CancelledError(f"run {self.id}: {closed}")
        coro = make()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]

    def add_message_sync(self, role: str, content: Any) -> Message:
        """add_message() for a plain `def` handler (which runs in a thread). Still accepted
        after a cancellation, within the cancel grace: it is how a plain handler records its
        cleanup."""
        return self._sync(lambda: self.add_message(role, content))

    def tool_sync(self, call_id: str, name: str, arguments: Any, fn: ToolFn, *,
                  retry_interrupted: bool = True) -> Any:
        """tool() for a plain `def` handler (which runs in a thread). After a cancellation it
        starts no new call: it raises CancelledError (a committed call still returns its
        stored result)."""
        return self._sync(lambda: self.tool(call_id, name, arguments, fn,
                                            retry_interrupted=retry_interrupted))

    def progress_sync(self, data: Any) -> None:
        """progress() for a plain `def` handler (which runs in a thread)."""
        self._sync(lambda: self.progress(data))

    def record_usage_sync(self, *, model: str | None = None, input_tokens: int = 0,
                          output_tokens: int = 0, cost: float = 0.0,
                          provider: str | None = None) -> dict[str, Any]:
        """record_usage() for a plain `def` handler."""
        return self._sync(lambda: self.record_usage(
            model=model, input_tokens=input_tokens, output_tokens=output_tokens, cost=cost,
            provider=provider))

    def acquire_sync(self, key: str, units: float = 1) -> float:
        """acquire() for a plain `def` handler (it stops waiting when the run is stopped)."""
        return self._sync(lambda: self.acquire(key, units))

    def __repr__(self) -> str:
        return f"Run(id={self.id}, tenant={self.tenant!r}, attempt={self.attempt})"
