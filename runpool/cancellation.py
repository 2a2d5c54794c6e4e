"""Worker-side cancel notices: a NOTIFY (which proves nothing: any login can send one) is
confirmed against the run's cancel flag in the database before the run's slot is told; a
notice that overtakes the claim of its run waits for it a moment; and once notices flow again
after a (re)connect, the runs that could have missed theirs read their flags."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from .deadlines import retrying
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
    handed: `lookup(run_id)`, the run's slot if it is in one; `slots()`, all of them;
    `pool()`, the worker's connections once open (None before); `on_cancel(slot)`, called once
    the database confirms the cancel of the slot's run."""

    def __init__(self, *, lookup: Callable[[uuid.UUID], Slot | None],
                 slots: Callable[[], Iterable[Slot]],
                 pool: Callable[[], AsyncConnectionPool | None],
                 on_cancel: Callable[[Slot], None]) -> None:
        self._lookup = lookup
        self._slots = slots
        self._pool = pool
        self._on_cancel = on_cancel
        # When notices last began to flow (monotonic; see on_listening).
        self._listening_since = -math.inf
        # None: no catch-up read in flight; True: one is, and notices began to flow again
        # since it started (read once more).
        self._catching_up: bool | None = None
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

    def on_confirmed(self, run_id: uuid.UUID) -> None:
        """A cancel notice the host's relay has checked against the database already (it
        passes on no other): the run's slot is told at once, with no read of its own (W9's
        p50: 2.5 ms with the relay's read and the worker's in a row, 1.9 ms with one). A
        notice that overtakes the claim of its run waits for it like any other, and is read
        then."""
        slot = self._lookup(run_id)
        if slot is None:
            self.on_notice(run_id)
        elif slot.stop_reason is None:
            self._on_cancel(slot)

    def on_start(self, run_id: uuid.UUID, sent: float) -> None:
        """The run claimed by a claim sent at `sent` (monotonic) is in its slot now."""
        if self._early.pop(run_id, None) is not None:
            self._confirm_soon(run_id)
        elif sent < self._listening_since:
            # Claimed before notices flowed, in a slot only after on_listening's read: its
            # cancel may have been requested while no one listened.
            self._confirm_soon(run_id)

    def on_listening(self) -> None:
        """Notices flow from now on (the LISTEN is in, after a start or a reconnect): the
        cancels requested while none could arrive are read from the flags, for every run in a
        slot now (one read) and for those claimed before now that enter a slot later. Without
        this, a run claimed before the worker's first LISTEN, or held across a reconnect,
        learned of its cancel only from the heartbeat, seconds later."""
        self._listening_since = time.monotonic()
        # One catch-up at a time: a LISTEN made to flap (a login terminating it as fast as it
        # comes back) costs one more read after the one in flight, not one per reconnect.
        if self._catching_up is not None:
            self._catching_up = True
            return
        self._catching_up = False
        self._background.spawn(self._catch_up())

    async def _catch_up(self) -> None:
        try:
            while True:
                await self._confirm_all(list(self._slots()))
                if not self._catching_up:
                    return
                self._catching_up = False
        finally:
            self._catching_up = None

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
        if slot is not None:
            await self._confirm_all([slot])

    async def _confirm_all(self, slots: list[Slot]) -> None:
        """Tell each of `slots` still running whose run's flag says cancel: one read."""
        pool = self._pool()
        slots = [slot for slot in slots if slot.stop_reason is None]
        if pool is None or not slots:
            return
        params = {"ids": [slot.claimed.id for slot in slots],
                  "attempts": [slot.claimed.attempt for slot in slots]}

        async def read(conn: psycopg.AsyncConnection[Any], tries: int) -> set[uuid.UUID]:
            cur = await conn.execute(QUERIES["read_cancel_flags"], params)
            return {row[0] for row in await cur.fetchall()}

        # A NOTIFY proves nothing: the flag in the database decides. Read again on another
        # connection when one fails: a catch-up follows a reconnect, when the pool's
        # connections are the likeliest to be dead too.
        try:
            flagged = await retrying(pool, 5, read, what="cancel flags read")
        except (psycopg.OperationalError, TimeoutError) as exc:
            # One run's ids, or the worker's alone for several.
            ids = (slots[0].extra if len(slots) == 1
                   else {"worker_id": slots[0].extra.get("worker_id", "")})
            logger.warning("could not read the cancel flags of %d runs (the heartbeat will): %s",
                           len(slots), exc, extra={"action": "cancel_check_failed",
                                                   "runs": len(slots), **ids})
            return
        for slot in slots:
            if slot.claimed.id in flagged and self._lookup(slot.claimed.id) is slot:
                self._on_cancel(slot)
