"""Handlers used by the tests' real worker processes."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import runpool

app = runpool.App()


@app.handler("noop")
async def noop(run: runpool.Run) -> Any:
    return {"input": run.input, "attempt": run.attempt}


@app.handler("sleep")
async def sleep(run: runpool.Run) -> Any:
    await asyncio.sleep(float(run.input.get("seconds", 1)))
    return {"slept": run.input.get("seconds", 1), "attempt": run.attempt, "pid": os.getpid()}


@app.handler("sync_sleep")
def sync_sleep(run: runpool.Run) -> Any:
    time.sleep(float(run.input.get("seconds", 1)))
    return {"attempt": run.attempt}


@app.handler("flaky")
async def flaky(run: runpool.Run) -> Any:
    """Raises on the first `fail_times` attempts, then succeeds."""
    if run.attempt <= int(run.input.get("fail_times", 1)):
        raise RuntimeError(f"flaky failure on attempt {run.attempt}")
    return {"attempt": run.attempt}


@app.handler("always_raises")
async def always_raises(run: runpool.Run) -> Any:
    raise ValueError("this handler always raises")


@app.handler("fails")
async def fails(run: runpool.Run) -> Any:
    raise runpool.Fail("refused by handler")


@app.handler("unserialisable")
async def unserialisable(run: runpool.Run) -> Any:
    return {"a set": {1, 2, 3}}


@app.handler("nul_result")
async def nul_result(run: runpool.Run) -> Any:
    return {"text": "a\x00b"}


@app.handler("timestamp")
async def timestamp(run: runpool.Run) -> Any:
    return {"started": time.time()}
