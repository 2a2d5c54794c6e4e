"""Keeping the leases of a worker's runs: one heartbeat statement renews them all (and brings
back their cancel flags and which are past their timeout or deadline), and a watchdog on the
local clock stops a run whose lease may have run out while the heartbeat could not get through
(and asks for a heartbeat when a run's timeout or deadline is due)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any, Final

import psycopg
import psycopg.errors
from psycopg_pool import AsyncConnectionPool

from .db import SET_LOCK_TIMEOUT, application_name
from .deadlines import bounded
from .pools import open_pool
from .queries import QUERIES
from .settings import Settings
from .slot import Slot, Slots, StopReason

__all__ = ["Cadence", "LeaseKeeper"]

# The worker's logger: heartbeats are the worker's story (operators filter on one name).
logger = logging.getLogger("runpool.worker")

# Seconds before a heartbeat that found rows busy beats again (all of them: one statement).
BUSY_RETRY_SECONDS = 0.5
# The longest a heartbeat waits for one busy row's lock (a checkpoint write of this worker
# holds it for milliseconds; another session's open transaction may hold it for long). All
# busy rows together wait at most half a heartbeat interval.
BUSY_WAIT_SECONDS: Final = 1.0
# A busy row is waited for once its lease has less than this part of its length left: a beat
# and the busy retries after it (lease/6 of them) have all found it held.
AT_RISK: Final = 0.5


class Cadence:
    """Something done at most once per `interval` seconds (monotonic), e.g. showing the
    database this worker is alive: a heartbeat does it, and an idle worker's claim does it
    when no heartbeat has lately."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._last = 0.0

    def done(self, at: float) -> None:
        self._last = at

    def due(self, now: float) -> bool:
        """Whether it is due now; if so it counts as done now (an attempt that fails is
        simply repeated the next time)."""
        if now - self._last > self._interval:
            self._last = now
            return True
        return False


class LeaseKeeper:
    """The leases of the runs in `slots`. What it may do to a run is narrow: `on_cancel(slot)`
    when the database flags the run cancelled, `on_overdue(slot, reason)` when the database's
    clock says it passed its timeout or deadline, `on_lost(slot, why)` when its lease is or may
    be gone. `touch` is told whenever a heartbeat showed the database this worker is alive."""

    def __init__(self, *, settings: Settings, dsn: str, worker_id: uuid.UUID,
                 pool: AsyncConnectionPool, slots: Slots, touch: Cadence,
                 on_cancel: Callable[[Slot], None],
                 on_lost: Callable[[Slot, str], None],
                 on_overdue: Callable[[Slot, str], None] | None = None) -> None:
        self._settings = settings
        self._dsn = dsn
        self._worker_id = worker_id
        self._pool = pool
        self._slots = slots
        self._touch = touch
        self._on_cancel = on_cancel
        self._on_lost = on_lost
        self._on_overdue = on_overdue
        self._log = {"worker_id": str(worker_id)}
        # Set when a run's timeout or deadline is due by the local clock: beat now, so the
        # database's clock decides at once rather than at the next interval.
        self._due = asyncio.Event()
        self._asked = 0.0

    async def heartbeat_loop(self) -> None:
        # A connection of its own: with every pooled connection busy writing checkpoints (or
        # waiting for one), a heartbeat queued behind them would cost leases.
        beat_pool = await open_pool(
            self._dsn, size=1, name=application_name(f"runpool-beat-{os.getpid()}"),
            connect_timeout=max(2, int(self._settings.heartbeat_seconds)),
            stateless=self._settings.stateless)
        try:
            interval = self._settings.heartbeat_seconds
            while True:
                try:
                    await asyncio.wait_for(self._due.wait(), interval)
                except TimeoutError:
                    pass
                self._due.clear()
                # While its connection is being replaced (after a cut, or a silent network),
                # the heartbeat borrows from the shared pool rather than wait for it.
                available = beat_pool.get_stats().get("pool_available", 0)
                pool = beat_pool if available else self._pool
                try:
                    busy = await self._beat(pool)
                    # A row held through the beat's wait (an API session's open cancel, a
                    # slow checkpoint batch) is tried again soon: waiting a whole interval per
                    # busy beat, a run written to all the time (W11) went unrenewed until its
                    # lease ran out.
                    interval = (min(BUSY_RETRY_SECONDS, self._settings.heartbeat_seconds)
                                if busy else self._settings.heartbeat_seconds)
                except (psycopg.OperationalError, TimeoutError) as exc:
                    logger.warning("heartbeat failed: %r", exc,
                                   extra={"action": "heartbeat_failed", **self._log})
                    # Retry sooner, so a short outage costs no lease.
                    interval = min(1.0, self._settings.heartbeat_seconds)
        finally:
            await beat_pool.close()

    async def watchdog(self) -> None:
        """Abandon runs whose lease may have run out, on the local clock alone: a heartbeat
        stuck on a dead connection (its cancellation can itself take seconds) must not keep a
        run going past its lease."""
        while True:
            await asyncio.sleep(min(0.5, self._settings.heartbeat_seconds / 2))
            self._abandon_expired()
            self._ask_when_due()

    async def _beat(self, pool: AsyncConnectionPool) -> int:
        """Renew every held lease in one statement, then each one whose row was busy on its
        own, waiting a moment for its lock; how many rows stayed busy (not renewed)."""
        # A cancelled or draining run may have a thread still running: its lease is renewed
        # until the thread returns (or the worker exits with it).
        slots = [s for s in self._slots if s.stop_reason is not StopReason.LEASE_LOST]
        if not slots:
            return 0  # an idle worker shows it is alive through its polls
        s = self._settings
        sent = time.monotonic()
        async with bounded(pool, s.heartbeat_seconds) as conn:
            cur = await conn.execute(QUERIES["heartbeat"], {
                "ids": [slot.claimed.id for slot in slots],
                "attempts": [slot.claimed.attempt for slot in slots],
                "lease_seconds": s.lease_seconds,
                "worker_id": self._worker_id,
            })
            held = {run_id: (cancel, overdue) for run_id, cancel, overdue
                    in await cur.fetchall()}
            self._touch.done(sent)
            busy = [slot for slot in slots if not self._answer(slot, held, sent)]
            # The heartbeat task only runs while the worker's handlers wait, which is while
            # their writes are in flight: a run writing checkpoints back to back was found
            # busy by nearly every beat, and lost its lease (W8: all three attempts of a
            # 1,000-call run at a 2 s lease). Waited for, its write ends within moments. Only
            # a lease running low is waited for (a transaction each): most busy rows are free
            # at the next busy retry, and waiting for each of W11's hundreds of them delayed
            # the others' renewals (heartbeat lag max 10.6 s against 1.9 s).
            until, still = sent + s.heartbeat_seconds / 2, []
            for slot in busy:
                wait = min(until - time.monotonic(), BUSY_WAIT_SECONDS)
                if (slot.deadline - sent > s.lease_seconds * AT_RISK or wait <= 0
                        or not await self._renew_busy(conn, slot, wait)):
                    still.append(slot)
        for slot in still:
            # Busy: someone holds the row (an API session's open cancel, say). The lease is
            # neither renewed nor lost; the next beat tries again, and the watchdog still
            # stops the run if its lease runs out meanwhile.
            logger.debug("lease of run %s not renewed: its row is locked", slot.claimed.id,
                         extra={"action": "lease_busy", **slot.extra})
        return len(still)

    async def _renew_busy(self, conn: psycopg.AsyncConnection[Any], slot: Slot,
                          wait: float) -> bool:
        """Renew one lease whose row was busy, waiting up to `wait` seconds for its lock, in a
        transaction of its own (it holds no other row meanwhile: a checkpoint batch holding
        this row may be waiting for another); False if the row stayed locked."""
        sent = time.monotonic()
        try:
            async with conn.transaction():
                await conn.execute(SET_LOCK_TIMEOUT, {"timeout": f"{max(1, int(wait * 1000))}ms"})
                cur = await conn.execute(QUERIES["renew_busy"], {
                    "id": slot.claimed.id, "attempt": slot.claimed.attempt,
                    "lease_seconds": self._settings.lease_seconds})
                row = await cur.fetchone()
        except psycopg.errors.LockNotAvailable:
            return False
        held = {} if row is None else {row[0]: (row[1], row[2])}
        return self._answer(slot, held, sent)

    def _answer(self, slot: Slot, held: dict[uuid.UUID, tuple[bool | None, str | None]],
                sent: float) -> bool:
        """Act on what a renewal answered for `slot` (`held`: the runs still held, by id:
        whether each has a cancel request, None when its row was busy, and why it is overdue);
        False if its row was busy."""
        if slot.claimed.id in held:
            cancel, overdue = held[slot.claimed.id]
            if cancel is None:
                return False
            slot.renew(sent + self._settings.lease_seconds)
            if cancel:
                self._on_cancel(slot)
            elif overdue and self._on_overdue is not None:
                self._on_overdue(slot, overdue)
        elif not slot.finishing and self._slots.holds(slot):
            self._on_lost(slot, "the database no longer shows this attempt's lease")
        return True

    def _ask_when_due(self) -> None:
        """A run whose timeout or deadline has come by the local clock (from the database's
        at the claim) and is still going: ask the database now, at most every quarter of a
        second while one is due (the local clock may run a little ahead of it)."""
        now = time.monotonic()
        if now - self._asked < 0.25:
            return
        for slot in self._slots:
            if slot.due <= now and slot.stop_reason is None and not slot.finishing:
                self._asked = now
                self._due.set()
                return

    def _abandon_expired(self) -> None:
        now = time.monotonic()
        for slot in self._slots:
            if (slot.deadline < now and slot.stop_reason is not StopReason.LEASE_LOST
                    and not slot.finishing):
                self._on_lost(slot, "the lease could not be renewed before it expired")
