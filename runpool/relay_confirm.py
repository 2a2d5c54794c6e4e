"""The host relay's check of cancel notices against the database, before any reaches a worker.

Any login can NOTIFY runpool_cancel. Unchecked, a sustained flood of forged cancels filled
every worker's relay socket, so the real cancels among them were dropped and their runs learned
of their cancel only from the next heartbeat (up to lease/3 later, seconds to minutes). The
relay now reads which of the named runs are held with a cancel request and passes on only
those: a forged notice costs a row lookup, not a datagram to every worker. A run passed on is
not passed on again for FORWARD_SPACING (a flood naming a real cancelled run sends one datagram
a second, not one per notice).

The reads go on a connection of their own (on the work DSN, opened as the relay starts: one
opened at the first cancel cost those cancels a connect, W9's p99 9.2 ms against 6.3), in a
task of their own, never on the LISTEN connection: a statement there makes the server send
every notification queued for it along with the answer, and under a flood psycopg then holds
the server's whole queue in memory (a first version grew by 130 MB a second under two flooding
sessions), while the doorbells waited behind the reads. At most BATCH ids wait for a read: past
that, a notice is dropped and every worker is asked to read its runs' cancel flags instead
(`recheck`, which the relay sends at most twice a second), so a real cancel among the dropped
still lands. Where a read fails (its timeout, a lock, a lost connection), the notices become a
recheck too, and so do those of the next UNCHECKED_SECONDS, with no read: passing them on
unchecked (as before the check) let a flood through to fill the workers' queues, every full
queue asking for a recheck.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

import psycopg

from .db import aconnect, application_name
from .errors import one_line
from .listener import NoiseLog
from .queries import QUERIES

__all__ = ["CONFIRM_NAME", "CancelConfirm"]

logger = logging.getLogger("runpool.relay")

# The confirming connection's application_name, before "@host" (`status` counts it as work;
# runpool.db.CHECK_NAME is another: a pooled pool's start-up check of its LISTEN DSN).
CONFIRM_NAME: Final = "runpool-relay"
# Run ids waiting for a read, at most: each is an index lookup, so a read stays a few
# milliseconds (5,000 ids: 11 ms).
BATCH: Final = 5_000
# Seconds before a run passed on may be passed on again.
FORWARD_SPACING: Final = 1.0
# Seconds a read may take before its notices go on unchecked.
READ_SECONDS: Final = 2.0
# Seconds notices become a recheck with no read after a read failed: a lock held for minutes
# (a migration) must cost one timed-out read per this long, not one per batch.
UNCHECKED_SECONDS: Final = 10.0


class CancelConfirm:
    """`add(run_id)` for each cancel notice (on the relay's loop); `run()`, a task, reads which
    are confirmed on a connection to `dsn` (`stateless`: behind a pooler) and calls
    `forward(run_id)` for each, and `recheck()` when notices were dropped unread (too many, or
    the read failed); `reset()` when
    the LISTEN connection is new (the workers then read every flag themselves)."""

    def __init__(self, dsn: str, *, stateless: bool, forward: Callable[[uuid.UUID], None],
                 recheck: Callable[[], None]) -> None:
        self._dsn = dsn
        self._stateless = stateless
        self._forward = forward
        self._recheck = recheck
        # Insertion-ordered set: a notice repeated before its read is read once.
        self._pending: dict[uuid.UUID, None] = {}
        self._ready = asyncio.Event()
        # Runs passed on, by when (monotonic), oldest first.
        self._forwarded: OrderedDict[uuid.UUID, float] = OrderedDict()
        self._conn: psycopg.AsyncConnection[Any] | None = None
        # Until when (monotonic) notices become a recheck with no read, after a failed read.
        self._unchecked_until = -math.inf
        self.unconfirmed = 0
        self.dropped = 0
        self.failed_reads = 0
        # Notices that named no run being cancelled (forged, or their run ended before the
        # read), notices dropped past BATCH, and failed reads: each logged with its count, at
        # most every NOISE_LOG_SECONDS.
        self._noise = NoiseLog()
        self._floods = NoiseLog()
        self._failures = NoiseLog()

    def add(self, run_id: uuid.UUID) -> None:
        if len(self._pending) < BATCH or run_id in self._pending:
            self._pending[run_id] = None
            self._ready.set()
            return
        self.dropped += 1
        if count := self._floods.count():
            logger.info("dropped %d cancel notices past %d waiting for their check: the"
                        " workers read their runs' cancel flags instead", count, BATCH,
                        extra={"action": "relay_cancel_overflow", "count": count})
        self._recheck()

    def reset(self) -> None:
        """Notices flow anew: those pending are left to the workers' catch-up read."""
        self.dropped += len(self._pending)
        self._pending.clear()

    async def run(self) -> None:
        try:
            # Now, not at the first cancel: a database that cannot be reached is retried at
            # the first read.
            with contextlib.suppress(psycopg.Error, TimeoutError):
                await asyncio.wait_for(self._connection(), READ_SECONDS)
            while True:
                await self._ready.wait()
                self._ready.clear()
                ids = list(self._pending)
                self._pending.clear()
                if ids:
                    await self._check(ids)
        finally:
            await self._close()

    async def _check(self, ids: list[uuid.UUID]) -> None:
        if time.monotonic() < self._unchecked_until:
            self.dropped += len(ids)
            self._recheck()
            return
        try:
            confirmed = await asyncio.wait_for(self._read(ids), READ_SECONDS)
        except (psycopg.Error, TimeoutError) as exc:
            # The connection may be mid-statement or gone: a new one for the next read.
            await self._close()
            self.dropped += len(ids)
            self.failed_reads += 1
            self._unchecked_until = time.monotonic() + UNCHECKED_SECONDS
            if count := self._failures.count(len(ids)):
                logger.warning(
                    "could not check %d cancel notices: the workers read their runs' cancel"
                    " flags instead, for %.0f s: %s", count, UNCHECKED_SECONDS,
                    one_line(exc) or type(exc).__name__,
                    extra={"action": "relay_cancel_check_failed", "count": count})
            self._recheck()
            return
        # In the notices' order.
        self._send([run_id for run_id in ids if run_id in confirmed])
        noise = len(ids) - len(confirmed)
        self.unconfirmed += noise
        if noise and (count := self._noise.count(noise)):
            logger.info("dropped %d cancel notices naming no run with a cancel request",
                        count, extra={"action": "relay_cancel_unconfirmed", "count": count})

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None:
            self._conn = await aconnect(self._dsn, autocommit=True, stateless=self._stateless,
                                        name=application_name(CONFIRM_NAME))
        return self._conn

    async def _read(self, ids: list[uuid.UUID]) -> set[uuid.UUID]:
        conn = await self._connection()
        cur = await conn.execute(QUERIES["confirm_cancel_notices"], {"ids": ids})
        return {row[0] for row in await cur.fetchall()}

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                await conn.close()

    def _send(self, run_ids: list[uuid.UUID]) -> None:
        now = time.monotonic()
        forwarded = self._forwarded
        # Amortised O(1): each entry is dropped once, from the old end.
        while forwarded and now - forwarded[next(iter(forwarded))] >= FORWARD_SPACING:
            forwarded.popitem(last=False)
        for run_id in run_ids:
            if run_id not in forwarded:
                forwarded[run_id] = now
                self._forward(run_id)
