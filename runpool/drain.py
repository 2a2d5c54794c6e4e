"""A worker's shutdown: its runs in flight finish within the grace, or are stopped and
released back to the queue; a run whose thread cannot be stopped keeps its lease until the
worker exits (the reaper reclaims it then)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from psycopg_pool import AsyncConnectionPool

from .deadlines import bounded
from .queries import QUERIES
from .runner import SlotRunner
from .slot import Slot, Slots, StopReason

__all__ = ["drain"]

# The worker's logger: its drain is the worker's story.
logger = logging.getLogger("runpool.worker")


async def drain(slots: Slots, runner: SlotRunner | None, pool: AsyncConnectionPool | None, *,
                hurry: tuple[asyncio.Event, ...], grace: float, worker_id: uuid.UUID,
                log: dict[str, Any]) -> None:
    """Wait up to `grace` seconds for the runs in `slots` (none when any of `hurry` is set),
    then stop the rest and release them."""

    def ending(slot: Slot) -> asyncio.Task[None]:
        # A run forced to its end is done when that end is written (its task may never end).
        return runner.ending(slot) if runner is not None else slot.task

    tasks = {ending(s) for s in slots}
    if tasks and not any(e.is_set() for e in hurry):
        logger.info("draining %d runs for up to %.1fs", len(tasks), grace,
                    extra={"action": "drain", **log})
        deadline = time.monotonic() + grace
        aborted = [asyncio.ensure_future(e.wait()) for e in hurry]
        while (tasks and not any(e.is_set() for e in hurry)
               and (left := deadline - time.monotonic()) > 0):
            done, _ = await asyncio.wait(
                [*tasks, *aborted], timeout=left, return_when=asyncio.FIRST_COMPLETED)
            tasks -= done
        for waiter in aborted:
            waiter.cancel()
    unfinished = [s for s in slots if not s.finishing]
    for slot in unfinished:
        slot.shut_down()
    pending = [ending(s) for s in slots if not s.given_up]
    if pending:
        await asyncio.wait(pending, timeout=5)
    # Decided once: a thread ending after this is left to its lease too (safe either way).
    stuck = [s for s in slots if s.threads_running]
    if stuck and runner is not None:
        runner.give_up([s for s in stuck if not s.given_up], "outlived the drain")
    held = {s.claimed.id for s in stuck}
    await _release([s for s in unfinished if s.stop_reason is StopReason.SHUTDOWN
                    and s.claimed.id not in held], pool, worker_id=worker_id, log=log)
    # The stuck runs' tasks stay (their leases renewed) until the worker's last moment;
    # asyncio.run cancels them then, and they no longer wait for their threads.


async def _release(slots: list[Slot], pool: AsyncConnectionPool | None, *,
                   worker_id: uuid.UUID, log: dict[str, Any]) -> None:
    if not slots or pool is None:
        return
    try:
        async with bounded(pool, 5) as conn:
            await conn.execute(QUERIES["release_runs"], {
                "ids": [s.claimed.id for s in slots],
                "attempts": [s.claimed.attempt for s in slots],
                "worker_id": worker_id,
            })
        logger.info("released %d runs", len(slots), extra={"action": "runs_released", **log})
    except Exception as exc:
        logger.warning("could not release %d runs (their leases will expire): %s",
                       len(slots), exc, extra={"action": "release_failed", **log})
