"""Worker-side cancel notices: a NOTIFY (which proves nothing: any login can send one) is
confirmed against the run's cancel flag in the database before the run's slot is told; a
notice that overtakes the claim of its run waits for it a moment."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable

import psycopg
from psycopg_pool import AsyncConnectionPool

from .deadlines import bounded
from .queries import QUERIES
from .slot import Slot
from .tasks import Background

__all__ = ["Canceller"]

logger = logging.getLogger("runpool.cancellation")

# Early cancel notices are kept this long, and at most this many (oldest dropped first): any
# login can NOTIFY, so a forged flood must cost constant work per notice and capped memory.
EARLY_SECONDS = 60.0
EARLY_MAX = 10_000
# Pause between two reads of one run's cancel flag while notices for it keep coming.
CONFIRM_SPACING = 0.1


class Canceller:
    """Owned by one worker, on its event loop. It sees the worker only through what it is
    handed: `lookup(run_id)`, the run's slot if it is in one; `pool()`, the worker's
    connections once open (None before); `on_cancel(slot)`, called once the database confirms
    the cancel of the slot's run."""

    def __init__(self, *, lookup: Callable[[uuid.UUID], Slot | None],
                 pool: Callable[[], AsyncConnectionPool | None],
                 on_cancel: Callable[[Slot], None]) -> None:
        self._lookup = lookup
        self._pool = pool
        self._on_cancel = on_cancel
        # Cancel notices for runs not (yet) in a slot, by arrival time, oldest first.
        self._early: OrderedDict[uuid.UUID, float] = OrderedDict()
        # Runs whose cancel flag is being read; True: a notice came meanwhile, read once more.
        self._confirming: dict[uuid.UUID, bool] = {}
        self._background = Background()

    def on_notice(self, run_id: uuid.UUID) -> None:
        if self._lookup(run_id) is not None:
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
        self._background.spawn(self._confirm_coalesced(run_id))

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

    async def confirm(self, run_id: uuid.UUID) -> None:
        slot = self._lookup(run_id)
        pool = self._pool()
        if slot is None or pool is None or slot.stop_reason is not None:
            return
        # A NOTIFY proves nothing: the flag in the database decides.
        try:
            async with bounded(pool, 5) as conn:
                cur = await conn.execute(QUERIES["read_cancel_flags"], {
                    "ids": [slot.claimed.id], "attempts": [slot.claimed.attempt]})
                flagged = await cur.fetchall()
        except (psycopg.OperationalError, TimeoutError) as exc:
            logger.warning("could not read the cancel flag (the heartbeat will): %s", exc,
                           extra={"action": "cancel_check_failed", **slot.extra})
            return
        if flagged and self._lookup(run_id) is slot:
            self._on_cancel(slot)
