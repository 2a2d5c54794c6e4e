"""ToolCalls: a run's checkpointed tool calls — each runs at most once per committed
call_id, its intent committed before it runs and its result with its tool message after."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import orjson
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

import checkpoints
from checkpoints import CallMismatch, Message, ToolCall

from . import faults, telemetry
from .attempt import Attempt
from .codec import encode, jsonb
from .deadlines import transient
from .errors import CODE_ERRORS, InvalidInput, LeaseLost, ToolOutcomeUnknown, describe, type_name
from .limits import check_name
from .tasks import finish_anyway

__all__ = ["ToolCalls", "ToolFn"]

ToolFn = Callable[[Any, str], Any] | Callable[[Any, str], Awaitable[Any]]
UNKNOWN: dict[str, Any] = {"outcome": "unknown"}


def _same_call(name: str, arguments: Any, other_name: str, other_arguments: Any) -> bool:
    """Whether two calls are the same: same tool name, same JSON arguments (key order aside).
    Computed only when a call id is seen again, not on every call."""
    def canonical(value: Any) -> bytes:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)

    return name == other_name and canonical(arguments) == canonical(other_arguments)


class ToolCalls(Attempt):
    """A Run's tool calls (runpool.Run inherits them)."""

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
        check_name(call_id, "tool call_id")
        check_name(name, "tool name")
        args, committed_args = self._encode(arguments, "tool arguments")
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
                intent = checkpoints.intent_write(self.id, self.attempt, call_id, name,
                                                  jsonb(args), encoded=args)
                await self._db(pool, "tool intent write", lambda conn, _: intent.run(conn),
                               intent)
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
            data, value = self._encode(result, "tool result")
        except InvalidInput as exc:
            status, result = "failed", {"error": {"type": "ResultRejected",
                                                  "message": str(exc)}}
            data, value = encode(result)
        # The tool has run: its result is committed even if a cancellation (a drain's end,
        # the watchdog, a cancel notice) arrives meanwhile; the cancellation comes after.
        await finish_anyway(self._commit(pool, call_id, name, committed_args, status, data, value))
        faults.hit("checkpoint.committed")
        return value  # the committed JSON value, the same as a resumed attempt gets

    async def _commit(self, pool: AsyncConnectionPool, call_id: str, name: str,
                      arguments: Any, status: str, data: bytes, value: Any) -> None:
        """Commit a finished call's outcome (`data`, the JSON text of `value`) with its tool
        message."""
        commit = checkpoints.result_write(self.id, self.attempt, call_id, status=status,
                                          result=jsonb(data), message_role="tool",
                                          message_content=jsonb(data),
                                          encoded=(data, data))
        async with self._write_lock:
            while True:
                try:
                    seq = await self._db(pool, "tool result commit",
                                         lambda conn, _: commit.run(conn), commit)
                    break
                except Exception as exc:
                    # The tool has run: its result is worth waiting for (an outage longer
                    # than write_timeout) for as long as this attempt may hold its lease. A
                    # reclaim fences the write (LeaseLost); the worker's lease clock ends it.
                    if self._control.lost or not transient(exc):
                        raise
        self._remember(call_id, name, arguments, status, value)
        self._messages.append(Message(seq, "tool", value, self.attempt, call_id))

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
        except CODE_ERRORS as exc:
            # The tool's failure is part of the conversation: the model sees it and adapts
            # (its text as describe() can say it: cut, NUL escaped, still the tool's).
            return "failed", {"error": {"type": type_name(exc), "message": describe(exc)}}

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
