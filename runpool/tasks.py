"""asyncio task helpers of the worker: background tasks kept referenced, and cancellation
that is repeated until the tasks have really ended."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine, Iterable
from typing import Any, TypeVar

__all__ = ["Background", "cancel_all", "finish_anyway"]

T = TypeVar("T")


class Background:
    """Fire-and-forget tasks, referenced until they end: a task nobody references may be
    collected mid-flight."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def cancel_all(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel tasks and wait until every one has ended. A cancellation can be swallowed:
    Python 3.11's wait_for (psycopg_pool's open and waits use it) returns a result that
    completed at the same moment instead of raising, so a task cancelled once may go on
    (a worker orphaned at its start hung on its heartbeat's pool opening). Cancel again."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=1.0)


async def finish_anyway(coro: Awaitable[T]) -> T:
    """Run `coro` to its end even if the caller is cancelled meanwhile (the cancellation is
    delivered after it): a finished tool's result must not be thrown away half-committed."""
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[T] = loop.create_future()

    async def run() -> None:
        try:
            value = await coro
        except BaseException as exc:  # handed to the caller, not left in the task
            if not outcome.done():
                outcome.set_exception(exc)
        else:
            if not outcome.done():
                outcome.set_result(value)

    # A task of its own (awaited through a plain future: one loop turn less than
    # asyncio.shield or asyncio.wait on the path every tool call takes, W7).
    task = loop.create_task(run())
    try:
        return await outcome
    except asyncio.CancelledError:
        # Cancelled while committing: finish the commit, then deliver the cancellation.
        while not task.done():
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:
                pass
        raise
