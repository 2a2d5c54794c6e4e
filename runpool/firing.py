"""One firing of the schedules: a transaction that plans what no pool planned yet, fires every
due plan exactly once, and reads when the next plan is (runpool.scheduler runs it in a loop).

The due rows are locked FOR NO KEY UPDATE SKIP LOCKED (another pool has the others), every
plan's run is enqueued with the idempotency key schedule:<name>:<plan time> in one
runpool.enqueue_many call, and every next_fire_at advances in one UPDATE: a handful of
statements whether 1 or BATCH schedules are due (a savepoint and three statements per schedule
made the last of 1,000 plans due in one minute fire ~3 s late). A schedule whose serial key a
session holds is tried, not waited for, and left due. A batch the database refuses (one
schedule's input over a lowered limit, a lock held past 200 ms) is fired again one
schedule at a time, each in a savepoint, so only the refused schedule is held back. Two pools
can never fire one plan: the row lock and the advance serialise them, and the key makes even a
replayed plan (an operator moving next_fire_at back) one run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

import psycopg
from psycopg.rows import dict_row

from . import faults, telemetry
from .db import SET_LOCK_TIMEOUT
from .deadlines import transient
from .errors import InvalidInput
from .schedules import Due, due_plans, next_plan, plan_key, plan_text

__all__ = ["BATCH", "LOCK_TIMEOUT", "Tick", "error_text", "fire_due"]

logger = logging.getLogger("runpool.scheduler")

# Schedules one firing transaction takes at most (the rest wait for the next, at once): a
# few hundred milliseconds of row locks on schedules, and within enqueue_many's 1,000 serial
# keys a call.
BATCH: Final = 500
# A schedule whose enqueue waits this long for a lock (a session holding its serial key, say)
# is left for a later firing: it must not hold every other schedule up.
LOCK_TIMEOUT: Final = "2s"
# A batch waits this long for a lock before it is fired one schedule at a time, and so does
# each schedule then: their runs commit together, after every wait (a tenant's enqueue left
# open on its own plan's idempotency key held the whole firing LOCK_TIMEOUT, past the 2 s).
BATCH_LOCK_TIMEOUT: Final = "200ms"

# -- SQL (each statement's purpose above it) ---------------------------------------------------

# The firing clock: the database's (every pool and host agrees on it); a test may pin it.
NOW: Final = "SELECT coalesce(%(now)s::timestamptz, now())"
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
SELECT name, cron, timezone, tenant, handler, catch_up, next_fire_at, serial_key
FROM runpool.schedules
WHERE enabled AND error IS NULL AND next_fire_at <= %(now)s
ORDER BY next_fire_at
LIMIT %(limit)s
FOR NO KEY UPDATE SKIP LOCKED
"""
# Of these schedules (each with a serial key), those whose key another session holds (an
# enqueue left open): not waited for. The keys free now are taken here for the rest of the
# transaction (advisory locks are reentrant: the batch's enqueue takes them again at once).
BUSY_SERIAL_KEYS: Final = """
SELECT s.name FROM runpool.schedules s
WHERE s.name = ANY(%(names)s::text[])
  AND NOT pg_try_advisory_xact_lock(runpool.serial_key_lock(s.tenant, s.serial_key))
"""
# Set schedules' next plan times (NULL with an error: it stays out of firing, and says why).
PLAN: Final = """
UPDATE runpool.schedules s SET next_fire_at = p.next, error = p.error
FROM unnest(%(names)s::text[], %(nexts)s::timestamptz[], %(errors)s::text[]) AS p(name, next, error)
WHERE s.name = p.name
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
# Enqueue a batch's plans in one call, schedules in firing order and each one's plans oldest
# first, with what ENQUEUE_PLANS gives enqueue: the input with "scheduled_at", the plan's key.
ENQUEUE_BATCH: Final = """
SELECT count(*) FROM runpool.enqueue_many((
    SELECT coalesce(jsonb_agg(jsonb_build_object(
               'tenant', s.tenant, 'handler', s.handler,
               'input', s.input || jsonb_build_object('scheduled_at', p.scheduled_at),
               'priority', s.priority, 'idempotency_key', p.key, 'traceparent', p.traceparent,
               'serial_key', s.serial_key) ORDER BY p.n), '[]')
    FROM unnest(%(names)s::text[], %(at)s::text[], %(keys)s::text[], %(traceparents)s::text[])
             WITH ORDINALITY AS p(name, scheduled_at, key, traceparent, n)
    JOIN runpool.schedules s ON s.name = p.name))
"""
# After a batch: each schedule's next plan time and latest plan fired (kept when none was).
ADVANCE_BATCH: Final = """
UPDATE runpool.schedules s SET next_fire_at = a.next,
       last_fire_at = coalesce(a.last, s.last_fire_at), error = a.error
FROM unnest(%(names)s::text[], %(nexts)s::timestamptz[], %(lasts)s::timestamptz[],
            %(errors)s::text[]) AS a(name, next, last, error)
WHERE s.name = a.name
"""
# After a firing of one schedule: the next plan time, and the latest plan fired (kept when
# none was).
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
@dataclass(frozen=True, slots=True)
class Tick:
    """What one firing did, and when the next is due."""

    fired: dict[str, list[datetime]]
    # Seconds until the earliest plan (<= 0: due, but held by another session); None: none.
    due_in: float | None
    unplanned: bool
    # A full batch was taken: more may be due right now.
    more: bool = False


def error_text(exc: BaseException) -> str:
    diag = getattr(exc, "diag", None)
    text = (diag.message_primary if diag is not None else None) or str(exc)
    return " ".join(text.split())[:1000]


@dataclass(frozen=True, slots=True)
class _Firing:
    """One due schedule of a batch: its row, its plans, and their enqueue spans."""

    schedule: dict[str, Any]
    due: Due
    # Why it stops firing after this one (its cron names no later time), or None.
    error: str | None
    spans: list[Any] = field(default_factory=list)
    parents: list[str | None] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.schedule["name"])


async def fire_due(conn: psycopg.AsyncConnection[Any], *, catch_up_max: int,
                   now: datetime | None = None, log: dict[str, str] | None = None) -> Tick:
    """One firing, in a transaction of its own on `conn` (an autocommit connection): plan what
    no pool planned yet, fire what is due, and read when the next plan is. `now` pins the
    clock (tests); by default it is the database's."""
    log = log or {}
    async with conn.transaction():
        cur = await conn.execute(NOW, {"now": now})
        row = await cur.fetchone()
        assert row is not None
        clock: datetime = row[0]
        await conn.execute(SET_LOCK_TIMEOUT, {"timeout": LOCK_TIMEOUT})
        cur = await conn.execute(LOCK_UNPLANNED, {"limit": BATCH})
        unplanned = await cur.fetchall()
        if unplanned:
            await _plan(conn, unplanned, clock, log)
        rows = await (await conn.cursor(row_factory=dict_row).execute(
            LOCK_DUE, {"now": clock, "limit": BATCH})).fetchall()
        fired = await _fire(conn, rows, clock, catch_up_max, log) if rows else {}
        cur = await conn.execute(EARLIEST, {"now": clock})
        row = await cur.fetchone()
        assert row is not None
    return Tick(fired, row[0], bool(row[1]), BATCH in (len(unplanned), len(rows)))


async def _plan(conn: psycopg.AsyncConnection[Any], rows: list[Any], clock: datetime,
                log: dict[str, str]) -> None:
    names, plans, errors = [], [], []
    for name, cron, tz in rows:
        try:
            plan, error = next_plan(cron, tz, clock), None
            if plan is None:
                error = f"cron {cron!r} names no time in the next 50 years"
        except InvalidInput as exc:
            plan, error = None, str(exc)
        if error:
            logger.warning("schedule %s cannot fire: %s", name, error,
                           extra={"action": "schedule_invalid", "schedule": name, **log})
        names.append(name)
        plans.append(plan)
        errors.append(error)
    await conn.execute(PLAN, {"names": names, "nexts": plans, "errors": errors})


async def _fire(conn: psycopg.AsyncConnection[Any], rows: list[dict[str, Any]],
                clock: datetime, catch_up_max: int, log: dict[str, str]
                ) -> dict[str, list[datetime]]:
    """Fire the locked due `rows`: together, or one at a time if the batch is refused."""
    firings: list[_Firing] = []
    # Schedules that cannot be evaluated (a cron or zone changed under us, or this host lacks
    # the zone): they stop, with the error, in the batch's advance.
    stopped: dict[str, str] = {}
    for s in rows:
        name = s["name"]
        extra = {"schedule": name, **log}
        try:
            due = due_plans(s["cron"], s["timezone"], s["next_fire_at"], clock, s["catch_up"],
                            catch_up_max=catch_up_max)
        except InvalidInput as exc:
            logger.warning("schedule %s cannot fire: %s", name, exc,
                           extra={"action": "schedule_invalid", **extra})
            stopped[name] = str(exc)
            continue
        if due.dropped is None or due.dropped > 0:
            logger.info("schedule %s: %s missed plan(s) dropped (catch_up %s)", name,
                        "older" if due.dropped is None else due.dropped, s["catch_up"],
                        extra={"action": "schedule_plans_dropped", "dropped": due.dropped,
                               **extra})
        firing = _Firing(s, due, None if due.next_fire_at else
                         f"cron {s['cron']!r} names no later time")
        for _ in due.fire:
            span, parent = telemetry.enqueue_traceparent(s["handler"], s["tenant"])
            firing.spans.append(span)
            firing.parents.append(parent)
        firings.append(firing)
    try:
        ready = await _without_busy_keys(conn, firings, log)
        try:
            async with conn.transaction():  # a savepoint: a refused batch is fired one by one
                await conn.execute(SET_LOCK_TIMEOUT, {"timeout": BATCH_LOCK_TIMEOUT})
                await _fire_together(conn, ready, stopped)
            fired = {f.name: f.due.fire for f in ready if f.due.fire}
            advanced = ready
        except psycopg.Error as exc:
            if transient(exc):
                raise
            logger.info("schedules fired one at a time: the batch was refused (%s)",
                        error_text(exc), extra={"action": "schedule_batch_split", **log})
            # Reverted to LOCK_TIMEOUT with the savepoint: set for the rest of the firing.
            await conn.execute(SET_LOCK_TIMEOUT, {"timeout": BATCH_LOCK_TIMEOUT})
            if stopped:
                await _advance(conn, [], stopped)
            fired, advanced = {}, []
            for firing in ready:
                if await _fire_one(conn, firing, log):
                    advanced.append(firing)
                    if firing.due.fire:
                        fired[firing.name] = firing.due.fire
    finally:
        for firing in firings:
            for span in firing.spans:
                if span is not None:
                    span.end()
    for firing in advanced:
        if firing.error:
            logger.warning("schedule %s: %s", firing.name, firing.error,
                           extra={"action": "schedule_invalid", "schedule": firing.name, **log})
        for plan in firing.due.fire:
            logger.debug("schedule %s fired plan %s", firing.name, plan,
                         extra={"action": "schedule_fired", "schedule": firing.name, **log})
    return fired


async def _without_busy_keys(conn: psycopg.AsyncConnection[Any], firings: list[_Firing],
                             log: dict[str, str]) -> list[_Firing]:
    """The firings to enqueue now: those whose serial key a session holds are held back, due,
    for a later firing. Found by a try of each key, not by a lock wait: the batch (or, split,
    the savepoints before its commit) would wait for it, and every other tenant's plan in the
    same transaction with it (a hostile enqueue left open held them for the whole timeout)."""
    keyed = [f.name for f in firings if f.schedule["serial_key"] is not None]
    if not keyed:
        return firings
    cur = await conn.execute(BUSY_SERIAL_KEYS, {"names": keyed})
    busy = {name for (name,) in await cur.fetchall()}
    for name in sorted(busy):
        logger.warning("schedule %s: its serial key is held by a session; it fires later", name,
                       extra={"action": "schedule_lock_busy", "schedule": name, **log})
    return [f for f in firings if f.name not in busy]


async def _fire_together(conn: psycopg.AsyncConnection[Any], firings: list[_Firing],
                         stopped: dict[str, str]) -> None:
    plans = [(f.name, plan, parent) for f in firings
             for plan, parent in zip(f.due.fire, f.parents, strict=True)]
    if plans:
        await conn.execute(ENQUEUE_BATCH, {
            "names": [name for name, _, _ in plans],
            "at": [plan_text(plan) for _, plan, _ in plans],
            "keys": [plan_key(name, plan) for name, plan, _ in plans],
            "traceparents": [parent for _, _, parent in plans]})
        faults.hit("schedule.enqueued", conn)
    await _advance(conn, firings, stopped)


async def _advance(conn: psycopg.AsyncConnection[Any], firings: list[_Firing],
                   stopped: dict[str, str]) -> None:
    await conn.execute(ADVANCE_BATCH, {
        "names": [f.name for f in firings] + list(stopped),
        "nexts": [f.due.next_fire_at for f in firings] + [None] * len(stopped),
        "lasts": [f.due.fire[-1] if f.due.fire else None for f in firings]
                 + [None] * len(stopped),
        "errors": [f.error for f in firings] + list(stopped.values())})


async def _fire_one(conn: psycopg.AsyncConnection[Any], firing: _Firing,
                    log: dict[str, str]) -> bool:
    """Fire one schedule in a savepoint of its own (a batch was refused): a refused enqueue,
    or a lock held past BATCH_LOCK_TIMEOUT, holds back this schedule only. False: held back."""
    name, due = firing.name, firing.due
    extra = {"schedule": name, **log}
    try:
        async with conn.transaction():
            if due.fire:
                await conn.execute(ENQUEUE_PLANS, {
                    "name": name, "at": [plan_text(p) for p in due.fire],
                    "keys": [plan_key(name, p) for p in due.fire],
                    "traceparents": firing.parents})
                faults.hit("schedule.enqueued", conn)
            await conn.execute(ADVANCE, {"name": name, "next": due.next_fire_at,
                                         "last": due.fire[-1] if due.fire else None,
                                         "error": firing.error})
    except psycopg.errors.LockNotAvailable:
        # Its serial key (or row) is held by a session: a later firing takes it.
        logger.warning("schedule %s: a lock its firing needs is held; it fires later", name,
                       extra={"action": "schedule_lock_busy", **extra})
        return False
    except psycopg.Error as exc:
        if transient(exc):
            raise
        # The enqueue refused what the schedule holds (an input over a lowered size limit, a
        # handler name the runs table refuses): every plan would fail alike, so it stops,
        # visibly, until set_schedule changes it.
        logger.error("schedule %s cannot fire: %s", name, error_text(exc),
                     extra={"action": "schedule_invalid", **extra})
        await conn.execute(ADVANCE, {"name": name, "next": None, "last": None,
                                     "error": error_text(exc)})
        return False
    return True
