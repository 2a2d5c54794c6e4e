"""Run: what a handler receives — the run's identity, its committed conversation, and the
fenced ways to add to it (messages and checkpointed tool calls)."""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import Any, TypeVar

import orjson
import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

import checkpoints
from checkpoints import CallMismatch, Message, ToolCall

from . import costs, faults, telemetry
from .commits import CommitGroup
from .control import RunControl
from .db import dumps, jsonb, loads, retrying, transient
from .errors import InvalidInput, LeaseLost, ToolOutcomeUnknown, UsageError
from .limits import NAME_MAX_LENGTH
from .progress import encode as encode_progress
from .tasks import finish_anyway
from .waits import WaitMethods, Waits

__all__ = ["Run", "ToolFn"]

ToolFn = Callable[[Any, str], Any] | Callable[[Any, str], Awaitable[Any]]
T = TypeVar("T")
Op = Callable[[psycopg.AsyncConnection[Any], int], Awaitable[T]]
UNKNOWN: dict[str, Any] = {"outcome": "unknown"}
# The role of a model turn's message: each one counts against the budget's max_turns.
TURN_ROLE = "assistant"


def _same_call(name: str, arguments: Any, other_name: str, other_arguments: Any) -> bool:
    """Whether two calls are the same: same tool name, same JSON arguments (key order aside).
    Computed only when a call id is seen again, not on every call."""
    def canonical(value: Any) -> bytes:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)

    return name == other_name and canonical(arguments) == canonical(other_arguments)


class Run(WaitMethods):
    """One attempt of a run, as its handler sees it.

    The worker owns this attempt: it sets the cancellation and lease-loss flags (from a NOTIFY,
    a heartbeat or its lease clock) on the attempt's RunControl, which this Run reads; the
    handler reads them too and calls the methods below. `control` is the worker's internal
    interface (runpool.control): a Run made by hand, in a test say, leaves it out.
    """

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
        self._loop = asyncio.get_running_loop()
        # The worker's flags for this attempt (cancelled, lease lost, closed, lease clock) and
        # its threads; a Run made by hand (a test, a script) gets its own, never set.
        self._control = (control if control is not None
                         else RunControl(self._loop, f"runpool-run-{id}"))
        # The budget and the run's totals so far (turns counted from the committed history).
        self._meter = costs.Meter(budget, usage,
                                  sum(m.role == TURN_ROLE for m in self._messages))
        # Durable waits and children (runpool.waits); sleeps under `short_sleep` seconds stay
        # in the slot.
        self._waits = Waits(run_id=id, tenant=tenant, attempt=attempt, traceparent=traceparent,
                            short_sleep=short_sleep, write=self._fenced,
                            suspend=self._control.suspend, cancelled=lambda: self.cancelled)

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

    def _encode(self, value: Any, what: str) -> bytes:
        data = dumps(value)  # InvalidInput: not JSON, NUL, lone surrogate, huge integer
        if len(data) > self._max_bytes:
            raise InvalidInput(f"{what} is {len(data)} bytes, over the limit of"
                               f" {self._max_bytes} bytes (RUNPOOL_MAX_MESSAGE_BYTES)")
        return data

    def _writable(self) -> AsyncConnectionPool:
        if self._control.lost:
            raise LeaseLost(f"attempt {self.attempt} of run {self.id} lost its lease")
        if self._pool is None:
            raise UsageError("this Run is not attached to a database")
        return self._pool

    async def _db(self, pool: AsyncConnectionPool, what: str, op: Op[T]) -> T:
        """A checkpoint write (each is safe to repeat, see checkpoints.store), on another
        connection if its first one broke: a finished tool's result is never thrown away
        because the pool handed out a connection the server had closed."""
        try:
            if self._commits is not None:
                return await self._commits.write(  # type: ignore[no-any-return]
                    op, self._write_timeout, what=what, log={"run_id": str(self.id)})
            return await retrying(pool, self._write_timeout, op, what=what,
                                  log={"run_id": str(self.id)})
        except LeaseLost:
            self._control.lose()
            raise

    async def add_message(self, role: str, content: Any) -> Message:
        """Commit one message to the conversation (fenced by the lease)."""
        if not isinstance(role, str) or not 1 <= len(role) <= 64 or "\x00" in role:
            raise InvalidInput("message role must be 1 to 64 characters, without NUL")
        data = self._encode(content, "message content")
        pool = self._writable()

        async def append(conn: psycopg.AsyncConnection[Any], tries: int) -> int:
            if tries:  # the earlier try may have committed before its connection broke
                seq = await checkpoints.find_message(
                    conn, self.id, self.attempt, after, role, jsonb(data))
                if seq is not None:
                    return seq
            return await checkpoints.append_message(
                conn, self.id, self.attempt, role, jsonb(data))

        turn = role == TURN_ROLE
        async with self._write_lock:
            if turn and self._meter.budget:
                # A turn over max_turns (or past a spent budget) is refused before it is written;
                # other messages (a wrap-up note, say) are always accepted.
                self._meter.check(self._call_count(), more_turns=1)
            after = self._messages[-1].seq if self._messages else 0
            seq = await self._db(pool, "message write", append)
            if turn:
                self._meter.turned()
        # The committed JSON value, the same as a resumed attempt will read.
        message = Message(seq, role, loads(data), self.attempt)
        self._messages.append(message)
        return message

    # -- tool calls ------------------------------------------------------------------------

    async def tool(self, call_id: str, name: str, arguments: Any, fn: ToolFn, *,
                   retry_interrupted: bool = True) -> Any:
        """Run a tool at most once per committed call_id and return its (committed) result:
        the committed JSON value, the same in every attempt (a tuple comes back as a list).

        - a call_id names one call: reusing it with another tool name or other arguments raises
          InvalidInput and runs nothing; awaited twice at once, the tool runs once and both
          callers get its result;

        - committed in an earlier attempt: its stored result is returned; fn is not called;
        - never started: the intent is committed, fn(arguments, idempotency_key) runs, and its
          result, the tool message and the checkpoint are committed in one transaction;
        - started earlier but never committed (the worker died mid-call): fn runs again, or,
          with retry_interrupted=False, ToolOutcomeUnknown is raised for the agent to handle;
        - fn raising: {"error": {"type", "message"}} is committed as the result, so the model
          sees the failure; so is a result that cannot be stored (not JSON, NUL characters, or
          over RUNPOOL_MAX_MESSAGE_BYTES).
        """
        for what, value in (("call_id", call_id), ("name", name)):
            if not isinstance(value, str) or not 1 <= len(value) <= NAME_MAX_LENGTH \
                    or "\x00" in value:
                raise InvalidInput(
                    f"tool {what} must be 1 to {NAME_MAX_LENGTH} characters, without NUL")
        args = self._encode(arguments, "tool arguments")
        committed_args = loads(args)
        prior = self._calls.get(call_id)
        if prior is not None and not _same_call(prior.name, prior.arguments,
                                                name, committed_args):
            raise InvalidInput(str(CallMismatch(call_id)))
        shared = self._inflight.get(call_id)
        if shared is not None:
            if not _same_call(shared[0], shared[1], name, committed_args):
                raise InvalidInput(str(CallMismatch(call_id)))
            # The same call awaited twice at once: it runs once, both get its outcome.
            return await asyncio.shield(shared[2])
        if prior is not None and prior.committed:
            # Resume is visible in the trace as an event, not as a new execution.
            telemetry.event("runpool.checkpoint.hit", **{
                telemetry.GENAI_TOOL_CALL_ID: call_id, telemetry.GENAI_TOOL_NAME: name})
            return prior.result
        if prior is not None and prior.status == "unknown":
            raise ToolOutcomeUnknown(call_id)
        if self.cancelled:
            # A cancelled run starts no new tool calls (sync handlers reach here too).
            raise asyncio.CancelledError(f"run {self.id} was cancelled")
        if self._meter.budget:
            # Before the tool runs: a new call one over max_tool_calls (or any call once the
            # budget is spent) raises instead.
            self._meter.check(self._call_count(), more_calls=prior is None)
        pool = self._writable()
        # Registered before the first await, so a second caller finds it.
        outcome: asyncio.Future[Any] = self._loop.create_future()
        self._inflight[call_id] = (name, committed_args, outcome)
        try:
            with telemetry.tool_span(name, call_id) as span:
                result = await self._run_tool(pool, prior, call_id, name, arguments, args,
                                              committed_args, fn, retry_interrupted)
                if span is not None and isinstance(result, dict) and "error" in result:
                    span.set_status(telemetry.Status(telemetry.StatusCode.ERROR))
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                outcome.cancel()
            else:
                outcome.set_exception(exc)
                outcome.exception()  # retrieved: a sharer re-raises it, nobody else needs to
            raise
        else:
            outcome.set_result(result)
            return result
        finally:
            del self._inflight[call_id]

    async def _run_tool(self, pool: AsyncConnectionPool, prior: ToolCall | None, call_id: str,
                        name: str, arguments: Any, args: bytes, committed_args: Any,
                        fn: ToolFn, retry_interrupted: bool) -> Any:
        interrupted = prior is not None and prior.status == "started"
        try:
            if interrupted and not retry_interrupted:
                async with self._write_lock:
                    await self._db(pool, "tool call close", lambda conn, _: (
                        checkpoints.mark_tool_unknown(
                            conn, self.id, self.attempt, call_id, Jsonb(UNKNOWN))))
                self._remember(call_id, name, committed_args, "unknown", UNKNOWN)
                raise ToolOutcomeUnknown(call_id)
            async with self._write_lock:
                # Committed before the tool runs: a crash from here on leaves the evidence.
                await self._db(pool, "tool intent write", lambda conn, _: (
                    checkpoints.record_tool_intent(
                        conn, self.id, self.attempt, call_id, name, jsonb(args))))
        except CallMismatch as exc:
            raise InvalidInput(str(exc)) from None
        self._remember(call_id, name, committed_args, "started", None)
        faults.hit("tool.intended")
        # The intent's commit may be answered long after it was sent (the process was paused,
        # the network slow): by then a new attempt may be running this very call, so a tool
        # never starts once the lease may have run out on the local clock (the intent stays
        # 'started': the next attempt runs the tool, or reports ToolOutcomeUnknown).
        if time.monotonic() > self._control.lease_until:
            self._control.lose()
        self._writable()
        status, result = await self._execute(fn, arguments, f"{self.id}:{call_id}")
        faults.hit("tool.returned")
        try:
            data = self._encode(result, "tool result")
        except InvalidInput as exc:
            status, result = "failed", {"error": {"type": "ResultRejected",
                                                  "message": str(exc)}}
            data = dumps(result)
        # The tool has run: its result is committed even if a cancellation (a drain's end,
        # the watchdog, a cancel notice) arrives meanwhile; the cancellation comes after.
        value = await finish_anyway(self._commit(pool, call_id, name, committed_args, status, data))
        faults.hit("checkpoint.committed")
        return value

    async def _commit(self, pool: AsyncConnectionPool, call_id: str, name: str,
                      arguments: Any, status: str, data: bytes) -> Any:
        """Commit a finished call's outcome with its tool message; its committed JSON value."""
        async with self._write_lock:
            while True:
                try:
                    seq = await self._db(pool, "tool result commit", lambda conn, _: (
                        checkpoints.commit_tool_result(
                            conn, self.id, self.attempt, call_id, status=status,
                            result=jsonb(data), message_role="tool",
                            message_content=jsonb(data))))
                    break
                except Exception as exc:
                    # The tool has run: its result is worth waiting for (an outage longer
                    # than write_timeout) for as long as this attempt may hold its lease. A
                    # reclaim fences the write (LeaseLost); the worker's lease clock ends it.
                    if self._control.lost or not transient(exc):
                        raise
        # What the handler gets is the committed JSON value, the same as after a resume.
        value = loads(data)
        self._remember(call_id, name, arguments, status, value)
        self._messages.append(Message(seq, "tool", value, self.attempt, call_id))
        return value

    async def _execute(self, fn: ToolFn, arguments: Any, key: str) -> tuple[str, Any]:
        try:
            if inspect.iscoroutinefunction(fn):
                return "succeeded", await fn(arguments, key)
            value = await self._control.threads.call(fn, arguments, key)
            if inspect.isawaitable(value):
                value = await value
            return "succeeded", value
        except LeaseLost:
            raise
        except Exception as exc:
            # The tool's failure is part of the conversation: the model sees it and adapts.
            return "failed", {"error": {"type": type(exc).__name__, "message": str(exc)}}

    def _remember(self, call_id: str, name: str, arguments: Any, status: str,
                  result: Any) -> None:
        """Mirror in memory what was just committed (so repeated calls in this attempt hit)."""
        prior = self._calls.get(call_id)
        executions = (prior.executions if prior else 0) + (status == "started")
        now = datetime.now(UTC)
        self._calls[call_id] = ToolCall(
            call_id, name, arguments, status, result, self.attempt, max(executions, 1),
            prior.started_at if prior and status != "started" else now,
            None if status == "started" else now)

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

    def _call_count(self) -> int:
        return len(self._calls.keys() | self._inflight.keys())

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

    def _stopped(self) -> str | None:
        c = self._control
        if c.cancelled or c.lost or c.closed is not None:
            return f"run {self.id} was stopped: {c.closed or 'cancelled or lease lost'}"
        return None

    # -- durable waits and child runs: the methods are WaitMethods' (runpool.waits) ----------

    async def _fenced(self, what: str, op: Op[T]) -> T:
        """A wait's or a spawn's write: after the tool calls in flight (their results are
        committed first), under the write lock."""
        pool = self._writable()
        while self._inflight:
            await asyncio.wait([shared for _, _, shared in self._inflight.values()])
        async with self._write_lock:
            return await self._db(pool, what, op)

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
