"""Handlers for the cost-control tests (tests/test_cost.py) run by real worker processes."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import psycopg

import runpool

app = runpool.App()


@app.handler("hang")
async def hang(run: runpool.Run) -> Any:
    """Never ends by itself; records that it saw its cancellation (a timeout, a deadline)."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await run.add_message("system", {"stopped_in_attempt": run.attempt})
        raise
    return None


@app.handler("spend_tokens")
async def spend_tokens(run: runpool.Run) -> Any:
    """Records 60 tokens per model call until its budget stops it."""
    for _ in range(10):
        with run.model_call("openai:gpt-x"):
            await run.record_usage(model="openai:gpt-x", input_tokens=40, output_tokens=20,
                                   cost=0.01)
    return run.usage


@app.handler("spend_tokens_sync")
def spend_tokens_sync(run: runpool.Run) -> Any:
    """spend_tokens as a plain handler (record_usage_sync, in its thread)."""
    for _ in range(10):
        run.record_usage_sync(model="m", input_tokens=40, output_tokens=20, cost=0.01)
    return run.usage


@app.handler("call_tools")
async def call_tools(run: runpool.Run) -> Any:
    """Calls tools until its budget stops it."""
    def tool(arguments: Any, key: str) -> Any:
        return {"n": arguments["n"]}

    for n in range(10):
        await run.tool(f"c{n}", "count", {"n": n}, tool)
    return run.usage


@app.handler("take_turns")
async def take_turns(run: runpool.Run) -> Any:
    """Takes model turns until max_turns stops it, then wraps up (a message of another role
    is still accepted) and returns."""
    try:
        for n in range(10):
            await run.add_message("assistant", {"turn": n})
    except runpool.BudgetExceeded as exc:
        await run.add_message("system", {"wrapped_up": exc.limit})
        return {"stopped_by": exc.limit, "usage": run.usage}
    return {"stopped_by": None}


@app.handler("usage_then_die")
async def usage_then_die(run: runpool.Run) -> Any:
    """Records usage in every attempt; the first attempt's worker dies right after."""
    await run.record_usage(model="m", input_tokens=10, output_tokens=5, cost=0.25)
    if run.attempt == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return run.usage


@app.handler("acquire")
async def acquire(run: runpool.Run) -> Any:
    """Acquires its key, then logs the moment it was admitted and the one its reservation
    planned (this host's clock, which every pool of the test shares)."""
    asked = time.time()
    waited = await run.acquire(run.input["key"], run.input.get("units", 1))
    admitted = time.time()
    async with await psycopg.AsyncConnection.connect(os.environ["RUNPOOL_DSN"],
                                                     autocommit=True) as conn:
        await conn.execute("INSERT INTO rate_log (run_id, at, planned) VALUES (%s, %s, %s)",
                           (run.id, admitted, asked + waited))
    return {"admitted": True}


@app.handler("acquire_sync")
def acquire_sync(run: runpool.Run) -> Any:
    """A plain handler waiting for its key (it must stop waiting when cancelled)."""
    run.acquire_sync(run.input["key"], 1)
    return {"admitted": True}
