"""Handlers that wait durably (signals, sleeps, children), for tests/test_waits.py's real
pools. Their tools record each real execution (tool_log), so a test can show that no committed
call ran again across waits."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import runpool
from runpool.testing import record_execution

app = runpool.App()


def _tool(run: runpool.Run, call_id: str) -> Any:
    def tool(arguments: Any, key: str) -> Any:
        record_execution(os.environ["RUNPOOL_DSN"], run.id, call_id, run.attempt, key)
        return {"done": call_id, **arguments}
    return tool


@app.handler("approval")
async def approval(run: runpool.Run) -> Any:
    """Proposes a dangerous call, waits for `waits` approvals (one tool call after each), then
    makes the call if the last approval says so."""
    waits = int(run.input.get("waits", 1))
    timeout = run.input.get("timeout")
    await run.tool("draft", "draft_email", {"to": "boss"}, _tool(run, "draft"))
    payloads = []
    for i in range(waits):
        try:
            payload = await run.wait_for(run.input.get("name", "approval"), timeout=timeout)
        except runpool.WaitTimeout:
            if run.input.get("catch_timeout"):
                return {"timed_out": True, "attempt": run.attempt}
            raise
        payloads.append(payload)
        await run.tool(f"after{i}", "note", {"i": i}, _tool(run, f"after{i}"))
    if payloads[-1].get("approved"):
        await run.tool("send", "send_email", {"to": "boss"}, _tool(run, "send"))
    return {"payloads": payloads, "attempt": run.attempt}


@app.handler("sleeper")
async def sleeper(run: runpool.Run) -> Any:
    started = time.time()
    await run.sleep(float(run.input["seconds"]))
    return {"attempt": run.attempt, "slept_from": started}


@app.handler("child")
async def child(run: runpool.Run) -> Any:
    await asyncio.sleep(float(run.input.get("seconds", 0)))
    if run.input.get("fail"):
        raise runpool.Fail("the child failed")
    return {"child": run.input.get("n"), "parent": str(run.tenant)}


@app.handler("parent")
async def parent(run: runpool.Run) -> Any:
    """Spawns `children` children, then joins them."""
    ids = []
    for n in range(int(run.input.get("children", 2))):
        ids.append(await run.spawn(f"c{n}", "child", {"n": n, **run.input.get("child", {})}))
        if run.attempt == 1 and run.input.get("crash_after_spawn") == n:
            os._exit(1)  # the child is committed; the parent's worker dies before going on
    results = await run.join(ids, timeout=run.input.get("timeout"))
    return {"children": [{"id": str(r.id), "status": r.status, "result": r.result}
                         for r in results], "attempt": run.attempt}


@app.handler("stray_join")
async def stray_join(run: runpool.Run) -> Any:
    """Joins a run that is not its child (refused: InvalidInput, the run fails)."""
    await run.join([run.input["other"]])
    return {}


@app.handler("bad_wait")
async def bad_wait(run: runpool.Run) -> Any:
    await run.wait_for(run.input["name"], timeout=run.input.get("timeout"))
    return {}


@app.handler("signal_repr")
async def signal_repr(run: runpool.Run) -> Any:
    """Waits for signal `name`; answers the payload's repr (a result cannot hold every value a
    payload can: integers beyond 64 bits)."""
    return {"repr": repr(await run.wait_for(run.input["name"]))}


@app.handler("bare_except")
async def bare_except(run: runpool.Run) -> Any:
    """A sloppy retry loop around a wait: its bare except swallows Suspended (the wait is
    committed: the attempt is over), LeaseLost and cancellation alike, and tries again."""
    while True:
        try:
            return {"payload": await run.wait_for("go"), "attempt": run.attempt}
        except BaseException:  # the hostile handler this test is for
            try:
                await asyncio.sleep(0.2)
            except BaseException:
                pass
