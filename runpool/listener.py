"""The worker's dedicated LISTEN connection: wake-ups and cancel requests, with reconnects."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import uuid
from collections.abc import Callable
from typing import Final

import psycopg

from .db import aconnect, application_name
from .errors import one_line

__all__ = ["CANCEL", "LISTEN_NAME", "NOISE_LOG_SECONDS", "SCHEDULES", "WAKEUP", "ClaimBudget",
           "Listener", "NoiseLog"]

logger = logging.getLogger("runpool.listener")

WAKEUP: Final = "runpool_wakeup"
CANCEL: Final = "runpool_cancel"
# Rung when a schedule's timing changes (0010): the scheduler re-reads its earliest plan.
SCHEDULES: Final = "runpool_schedules"
# Channel names are fixed identifiers, so plain static SQL is enough. The connection waits
# idle by design: a server-wide idle_session_timeout (set to reap forgotten sessions) would
# otherwise close it every few seconds, and each reconnect loses the notices sent meanwhile.
LISTEN: Final = ("LISTEN runpool_wakeup; LISTEN runpool_cancel; LISTEN runpool_schedules;"
                 " SET idle_session_timeout = 0")
# The LISTEN connection's application_name, before "@host" (unless its DSN names it).
LISTEN_NAME: Final = "runpool-listen"
# Seconds between two log lines about ignored (malformed) cancel notices.
NOISE_LOG_SECONDS: Final = 10.0


class NoiseLog:
    """Counts what any login can cause at will (malformed or forged notices, full relay
    queues) and says when to log it: one line per NOISE_LOG_SECONDS at most, with the count
    since the line before, so a flood cannot flood the log too."""

    def __init__(self) -> None:
        self._count = 0
        self._logged = -math.inf

    def count(self, n: int = 1) -> int:
        """Add `n`; the count to log now, or 0 while the last line is too recent."""
        self._count += n
        now = time.monotonic()
        if now - self._logged < NOISE_LOG_SECONDS:
            return 0
        count, self._count, self._logged = self._count, 0, now
        return count


class ClaimBudget:
    """How many fruitless claims wake-ups may cost a worker: `burst` in a row, then `rate` per
    second (a token bucket). Any login can NOTIFY runpool_wakeup; without a budget a flood
    keeps every idle worker claiming back to back. A claim that finds work refills the budget:
    a doorbell that led to work was worth answering, so a pool whose workers race for each
    enqueued run (all wake, one wins) is never slowed, while a flood that never leads to work
    costs each worker `rate` empty claims per second."""

    def __init__(self, *, rate: float = 10.0, burst: float = 10.0) -> None:
        self._rate = rate
        self._burst = burst
        self._tokens = burst
        self._at = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now

    def spend(self) -> None:
        """Count one claim that found nothing."""
        self._refill()
        self._tokens -= 1

    def found_work(self) -> None:
        """Count a claim that found work: the budget is full again."""
        self._tokens = self._burst
        self._at = time.monotonic()

    def delay(self) -> float:
        """Seconds to wait before the next wake-up may claim (0: now)."""
        self._refill()
        return 0.0 if self._tokens >= 1 else (1 - self._tokens) / self._rate



class Listener:
    """Sets `wake` on every doorbell, calls `on_cancel(run_id)` on every cancel notice and
    `on_schedules()` on every schedule notice.

    After each (re)connect it sets `wake` too, because notifications sent while it was away are
    lost: the worker then claims once to catch up (and, after a reconnect, `on_schedules()`:
    the scheduler looks again); `on_connect()` is told of every connect (the relay's workers
    must catch up after a relay of their host restarted, too).
    """

    def __init__(
        self,
        dsn: str,
        wake: asyncio.Event,
        on_cancel: Callable[[uuid.UUID], None],
        *,
        worker_id: uuid.UUID,
        on_schedules: Callable[[], None] | None = None,
        on_connect: Callable[[], None] | None = None,
    ) -> None:
        self._dsn = dsn
        self._on_connect = on_connect
        self._wake = wake
        self._on_cancel = on_cancel
        self._on_schedules = on_schedules
        self._worker_id = worker_id
        self.connected = asyncio.Event()
        self.reconnects = 0
        self.backend_pid: int | None = None
        # Malformed cancel notices ignored.
        self._noise = NoiseLog()

    async def run(self) -> None:
        delay = 0.1
        while True:
            try:
                conn = await aconnect(self._dsn, autocommit=True, listen=True,
                                      name=application_name(LISTEN_NAME))
            except psycopg.OperationalError as exc:
                logger.warning(
                    "listen connection failed: %s", one_line(exc),
                    extra={"action": "listen_connect_failed", "worker_id": str(self._worker_id)},
                )
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(delay * 2, 5.0)
                continue
            try:
                async with conn:
                    await conn.execute(LISTEN)
                    self.backend_pid = conn.info.backend_pid
                    self.connected.set()
                    delay = 0.1
                    self._wake.set()
                    if self.reconnects and self._on_schedules is not None:
                        self._on_schedules()
                    if self._on_connect is not None:
                        self._on_connect()
                    async for notice in conn.notifies():
                        self._dispatch(notice.channel, notice.payload)
            except psycopg.OperationalError as exc:
                self.connected.clear()
                self.reconnects += 1
                logger.warning(
                    "listen connection lost, reconnecting: %s", exc,
                    extra={"action": "listen_lost", "worker_id": str(self._worker_id)},
                )
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(delay * 2, 5.0)

    def _dispatch(self, channel: str, payload: str) -> None:
        if channel == WAKEUP:
            self._wake.set()
        elif channel == CANCEL:
            try:
                run_id = uuid.UUID(payload)
            except ValueError:
                self._ignore(payload)
                return
            self._on_cancel(run_id)
        elif channel == SCHEDULES and self._on_schedules is not None:
            self._on_schedules()

    def _ignore(self, payload: str) -> None:
        # Anyone with LISTEN/NOTIFY rights can send noise; it must never hurt a worker, nor
        # flood its log.
        if count := self._noise.count():
            logger.info(
                "ignoring %d malformed cancel notices (last: %r)", count, payload[:100],
                extra={"action": "cancel_notice_ignored", "worker_id": str(self._worker_id),
                       "count": count},
            )
