"""The handlers the benchmark workloads run (`runpool.harness.benchapp:app`, and W13's
progress emitters: `runpool.harness.benchapp:progress_app`)."""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

from ..app import App
from ..context import Run
from . import pauses

__all__ = ["app", "progress_app"]

app = App()


@app.handler("noop")
async def noop(run: Run) -> Any:
    return None


@app.handler("stamp")
async def stamp(run: Run) -> Any:
    """Returns when the handler started, for wake-up latency."""
    return time.time()


@app.handler("sleep")
async def sleep(run: Run) -> Any:
    await asyncio.sleep(float(run.input["seconds"]))
    return None


async def _noop_tool(arguments: Any, key: str) -> Any:
    return {"ok": arguments["i"]}


@app.handler("tool_loop")
async def tool_loop(run: Run) -> Any:
    """W7/W8: `calls` no-op tool calls. Returns each call's overhead (ms); with `crash`, the
    first attempt dies after its calls, and the second reports how long resume took."""
    calls = int(run.input["calls"])
    began = time.time()
    overheads = []
    for i in range(calls):
        t0 = time.perf_counter()
        await run.tool(f"c{i}", "noop", {"i": i}, _noop_tool)
        overheads.append((time.perf_counter() - t0) * 1000)
    if run.input.get("crash") and run.attempt == 1:
        os._exit(1)
    if run.attempt > 1:
        # Every call above was a checkpoint hit; this is the first new one.
        await run.tool("new", "noop", {"i": -1}, _noop_tool)
        return {"handler_started": began, "first_new_call": time.time()}
    return {"overheads_ms": overheads}


@app.handler("await_cancel")
async def await_cancel(run: Run) -> Any:
    """W9: waits to be cancelled and records when it saw the cancellation."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await run.add_message("system", {"seen": time.time()})
        raise
    return None


@app.handler("beat")
async def beat(run: Run) -> Any:
    """W12: `messages` messages, `gap` seconds apart; each says when the one before it was
    committed (the commit acknowledged here), so a follower can tell each one's delay."""
    committed = None
    for i in range(int(run.input["messages"]) + 1):
        await run.add_message("assistant", {"i": i, "previous_committed": committed})
        committed = time.time()
        await asyncio.sleep(float(run.input["gap"]))
    return None


# W13's progress emitters run on a pool of their own (this app), so the W1 pool never claims them.
progress_app = App()


@progress_app.handler("emit")
async def emit(run: Run) -> Any:
    """W13: `rate` progress events a second (0: none) for `seconds`."""
    rate, until = float(run.input["rate"]), time.monotonic() + float(run.input["seconds"])
    i = 0
    while time.monotonic() < until:
        if rate:
            await run.progress({"token": i, "text": "lorem ipsum " * 4})
        i += 1
        await asyncio.sleep(1 / rate if rate else 0.05)
    return None


@app.handler("rate_loop")
async def rate_loop(run: Run) -> Any:
    """W15: `probes` acquires of a key that always admits at once (the statement's overhead,
    ms), then acquires of `key` for `seconds`, reporting when each was admitted."""
    overheads = []
    for _ in range(int(run.input["probes"])):
        t0 = time.perf_counter()
        await run.acquire(run.input["free_key"])
        overheads.append((time.perf_counter() - t0) * 1000)
    admitted, planned = [], []
    end = time.time() + float(run.input["seconds"])
    while time.time() < end:
        asked = time.time()
        wait = await run.acquire(run.input["key"])
        admitted.append(time.time())
        planned.append(asked + wait)
    return {"overheads_ms": overheads, "admitted": admitted, "planned": planned}


@app.handler("await_signal")
async def await_signal(run: Run) -> Any:
    """W14: waits (out of its slot) for signal "go"; returns when it saw it."""
    await run.wait_for("go")
    return time.time()


async def _lookup(arguments: Any, key: str) -> Any:
    return {"turn": arguments["turn"], "hits": ["a result line of a search tool"] * 3}


@app.handler("agent")
async def agent(run: Run) -> Any:
    """W11: `turns` agent turns: a model call (a sleep of `low`..`high` s), one tool call with
    its checkpoint, and a message. Returns each tool call's time (its intent's write, the tool,
    its checkpoint's write), its checkpoint's write time (the tool's return to the call's:
    the result committed with its message) and each message's write time (ms); and, to tell
    where a slow write's time went, how late each model call's sleep ended (the worker's event
    loop busy elsewhere: its CPU; ~1 ms even idle, the timers' granularity) and how long
    garbage collections stopped the process during each checkpoint write. A turn whose tool
    call an earlier attempt committed is replayed (the tool is not called, its checkpoint not
    written again; its message is): it has no checkpoint or collection time."""
    pauses.watch()
    turns, low, high = int(run.input["turns"]), float(run.input["low"]), float(run.input["high"])
    rng = random.Random(str(run.id))
    tool_ms, checkpoint_ms, message_ms, lag_ms, gc_ms = [], [], [], [], []
    returned: list[float | None] = [None]

    async def lookup(arguments: Any, key: str) -> Any:
        found = await _lookup(arguments, key)
        returned[0] = time.perf_counter()
        return found

    for turn in range(turns):
        model = rng.uniform(low, high)
        slept = time.perf_counter()
        await asyncio.sleep(model)
        t0 = time.perf_counter()
        returned[0] = None
        found = await run.tool(f"t{turn}", "search", {"turn": turn}, lookup)
        t1 = time.perf_counter()
        await run.add_message("assistant", {"turn": turn, "read": len(found["hits"])})
        tool_ms.append(round((t1 - t0) * 1000, 3))
        message_ms.append(round((time.perf_counter() - t1) * 1000, 3))
        lag_ms.append(round(max(t0 - slept - model, 0.0) * 1000, 3))
        if (tool_returned := returned[0]) is not None:
            checkpoint_ms.append(round((t1 - tool_returned) * 1000, 3))
            gc_ms.append(round(pauses.paused_ms(tool_returned, t1), 3))
    return {"tool_ms": tool_ms, "checkpoint_ms": checkpoint_ms, "message_ms": message_ms,
            "lag_ms": lag_ms, "gc_ms": gc_ms}
