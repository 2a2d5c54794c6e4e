"""A pool's scheduler: fires the schedules' due plans, exactly once per plan time.

Every worker runs one. It keeps the earliest next_fire_at in memory and sleeps until then (an
idle pool with no schedule due costs no transaction), woken early by the schedule doorbell
(runpool_schedules: any change of a schedule's timing, see 0010) and by what the claim's
probe sees (the fallback for a lost notification, or a pool without LISTEN). Each firing is
runpool.firing's transaction; a full batch is followed by the next at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Final

import psycopg
from psycopg_pool import AsyncConnectionPool

from .app import App
from .codec import dumps, jsonb
from .db import SET_LOCK_TIMEOUT
from .deadlines import bounded, transient
from .firing import LOCK_TIMEOUT, error_text, fire_due
from .listener import ClaimBudget

__all__ = ["Scheduler", "upsert_schedules"]

logger = logging.getLogger("runpool.scheduler")

# Seconds added to each sleep: a timer that fires a hair early would find nothing due yet.
EPSILON: Final = 0.002

# -- SQL (each statement's purpose above it) ---------------------------------------------------

# Apply a code-defined schedule (App.schedule) through the public API; enabled => NULL keeps
# an operator's pause.
UPSERT: Final = """
SELECT runpool.set_schedule(%(name)s, %(cron)s, %(tenant)s, %(handler)s, %(input)s,
                            %(timezone)s, %(catch_up)s, %(priority)s, NULL, %(serial_key)s)
"""


async def upsert_schedules(pool: AsyncConnectionPool, app: App, log: dict[str, str]) -> None:
    """Apply the app's schedules (a pool starting). One the database refuses (its name taken
    by another tenant's schedule, its row held by a session) is logged and skipped: the pool
    still starts, and the stored definition goes on firing."""
    for schedule in app.schedules:
        try:
            async with bounded(pool, 30) as conn, conn.transaction():
                # A session holding the schedule's row must not hold the pool's start up (a
                # worker failing its start would be restarted into the same wait).
                await conn.execute(SET_LOCK_TIMEOUT, {"timeout": LOCK_TIMEOUT})
                await conn.execute(UPSERT, {
                    "name": schedule.name, "cron": schedule.cron, "tenant": schedule.tenant,
                    "handler": schedule.handler, "input": jsonb(dumps(schedule.input)),
                    "timezone": schedule.timezone, "catch_up": schedule.catch_up,
                    "priority": schedule.priority, "serial_key": schedule.serial_key})
        except psycopg.Error as exc:
            if transient(exc):
                raise
            logger.error("schedule %s of this app was not applied: %s", schedule.name,
                         error_text(exc), extra={"action": "schedule_upsert_failed",
                                                  "schedule": schedule.name, **log})


class Scheduler:
    """The firing loop of one worker; `poke()` (a doorbell) and `observe()` (the claim's
    probe) wake it early."""

    def __init__(self, pool: AsyncConnectionPool, *, catch_up_max: int, poll_seconds: float,
                 worker_id: uuid.UUID) -> None:
        self._pool = pool
        self._catch_up_max = catch_up_max
        self._poll = poll_seconds
        self._log = {"worker_id": str(worker_id)}
        self._changed = asyncio.Event()
        self._poked = False
        # Loop time of the next firing; None: none known (sleep until woken).
        self._at: float | None = None
        # Anyone may NOTIFY runpool_schedules: a flood that finds nothing to fire costs each
        # worker at most a few firings per second.
        self._budget = ClaimBudget(rate=2.0, burst=5.0)
        self.ticks = 0

    def poke(self) -> None:
        """Something about the schedules changed: look now."""
        self._poked = True
        self._changed.set()

    def observe(self, due_in: float | None, unplanned: bool) -> None:
        """What a claim's probe saw: wake earlier if a plan is due sooner than expected."""
        if unplanned:
            self.poke()
            return
        if due_in is None:
            return
        at = asyncio.get_running_loop().time() + max(due_in, 0) + EPSILON
        if self._at is None or at < self._at - 0.05:
            self._at = at
            self._changed.set()

    async def _sleep(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._poked:
            timeout = None if self._at is None else self._at - loop.time()
            if timeout is not None and timeout <= 0:
                return
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)
        if (pause := self._budget.delay()) > 0:
            await asyncio.sleep(pause)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = 0.05
        self._poked = True  # at start: plan what no pool planned, fire what is due
        while True:
            await self._sleep()
            poked, self._poked = self._poked, False
            # The firing's clock is its transaction's start: the next plan's interval counts
            # from here, not from when the firing returned.
            started = loop.time()
            try:
                async with bounded(self._pool, max(5.0, self._poll)) as conn:
                    tick = await fire_due(conn, catch_up_max=self._catch_up_max, log=self._log)
            except (psycopg.OperationalError, TimeoutError) as exc:
                logger.warning("firing schedules failed: %r", exc,
                               extra={"action": "schedule_fire_failed", **self._log})
                self._at = loop.time() + backoff
                backoff = min(backoff * 2, self._poll)
                continue
            except Exception:
                # A defect of ours, or a row no check foresaw: schedules are late (logged,
                # retried every poll), but the worker's runs go on; stopping the worker would
                # only restart it into the same failure.
                logger.exception("firing schedules failed", extra={
                    "action": "schedule_fire_failed", **self._log})
                self._at = loop.time() + self._poll
                continue
            self.ticks += 1
            if tick.fired or not poked:
                self._budget.found_work()
            else:
                self._budget.spend()
            if tick.more:
                self._at = loop.time()  # the rest of a burst, at once
                backoff = 0.05
            elif tick.unplanned or (tick.due_in is not None and tick.due_in <= 0):
                # Due (or to plan) but held by another session: it fires or plans them, or
                # its transaction ends; its commit rings the doorbell, this is the fallback.
                self._at = loop.time() + backoff
                backoff = min(backoff * 2, self._poll)
            else:
                backoff = 0.05
                self._at = None if tick.due_in is None else started + tick.due_in + EPSILON
