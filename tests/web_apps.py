"""Handlers for the web console's tests: a run that talks until it is cancelled."""

from __future__ import annotations

import asyncio
from typing import Any

import runpool

app = runpool.App()


@app.handler("chat")
async def chat(run: runpool.Run) -> Any:
    """One assistant message every `every` seconds (a tool call every third), up to `turns`."""
    every = float(run.input.get("every", 0.3))
    for turn in range(int(run.input.get("turns", 400))):
        await run.add_message("assistant", f"turn {turn}: still thinking")
        if turn % 3 == 2:
            await run.tool(f"search-{turn}", "search", {"turn": turn}, _search)
        await asyncio.sleep(every)
    return {"turns": run.input.get("turns", 400)}


def _search(arguments: Any, key: str) -> Any:
    return {"hits": arguments["turn"] * 2}


@app.handler("fails")
async def fails(run: runpool.Run) -> Any:
    raise runpool.Fail("refused by handler")
