"""A worker's shutdown: its runs in flight finish within the grace, or are stopped and
released back to the queue; a run whose thread cannot be stopped keeps its lease until the
worker exits (the reaper reclaims it then)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Final

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

    def open_ends(*, given_up: bool = True) -> set[asyncio.Task[None]]:
        # Looked at again on every pass: a run forced to its end is done when that end is
        # written (its task may never end), and that write may begin during the drain.
        ends = {runner.stops.ending(s) if runner is not None else s.task
                for s in slots if given_up or not s.given_up}
        return {t for t in ends if not t.done()}

    if len(slots) and not any(e.is_set() for e in hurry):
        logger.info("draining %d runs for up to %.1fs", len(slots), grace,
                    extra={"action": "drain", **log})
        aborted = [asyncio.ensure_future(e.wait()) for e in hurry]
        await _until_ended(open_ends, grace, aborted)
        for waiter in aborted:
            waiter.cancel()
    unfinished = [s for s in slots if not s.finishing]
    for slot in unfinished:
        slot.shut_down()
    await _until_ended(lambda: open_ends(given_up=False), 5.0, [])
    # Decided once: a thread ending after this is left to its lease too (safe either way).
    stuck = [s for s in slots if s.threads_running]
    if stuck and runner is not None:
        runner.stops.give_up([s for s in stuck if not s.given_up], "outlived the drain")
    held = {s.claimed.id for s in stuck}
    await _release([s for s in unfinished if s.stop_reason is StopReason.SHUTDOWN
                    and s.claimed.id not in held], pool, worker_id=worker_id, log=log)
    # The stuck runs' tasks stay (their leases renewed) until the worker's last moment;
    # asyncio.run cancels them then, and they no longer wait for their threads.


# How often a drain looks again at what it waits for (a forced end's write may begin).
_RECHECK_SECONDS: Final = 0.25


async def _until_ended(open_ends: Callable[[], set[asyncio.Task[None]]], seconds: float,
                       aborted: Sequence[asyncio.Future[Any]]) -> None:
    """Until every end `open_ends` names is done, `seconds` pass, or one of `aborted` fires."""
    deadline = time.monotonic() + seconds
    while ((ends := open_ends()) and not any(a.done() for a in aborted)
           and (left := deadline - time.monotonic()) > 0):
        await asyncio.wait([*ends, *aborted], timeout=min(left, _RECHECK_SECONDS),
                           return_when=asyncio.FIRST_COMPLETED)


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
