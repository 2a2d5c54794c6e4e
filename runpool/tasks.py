"""asyncio task helpers of the worker: background tasks kept referenced, and cancellation
that is repeated until the tasks have really ended."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any

__all__ = ["Background", "cancel_all"]


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
