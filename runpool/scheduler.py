"""A pool's scheduler: fires the schedules' due plans, exactly once per plan time.

Every worker runs one. It keeps the earliest next_fire_at in memory and sleeps until then (an
idle pool with no schedule due costs no transaction), woken early by the schedule doorbell
(runpool_schedules: any change of a schedule's timing, see 0010) and by what the claim's
probe sees (the fallback for a lost notification, or a pool without LISTEN). A firing is one
transaction: lock the due rows (SKIP LOCKED: another pool has them), enqueue each plan's run
through runpool.enqueue with the idempotency key schedule:<name>:<plan time>, advance
next_fire_at. Two pools can never fire one plan: the row lock and the advance serialise them,
and the key makes even a replayed plan (an operator moving next_fire_at back) one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from . import faults, telemetry
from .app import App
from .db import dumps, jsonb
from .deadlines import bounded, transient
from .errors import InvalidInput
from .listener import ClaimBudget
from .schedules import Due, due_plans, next_plan, plan_key, plan_text

__all__ = ["Scheduler", "Tick", "fire_due", "upsert_schedules"]

logger = logging.getLogger("runpool.scheduler")

# Schedules one firing transaction takes at most (the rest wait for the next, at once).
BATCH: Final = 100
# A schedule whose enqueue waits this long for a lock (a session holding its serial key, say)
# is left for a later firing: it must not hold every other schedule up.
LOCK_TIMEOUT: Final = "2s"
# Seconds added to each sleep: a timer that fires a hair early would find nothing due yet.
EPSILON: Final = 0.002

# -- SQL (each statement's purpose above it) ---------------------------------------------------

# The firing clock: the database's (every pool and host agrees on it); a test may pin it.
NOW: Final = "SELECT coalesce(%(now)s::timestamptz, now())"
# Wait at most LOCK_TIMEOUT for any lock in this firing (a hostile session's, say).
SET_LOCK_TIMEOUT: Final = "SELECT set_config('lock_timeout', %(timeout)s, true)"
# Schedules whose next plan time no pool has computed yet (new, or changed); rows another pool
# holds are skipped (it computes them).
LOCK_UNPLANNED: Final = """
SELECT name, cron, timezone FROM runpool.schedules
WHERE enabled AND error IS NULL AND next_fire_at IS NULL
LIMIT %(limit)s
FOR NO KEY UPDATE SKIP LOCKED
"""
# Due schedules, oldest plan first; rows another pool holds are skipped (it fires them).
LOCK_DUE: Final = """
SELECT name, cron, timezone, tenant, handler, catch_up, next_fire_at
FROM runpool.schedules
WHERE enabled AND error IS NULL AND next_fire_at <= %(now)s
ORDER BY next_fire_at
LIMIT %(limit)s
FOR NO KEY UPDATE SKIP LOCKED
"""
# Set a schedule's next plan time (NULL with an error: it stays out of firing, and says why).
PLAN: Final = """
UPDATE runpool.schedules SET next_fire_at = %(next)s, error = %(error)s WHERE name = %(name)s
"""
# Enqueue the plans' runs through the public enqueue, oldest first: the schedule's input with
# "scheduled_at" added, one idempotency key per plan time (a plan enqueued twice is one run).
ENQUEUE_PLANS: Final = """
SELECT runpool.enqueue(s.tenant, s.handler,
                       s.input || jsonb_build_object('scheduled_at', p.scheduled_at),
                       s.priority, p.key, NULL, NULL, p.traceparent, s.serial_key)
FROM runpool.schedules s,
     unnest(%(at)s::text[], %(keys)s::text[], %(traceparents)s::text[])
         WITH ORDINALITY AS p(scheduled_at, key, traceparent, n)
WHERE s.name = %(name)s
ORDER BY p.n
"""
# After a firing: the next plan time, and the latest plan fired (kept when none was).
ADVANCE: Final = """
UPDATE runpool.schedules SET next_fire_at = %(next)s,
       last_fire_at = coalesce(%(last)s, last_fire_at), error = %(error)s
WHERE name = %(name)s
"""
# Seconds until the earliest plan any pool must act on (<= 0: due now; NULL: none), and
# whether a schedule waits for its next plan time to be computed. Index probes only.
EARLIEST: Final = """
SELECT extract(epoch FROM (SELECT min(next_fire_at) FROM runpool.schedules
                           WHERE enabled AND error IS NULL) - %(now)s)::float8,
       EXISTS (SELECT 1 FROM runpool.schedules
               WHERE enabled AND error IS NULL AND next_fire_at IS NULL)
"""
# Apply a code-defined schedule (App.schedule) through the public API; enabled => NULL keeps
# an operator's pause.
UPSERT: Final = """
SELECT runpool.set_schedule(%(name)s, %(cron)s, %(tenant)s, %(handler)s, %(input)s,
                            %(timezone)s, %(catch_up)s, %(priority)s, NULL, %(serial_key)s)
"""


@dataclass(frozen=True, slots=True)
class Tick:
    """What one firing did, and when the next is due."""

    fired: dict[str, list[datetime]]
    # Seconds until the earliest plan (<= 0: due, but held by another session); None: none.
    due_in: float | None
    unplanned: bool
    # A full batch was taken: more may be due right now.
    more: bool = False


def _error_text(exc: BaseException) -> str:
    diag = getattr(exc, "diag", None)
    text = (diag.message_primary if diag is not None else None) or str(exc)
    return " ".join(text.split())[:1000]


async def fire_due(conn: psycopg.AsyncConnection[Any], *, catch_up_max: int,
                   now: datetime | None = None, log: dict[str, str] | None = None) -> Tick:
    """One firing, in a transaction of its own on `conn` (an autocommit connection): plan what
    no pool planned yet, fire what is due, and read when the next plan is. `now` pins the
    clock (tests); by default it is the database's."""
    log = log or {}
    fired: dict[str, list[datetime]] = {}
    async with conn.transaction():
        cur = await conn.execute(NOW, {"now": now})
        row = await cur.fetchone()
        assert row is not None
        clock: datetime = row[0]
        await conn.execute(SET_LOCK_TIMEOUT, {"timeout": LOCK_TIMEOUT})
        cur = await conn.execute(LOCK_UNPLANNED, {"limit": BATCH})
        unplanned = await cur.fetchall()
        for name, cron, tz in unplanned:
            await _plan(conn, name, cron, tz, clock, log)
        rows = await (await conn.cursor(row_factory=dict_row).execute(
            LOCK_DUE, {"now": clock, "limit": BATCH})).fetchall()
        for schedule in rows:
            plans = await _fire(conn, schedule, clock, catch_up_max, log)
            if plans:
                fired[schedule["name"]] = plans
        cur = await conn.execute(EARLIEST, {"now": clock})
        row = await cur.fetchone()
        assert row is not None
    return Tick(fired, row[0], bool(row[1]), BATCH in (len(unplanned), len(rows)))


async def _plan(conn: psycopg.AsyncConnection[Any], name: str, cron: str, tz: str,
                clock: datetime, log: dict[str, str]) -> None:
    try:
        plan, error = next_plan(cron, tz, clock), None
        if plan is None:
            error = f"cron {cron!r} names no time in the next 50 years"
    except InvalidInput as exc:
        plan, error = None, str(exc)
    if error:
        logger.warning("schedule %s cannot fire: %s", name, error,
                       extra={"action": "schedule_invalid", "schedule": name, **log})
    await conn.execute(PLAN, {"name": name, "next": plan, "error": error})


async def _fire(conn: psycopg.AsyncConnection[Any], s: dict[str, Any], clock: datetime,
                catch_up_max: int, log: dict[str, str]) -> list[datetime]:
    name = s["name"]
    extra = {"schedule": name, **log}
    try:
        due: Due = due_plans(s["cron"], s["timezone"], s["next_fire_at"], clock, s["catch_up"],
                             catch_up_max=catch_up_max)
    except InvalidInput as exc:  # its cron or zone changed under us, or this host lacks it
        logger.warning("schedule %s cannot fire: %s", name, exc,
                       extra={"action": "schedule_invalid", **extra})
        await conn.execute(ADVANCE, {"name": name, "next": None, "last": None,
                                     "error": str(exc)})
        return []
    if due.dropped is None or due.dropped > 0:
        logger.info("schedule %s: %s missed plan(s) dropped (catch_up %s)", name,
                    "older" if due.dropped is None else due.dropped, s["catch_up"],
                    extra={"action": "schedule_plans_dropped", "dropped": due.dropped, **extra})
    error = None if due.next_fire_at else f"cron {s['cron']!r} names no later time"
    spans: list[Any] = []
    try:
        async with conn.transaction():  # a savepoint: a refused enqueue fails this schedule only
            if due.fire:
                parents = []
                for _ in due.fire:
                    span, parent = telemetry.enqueue_traceparent(s["handler"], s["tenant"])
                    spans.append(span)
                    parents.append(parent)
                await conn.execute(ENQUEUE_PLANS, {
                    "name": name, "at": [plan_text(p) for p in due.fire],
                    "keys": [plan_key(name, p) for p in due.fire], "traceparents": parents})
                faults.hit("schedule.enqueued", conn)
            await conn.execute(ADVANCE, {"name": name, "next": due.next_fire_at,
                                         "last": due.fire[-1] if due.fire else None,
                                         "error": error})
    except psycopg.errors.LockNotAvailable:
        # Its serial key (or row) is held by a session: a later firing takes it.
        logger.warning("schedule %s: a lock its firing needs is held; it fires later", name,
                       extra={"action": "schedule_lock_busy", **extra})
        return []
    except psycopg.Error as exc:
        if transient(exc):
            raise
        # The enqueue refused what the schedule holds (an input over a lowered size limit, a
        # handler name the runs table refuses): every plan would fail alike, so it stops,
        # visibly, until set_schedule changes it.
        logger.error("schedule %s cannot fire: %s", name, _error_text(exc),
                     extra={"action": "schedule_invalid", **extra})
        await conn.execute(ADVANCE, {"name": name, "next": None, "last": None,
                                     "error": _error_text(exc)})
        return []
    finally:
        for span in spans:
            if span is not None:
                span.end()
    if error:
        logger.warning("schedule %s: %s", name, error,
                       extra={"action": "schedule_invalid", **extra})
    for plan in due.fire:
        logger.debug("schedule %s fired plan %s", name, plan,
                     extra={"action": "schedule_fired", **extra})
    return due.fire


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
                         _error_text(exc), extra={"action": "schedule_upsert_failed",
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
