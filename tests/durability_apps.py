"""Handlers for the durability tests (issue 22), added to the tests' app."""

from __future__ import annotations

import asyncio
import math
import os
import time
from datetime import UTC, datetime
from typing import Any

import runpool
from runpool.testing import record_execution
from tests.apps import app

__all__ = ["app"]


def _recording(run: runpool.Run, value: Any = None, seconds: float = 0.0,
               exit_in_attempt_1: bool = False) -> Any:
    """A tool that records each real execution (tool_log) and returns `value`."""
    def tool(arguments: Any, key: str) -> Any:
        record_execution(os.environ["RUNPOOL_DSN"], run.id, key.split(":", 1)[1],
                         run.attempt, key)
        if exit_in_attempt_1 and run.attempt == 1:
            os._exit(1)  # the side effect happened; the worker dies before committing
        time.sleep(seconds)
        return arguments if value is None else value
    return tool


@app.handler("slow_tools")
async def slow_tools(run: runpool.Run) -> Any:
    """`steps` tool calls of `tool_seconds` each, unsafe to retry when `unsafe`."""
    unsafe = bool(run.input.get("unsafe", False))
    seconds = float(run.input.get("tool_seconds", 0))
    results = []
    for i in range(int(run.input.get("steps", 2))):
        if sum(m.role == "assistant" for m in run.messages) <= i:
            await run.add_message("assistant", {"turn": i})
        tool = _recording(run, seconds=seconds, exit_in_attempt_1=i == run.input.get("crash_in"))
        results.append(await run.tool(f"c{i}", "lookup", {"i": i}, tool,
                                      retry_interrupted=not unsafe))
    return {"attempt": run.attempt, "results": results}


@app.handler("tool_error")
async def tool_error(run: runpool.Run) -> Any:
    """A tool failing in attempt 1 (its error is committed); the handler gives up on it."""
    def fetch(arguments: Any, key: str) -> Any:
        record_execution(os.environ["RUNPOOL_DSN"], run.id, "c0", run.attempt, key)
        if run.attempt == 1:
            raise ConnectionError("upstream unavailable")
        return {"fetched": True}

    result = await run.tool("c0", "fetch", {}, fetch)
    if "error" in result:
        raise RuntimeError(f"the tool failed: {result['error']['message']}")
    return result


@app.handler("reuse_call_id")
async def reuse_call_id(run: runpool.Run) -> Any:
    """A model that reuses `call_0` for another tool (in the same attempt, or the next one
    after a crash mid-call)."""
    ran: list[str] = []

    def search(arguments: Any, key: str) -> Any:
        ran.append("search")
        if run.input.get("crash"):
            os._exit(1)
        return {"hits": 1}

    def delete_file(arguments: Any, key: str) -> Any:
        ran.append("delete_file")
        return "deleted"

    if not run.input.get("crash") or run.attempt == 1:
        await run.tool("call_0", "search", {"q": "x"}, search)
    try:
        second = await run.tool("call_0", "delete_file", {"path": "/tmp/x"}, delete_file)
    except runpool.InvalidInput as exc:
        second = f"InvalidInput: {exc}"
    return {"second": second, "ran": ran}


@app.handler("same_call_twice")
async def same_call_twice(run: runpool.Run) -> Any:
    """The same call id awaited twice at once."""
    tool = _recording(run, value={"done": True}, seconds=0.5)
    outcomes = await asyncio.gather(
        run.tool("c0", "slow", {}, tool, retry_interrupted=False),
        run.tool("c0", "slow", {}, tool, retry_interrupted=False),
        return_exceptions=True)
    return [o if not isinstance(o, BaseException) else repr(o) for o in outcomes]


@app.handler("json_values")
async def json_values(run: runpool.Run) -> Any:
    """Tools returning a tuple, a datetime and NaN; what the handler sees of them, by type."""
    values = {"tuple": (1, 2), "datetime": datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
              "nan": math.nan}
    seen = {}
    for name, value in values.items():
        got = await run.tool(name, "make", {}, lambda a, k, v=value: v)
        seen[name] = [type(got).__name__, got if name != "nan" else None]
    tools = [m.content for m in run.messages if m.role == "tool"]
    seen["messages"] = [type(c).__name__ for c in tools]
    if run.attempt == 1 and run.input.get("crash"):
        await run.add_message("user", {"seen": seen})
        os._exit(1)  # resume: attempt 2 must see the very same values
    return seen


@app.handler("slow_commit")
async def slow_commit(run: runpool.Run) -> Any:
    """One quick tool whose result the test database commits slowly (a trigger sleeps), then
    a long wait to be cancelled in."""
    await run.tool("c0", "quick", {}, _recording(run, value={"slow_commit": True}),
                   retry_interrupted=False)
    await asyncio.sleep(60)
    return "not cancelled"


@app.handler("poison_result")
async def poison_result(run: runpool.Run) -> Any:
    """A result the test database's trigger refuses (see test_durability)."""
    return {"poison": True, "sqlstate": run.input.get("sqlstate")}
