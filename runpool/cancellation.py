"""Worker-side cancellation: a cancel notice (NOTIFY or heartbeat flag) becomes task
cancellation, a grace period, and a recorded `cancelled` outcome."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import psycopg

from .db import bounded
from .queries import QUERIES
from .slot import Slot

if TYPE_CHECKING:
    from .worker import Worker

__all__ = ["Canceller"]

logger = logging.getLogger("runpool.cancellation")

# Early cancel notices are kept this long, and at most this many (oldest dropped first): any
# login can NOTIFY, so a forged flood must cost constant work per notice and capped memory.
EARLY_SECONDS = 60.0
EARLY_MAX = 10_000
# Pause between two reads of one run's cancel flag while notices for it keep coming.
CONFIRM_SPACING = 0.1


class Canceller:
    """Owned by one Worker, on its event loop; reads and updates the worker's slots."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        # Cancel notices for runs not (yet) in a slot, by arrival time, oldest first.
        self._early: OrderedDict[uuid.UUID, float] = OrderedDict()
        # Runs whose cancel flag is being read; True: a notice came meanwhile, read once more.
        self._confirming: dict[uuid.UUID, bool] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def on_notice(self, run_id: uuid.UUID) -> None:
        if run_id in self._worker.slots:
            self._confirm_soon(run_id)
            return
        # The notice can overtake our own claim of the run (it is sent when the canceller
        # commits, which may be before the worker registers the slot): keep it for a moment.
        now = time.monotonic()
        early = self._early
        early[run_id] = now
        early.move_to_end(run_id)  # arrival order, oldest first
        # Amortised O(1) per notice: each is dropped once, from the old end.
        while len(early) > EARLY_MAX or now - early[next(iter(early))] >= EARLY_SECONDS:
            early.popitem(last=False)

    def on_start(self, run_id: uuid.UUID) -> None:
        if self._early.pop(run_id, None) is not None:
            self._confirm_soon(run_id)

    def _confirm_soon(self, run_id: uuid.UUID) -> None:
        """Read the run's cancel flag, at most one read in flight per run: a flood of notices
        for one run costs a read per CONFIRM_SPACING, not one per notice."""
        if run_id in self._confirming:
            self._confirming[run_id] = True
            return
        self._confirming[run_id] = False
        self.background(self._confirm_coalesced(run_id))

    async def _confirm_coalesced(self, run_id: uuid.UUID) -> None:
        try:
            await self.confirm(run_id)
            # A notice that arrived during the read may be newer than what it saw.
            while self._confirming.get(run_id):
                self._confirming[run_id] = False
                await asyncio.sleep(CONFIRM_SPACING)
                await self.confirm(run_id)
        finally:
            self._confirming.pop(run_id, None)

    def background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # a task nobody references may be collected mid-flight
        task.add_done_callback(self._tasks.discard)

    async def confirm(self, run_id: uuid.UUID) -> None:
        w = self._worker
        slot = w.slots.get(run_id)
        if slot is None or w._pool is None or slot.stop_reason is not None:
            return
        # A NOTIFY proves nothing: the flag in the database decides.
        try:
            async with bounded(w._pool, 5) as conn:
                cur = await conn.execute(QUERIES["read_cancel_flags"], {
                    "ids": [slot.claimed.id], "attempts": [slot.claimed.attempt]})
                flagged = await cur.fetchall()
        except (psycopg.OperationalError, TimeoutError) as exc:
            logger.warning("could not read the cancel flag (the heartbeat will): %s", exc,
                           extra={"action": "cancel_check_failed", **slot.extra})
            return
        if flagged and w.slots.get(run_id) is slot:
            self.cancel(slot)

    def cancel(self, slot: Slot) -> None:
        if slot.stop_reason is not None or slot.finishing:
            return
        slot.stop_reason = "cancelled"
        slot.run._mark_cancelled()
        logger.info("cancelling run %s", slot.claimed.id,
                    extra={"action": "run_cancelling", **slot.extra})
        assert slot.task is not None
        slot.task.cancel()
        asyncio.get_running_loop().call_later(
            self._worker.settings.cancel_grace_seconds,
            lambda: self.background(self.force(slot)))

    async def force(self, slot: Slot) -> None:
        """The handler ignored cancellation past its grace: record it cancelled and free the
        slot; whatever the handler does later is fenced. A thread cannot be stopped, though:
        while one of the run's threads runs, the worker exits instead (see Worker._stuck)."""
        w = self._worker
        if w.slots.get(slot.claimed.id) is not slot or slot.finishing:
            return
        if slot.run._threads.running:
            w.stuck_check(slot, "ignored its cancellation past the cancel grace")
            return
        slot.finishing = True
        assert w._outcomes is not None
        await w._outcomes.submit(w._cancelled_outcome(slot),
                                 serial=slot.claimed.serial_key is not None)
        del w.slots[slot.claimed.id]
        w._attention.set()
