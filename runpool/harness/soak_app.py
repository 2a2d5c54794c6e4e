"""The soak's handlers (`bench --soak`): agent-like runs that checkpoint their tool calls and
record every execution, plain-def ones, runs that wait to be cancelled, fail once, or kill
their worker; and a second application, a mixed fleet's other pool."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any, Final

from ..app import App
from ..context import Run
from ..errors import ToolOutcomeUnknown
from ..testing.invariants import record_execution

__all__ = ["EXECUTIONS_DSN", "app", "other_app"]

app = App()
# A second application with a pool of its own (a mixed fleet): `app`'s pool must leave its
# runs alone, and they must all be run by this one.
other_app = App()

# Where tools record their executions: the database itself, not through the proxy, so the
# evidence survives the faults the soak injects.
EXECUTIONS_DSN: Final = "RUNPOOL_SOAK_EXECUTIONS_DSN"


@app.handler("agent")
async def agent(run: Run) -> Any:
    """Model turns and tool calls, checkpointed; `unsafe` tools are never retried blindly."""
    steps = int(run.input.get("steps", 3))
    unsafe = bool(run.input.get("unsafe", False))
    for i in range(steps):
        if sum(m.role == "assistant" for m in run.messages) <= i:
            await run.add_message("assistant", {"turn": i})
        try:
            await run.tool(f"c{i}", "act", {"i": i}, _act(run), retry_interrupted=not unsafe)
        except ToolOutcomeUnknown:
            await run.add_message("user", {"unknown": f"c{i}"})
    return {"steps": steps, "attempt": run.attempt}


def _act(run: Run) -> Callable[[Any, str], Any]:
    async def act(arguments: Any, key: str) -> Any:
        await asyncio.to_thread(record_execution, os.environ[EXECUTIONS_DSN], run.id,
                                f"c{arguments['i']}", run.attempt, key)
        await asyncio.sleep(float(run.input.get("tool_seconds", 0.05)))
        return {"done": arguments["i"]}
    return act


@app.handler("plain")
def plain(run: Run) -> Any:
    """A plain def (run in a thread): checkpointed calls of a plain tool (a thread of its own)
    through tool_sync, which refuses new calls after a cancel; a cleanup message if cancelled."""
    steps = int(run.input.get("steps", 3))
    for i in range(steps):
        if run.cancelled:
            run.add_message_sync("system", {"cancelled_before": i})
            return None
        run.tool_sync(f"c{i}", "act", {"i": i}, _act_plain(run))
    return {"steps": steps, "attempt": run.attempt}


def _act_plain(run: Run) -> Callable[[Any, str], Any]:
    def act(arguments: Any, key: str) -> Any:
        record_execution(os.environ[EXECUTIONS_DSN], run.id, f"c{arguments['i']}", run.attempt,
                         key)
        time.sleep(float(run.input.get("tool_seconds", 0.05)))
        return {"done": arguments["i"]}
    return act


@app.handler("hold")
async def hold(run: Run) -> Any:
    """Waits to be cancelled (for at most `seconds`)."""
    await asyncio.sleep(float(run.input.get("seconds", 8)))
    return None


@app.handler("flaky")
async def flaky(run: Run) -> Any:
    if run.attempt == 1:
        raise RuntimeError("fails on its first attempt")
    return None


@other_app.handler("other")
async def other(run: Run) -> Any:
    await asyncio.sleep(0.05)
    return {"attempt": run.attempt}


@app.handler("poison")
async def poison(run: Run) -> Any:
    """Kills its worker on every attempt: must end failed without hurting anyone else."""
    os._exit(3)
