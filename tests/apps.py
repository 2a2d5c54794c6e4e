"""Handlers used by the tests' real worker processes."""

from __future__ import annotations

import asyncio
import contextvars
import enum
import gc
import logging
import os
import sys
import time
from typing import Any

import orjson

import runpool
from runpool.testing import record_execution
from runpool.waits import Suspended

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


@app.handler("gc_state")
async def gc_state(run: runpool.Run) -> Any:
    return {"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count()}


@app.handler("timestamp")
async def timestamp(run: runpool.Run) -> Any:
    return {"started": time.time()}


# -- a scripted agent, for checkpoint and resume tests --------------------------------------
# Side tables (in every test database, see conftest): model_calls(run_id, turn, attempt)
# counts what a real model would have been paid for; tool_log every real tool execution.

def _log(query: str, params: tuple[Any, ...]) -> None:
    import psycopg

    with psycopg.connect(os.environ["RUNPOOL_DSN"], autocommit=True) as conn:
        conn.execute(query, params)


def _lookup_tool(run: runpool.Run) -> Any:
    def lookup(arguments: Any, key: str) -> Any:
        record_execution(os.environ["RUNPOOL_DSN"], run.id, f"c{arguments['i']}", run.attempt,
                         key)
        if run.attempt == 1 and arguments["i"] == run.input.get("crash_in_tool"):
            os._exit(1)  # the side effect happened; the worker dies before committing
        if arguments["i"] == run.input.get("raise_in_tool"):
            raise LookupError(f"nothing found for {arguments['i']}")
        if run.input.get("nul_in_result"):
            return {"text": "a\x00b"}
        if run.input.get("surrogate_in_result"):
            return {"text": "a\ud800b"}  # a lone surrogate: not valid Unicode text
        if run.input.get("fragment_in_result"):  # text spliced in unchecked by orjson
            return {"text": orjson.Fragment(run.input["fragment_in_result"].encode())}
        time.sleep(float(run.input.get("tool_seconds", 0)))
        return {"found": arguments["i"] * 10, **run.input.get("extra", {})}
    return lookup


@app.handler("agent")
async def agent(run: runpool.Run) -> Any:
    steps = int(run.input.get("steps", 3))
    unsafe = bool(run.input.get("unsafe", False))
    lookup = _lookup_tool(run)
    for i in range(steps):
        turns = [m for m in run.messages if m.role == "assistant"]
        if len(turns) <= i:
            # Only turns not yet committed call the (scripted) model.
            await asyncio.to_thread(_log, "INSERT INTO model_calls VALUES (%s, %s, %s)",
                                    (str(run.id), i, run.attempt))
            await run.add_message("assistant", {"turn": i, "tool_call": f"c{i}"})
        try:
            await run.tool(f"c{i}", "lookup", {"i": i}, lookup, retry_interrupted=not unsafe)
        except runpool.ToolOutcomeUnknown:
            await run.add_message("user", {"note": f"c{i} may or may not have happened"})
        if run.attempt == 1 and i == run.input.get("crash_after"):
            os._exit(1)  # right after the checkpoint commit
    return {"turns": steps, "messages": len(run.messages)}


class SneakyFloat(float, enum.Enum):
    """A float that orjson writes as its Enum value: a Fragment (an exact-type check sees
    through it, isinstance(value, float) did not)."""

    def __new__(cls, value: Any) -> SneakyFloat:
        member = float.__new__(cls, 0.0)
        member._value_ = value
        return member

    FORGED = orjson.Fragment(b'1},{"run_id":"00000000-0000-0000-0000-000000000000","x":{"a":1')


@app.handler("bad_names")
async def bad_names(run: runpool.Run) -> Any:
    """Each hostile name or value a handler's code could pass, and what it raised."""
    forged = orjson.Fragment(run.input["forged"].encode())
    tries: dict[str, Any] = {
        "role": lambda: run.add_message("a\ud800", {}),
        "content": lambda: run.add_message("assistant", {"text": forged}),
        "float_enum": lambda: run.add_message("assistant", SneakyFloat.FORGED),
        "call_id": lambda: run.tool("c\udfff", "lookup", {}, _lookup_tool(run)),
        "tool_name": lambda: run.tool("c0", "look\ud800", {}, _lookup_tool(run)),
        "arguments": lambda: run.tool("c0", "lookup", [forged], _lookup_tool(run)),
        "signal": lambda: run.wait_for("s\ud800", timeout=1),
        "spawn": lambda: run.spawn("k\ud800", "noop"),
        "cost_key": lambda: run.acquire("k\ud800"),
    }
    raised: dict[str, str | None] = {}
    for what, call in tries.items():
        try:
            await call()
            raised[what] = None
        except Exception as exc:
            raised[what] = f"{type(exc).__name__}: {exc}"
    message = await run.add_message("assistant", {"after": True})
    return {"raised": raised, "seq": message.seq}


class Unprintable(Exception):
    """Handler code's exception whose text cannot be had: its str() raises what the class
    says (`raises`), anything from RuntimeError to SystemExit."""

    raises: type[BaseException] = RuntimeError

    def __str__(self) -> str:
        raise self.raises("no text for you")


class EvilStr(str):
    """A str whose methods are not str's."""

    def replace(self, *args: Any, **kwargs: Any) -> str:
        raise RuntimeError("evil replace")


class Huge(Exception):
    def __str__(self) -> str:
        return "x" * 10_000_000


def _unprintable(raises: str) -> BaseException:
    kinds: dict[str, type[BaseException]] = {
        "RuntimeError": RuntimeError, "SystemExit": SystemExit,
        "KeyboardInterrupt": KeyboardInterrupt, "GeneratorExit": GeneratorExit,
        "CancelledError": asyncio.CancelledError}
    exc = Unprintable()
    exc.raises = kinds[raises]
    return exc


class FailNoReason(runpool.Fail):
    """A Fail whose reason cannot be read."""

    @property
    def reason(self) -> str:
        raise SystemExit("no reason")

    @reason.setter
    def reason(self, value: str) -> None:
        pass


@app.handler("escape_loop")
async def escape_loop(run: runpool.Run) -> Any:
    """Starts, outside any run's context, a task that calls sys.exit(): nothing contains it,
    and it leaves the worker's event loop; then waits, deaf to cancellation."""
    async def boom() -> None:
        sys.exit(9)

    loop = asyncio.get_running_loop()
    loop.call_soon(lambda: loop.create_task(boom()), context=contextvars.Context())
    # And it ignores being cancelled (a loop closed after the escape waits for it).
    end = loop.time() + 120
    while loop.time() < end:
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            pass
    return None


@app.handler("generator_exit")
def generator_exit(run: runpool.Run) -> Any:
    """A plain handler whose sync tool raises GeneratorExit (the tool's failure is read and
    the handler goes on), then raises GeneratorExit itself."""
    def tool(arguments: Any, key: str) -> Any:
        raise GeneratorExit("from the tool")

    found = run.tool_sync("c0", "genexit", {}, tool)
    run.add_message_sync("assistant", {"tool_said": found})
    raise GeneratorExit("from the handler")


@app.handler("unprintable")
async def unprintable(run: runpool.Run) -> Any:
    """Raises what cannot be put into words (`how`), after a tool call that raises an
    exception whose str() raises `tool` (async tools; `sync_tool`: a plain def one)."""
    raises = run.input.get("tool", "RuntimeError")

    async def broken(arguments: Any, key: str) -> Any:
        raise _unprintable(raises)

    def broken_sync(arguments: Any, key: str) -> Any:
        raise _unprintable(raises)

    found = await run.tool("c0", "broken", {}, broken_sync if run.input.get("sync_tool")
                           else broken)
    await run.add_message("assistant", {"tool_said": found})
    how = run.input["how"]
    if how in ("gather_exit", "wait_for_exit"):
        # sys.exit() in a task of the handler's own: asyncio lets it out of the loop.
        async def boom() -> None:
            sys.exit(7)

        await (asyncio.gather(boom()) if how == "gather_exit" else asyncio.wait_for(boom(), 5))
    if how == "suspended":  # the control flow of a committed wait, with no wait committed
        raise Suspended()
    if how == "cancelled":  # a CancelledError nobody's cancel caused
        raise asyncio.CancelledError()
    if how == "fail_no_reason":
        raise FailNoReason()
    if how == "fail_int":
        raise runpool.Fail(404)  # type: ignore[arg-type]  # what typed code cannot do
    if how == "fail_evil_str":
        raise runpool.Fail(EvilStr("evil reason"))
    if how == "huge":
        raise Huge()
    if how == "sys_exit":
        sys.exit(3)
    if how == "keyboard":
        raise KeyboardInterrupt()
    raise _unprintable(how)


@app.handler("agent_sync")
def agent_sync(run: runpool.Run) -> Any:
    run.add_message_sync("assistant", {"turn": 0})
    result = run.tool_sync("c0", "lookup", {"i": 0}, _lookup_tool(run))
    return {"result": result}


@app.handler("history_size")
async def history_size(run: runpool.Run) -> Any:
    """What a resumed attempt restored: counts, and whether both came back in order."""
    seqs = [m.seq for m in run.messages]
    started = [c.started_at for c in run.tool_calls.values()]
    return {"messages": len(seqs), "calls": len(started), "attempt": run.attempt,
            "in_order": seqs == sorted(seqs) and started == sorted(started)}


@app.handler("sized_result")
async def sized_result(run: runpool.Run) -> Any:
    return {"blob": "x" * int(run.input["bytes"])}


@app.handler("big_message")
async def big_message(run: runpool.Run) -> Any:
    await run.add_message("assistant", {"blob": "x" * 2_000_000})
    return None


# -- cancellation ---------------------------------------------------------------------------

@app.handler("hold")
async def hold(run: runpool.Run) -> Any:
    """Waits to be cancelled; cleans up (one message) when it is."""
    try:
        await asyncio.sleep(float(run.input.get("seconds", 120)))
    except asyncio.CancelledError:
        await run.add_message("system", {"cleanup_at": time.time(), "cancelled": run.cancelled})
        raise
    return "not cancelled"


@app.handler("hold_sync")
def hold_sync(run: runpool.Run) -> Any:
    """A plain handler making tool calls until cancelled."""
    def slow(arguments: Any, key: str) -> Any:
        time.sleep(0.1)
        return arguments

    for i in range(10_000):
        run.tool_sync(f"c{i}", "slow", {"i": i}, slow)
    return "not cancelled"


@app.handler("stubborn")
async def stubborn(run: runpool.Run) -> Any:
    """Ignores cancellation: swallows CancelledError and goes on sleeping."""
    while True:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            continue


@app.handler("late")
async def late(run: runpool.Run) -> Any:
    """Ignores cancellation for `seconds` after the first one, then returns all the same
    (`noted`: it writes a message first, which gives the run its event counter row)."""
    if run.input.get("noted"):
        await run.add_message("system", {"noted": True})
    returns_at: float | None = None
    while returns_at is None or time.monotonic() < returns_at:
        try:
            await asyncio.sleep(60 if returns_at is None else returns_at - time.monotonic())
        except asyncio.CancelledError:
            if returns_at is None:
                returns_at = time.monotonic() + float(run.input.get("seconds", 1))
    logging.getLogger("tests.apps").warning("late handler returns", extra={
        "action": "late_handler_returns"})
    return "returned late"


@app.handler("poison")
async def poison(run: runpool.Run) -> Any:
    """Kills the worker process on every attempt."""
    os._exit(3)


# -- plain-def handlers and tools that outlive their task (issue 21) ------------------------
# Side table plain_log (created by tests/test_plaindef.py): one row per step a thread really
# executed, stamped by the database clock, so executions can be checked for overlap.

def _tick(run: runpool.Run, what: str) -> None:
    _log("INSERT INTO plain_log (run_id, attempt, pid, what) VALUES (%s, %s, %s, %s)",
         (str(run.id), run.attempt, os.getpid(), what))


@app.handler("plain_steps")
def plain_steps(run: runpool.Run) -> Any:
    """Steps of `step` seconds in its thread, each logged. `honour`: on run.cancelled, takes
    `cleanup_seconds`, commits a cleanup message and returns; `writes`: commits a message per
    step (so a drain or lost lease reaches it through add_message_sync)."""
    steps = int(run.input.get("steps" if run.attempt == 1 else "later_steps", 10))
    for i in range(steps):
        _tick(run, f"step {i}")
        if run.input.get("honour") and run.cancelled:
            time.sleep(float(run.input.get("cleanup_seconds", 0)))
            run.add_message_sync("system", {"cleanup": True, "step": i})
            _tick(run, "cleaned up")
            return "stopped on cancel"
        if run.input.get("writes"):
            run.add_message_sync("assistant", {"step": i})
        time.sleep(float(run.input.get("step", 0.1)))
    return {"steps": steps, "attempt": run.attempt}


@app.handler("plain_tool")
async def plain_tool(run: runpool.Run) -> Any:
    """An async handler whose tool is a plain def (run in a thread) that ignores cancellation."""
    def slow(arguments: Any, key: str) -> Any:
        for i in range(int(arguments["steps"])):
            _tick(run, f"tool step {i}")
            time.sleep(0.1)
        return {"done": True}

    return await run.tool("c0", "slow", {"steps": run.input.get("steps", 20)}, slow)


@app.handler("tool_burst")
async def tool_burst(run: runpool.Run) -> Any:
    """Checkpointed tool calls back to back for `seconds` (no other await between them)."""
    until, calls = time.monotonic() + float(run.input["seconds"]), 0
    while time.monotonic() < until:
        await run.tool(f"c{calls}", "echo", {"i": calls}, _echo)
        calls += 1
    return {"calls": calls, "attempt": run.attempt}


@app.handler("input_types")
async def input_types(run: runpool.Run) -> Any:
    """Each input value's Python type and exact text (a >64-bit int cannot be returned as is)."""
    return {key: [type(value).__name__, str(value)] for key, value in run.input.items()}


# -- live runs --------------------------------------------------------------------------------

@app.handler("chatty")
async def chatty(run: runpool.Run) -> Any:
    """`steps` messages and tool calls, `gap` seconds apart; `progress` progress events per step;
    whether an oversized progress was refused (it must be, at once, with nothing sent)."""
    steps, gap = int(run.input.get("steps", 3)), float(run.input.get("gap", 0))
    for i in range(steps):
        if f"c{i}" in run.tool_calls and run.tool_calls[f"c{i}"].committed:
            continue
        await run.add_message("assistant", {"step": i, "run": str(run.id)})
        for p in range(int(run.input.get("progress", 0))):
            await run.progress({"step": i, "token": p})
        await run.tool(f"c{i}", "echo", {"i": i}, _echo)
        await asyncio.sleep(gap)
    try:
        await run.progress({"blob": "x" * 9000})
        refused = None
    except runpool.InvalidInput as exc:
        refused = str(exc)
    return {"steps": steps, "refused": refused}


async def _echo(arguments: Any, key: str) -> Any:
    return arguments


@app.handler("chatty_sync")
def chatty_sync(run: runpool.Run) -> Any:
    """A plain handler's progress (progress_sync), while it waits to be told to stop."""
    for i in range(int(run.input.get("ticks", 3000))):
        run.progress_sync({"tick": i})
        if run.cancelled:
            break
        time.sleep(0.01)
    return "done"


@app.handler("progress_spin")
async def progress_spin(run: runpool.Run) -> Any:
    """Reports progress in a loop until cancelled, awaiting nothing else."""
    i = 0
    while not run.cancelled:
        await run.progress({"i": i})
        i += 1
    return {"emitted": i}


@app.handler("logs")
async def logs(run: runpool.Run) -> Any:
    """Logs through the application's own logger, from its task and from a thread."""
    app_logger = logging.getLogger("tests.apps.agent")
    app_logger.info("thinking about %s", run.input.get("topic", "nothing"))
    await asyncio.to_thread(app_logger.warning, "from a thread")
    return {"logged": 2}
