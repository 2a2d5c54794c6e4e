"""The host relay's check of cancel notices against the database, before any reaches a worker.

Any login can NOTIFY runpool_cancel. Unchecked, a sustained flood of forged cancels filled
every worker's relay socket, so the real cancels among them were dropped and their runs learned
of their cancel only from the next heartbeat (up to lease/3 later, seconds to minutes). The
relay now reads which of the named runs are held with a cancel request, one query per batch of
notices on its own LISTEN connection (the host's connection budget does not grow), and passes
on only those: a forged notice costs a row lookup, not a datagram to every worker. A run
passed on is not passed on again for FORWARD_SPACING (a flood naming a real cancelled run
sends one datagram a second, not one per notice). Where the read cannot be made (a statement
timeout, a role that may not read runs), the notices go on unchecked, as before, for the next
RECHECK_SECONDS: each worker checks what it is sent anyway.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from itertools import islice
from typing import Any, Final

import psycopg

from .errors import one_line
from .listener import LISTEN, NoiseLog
from .queries import QUERIES

__all__ = ["CancelConfirm"]

logger = logging.getLogger("runpool.relay")

# Run ids per confirming read: each is an index lookup, so one read stays a few milliseconds,
# and doorbells that arrive meanwhile wait at most that long.
BATCH: Final = 5_000
# Notices waiting to be confirmed, at most (about 200 bytes each); past it a notice is dropped
# (and counted): the heartbeat reads every held run's cancel flag anyway.
PENDING_MAX: Final = 100_000
# Seconds before a run passed on may be passed on again.
FORWARD_SPACING: Final = 1.0
# Bounds the confirming read: it shares the connection with the host's doorbells.
SET_TIMEOUT: Final = "SET statement_timeout = 2000"
# Seconds notices go on unchecked after a read failed: a lock held for minutes (a migration)
# must cost the doorbells one timed-out read per this long, not one per batch.
RECHECK_SECONDS: Final = 10.0


class CancelConfirm:
    """`add(run_id)` for each cancel notice; `flush(conn)` after each batch of notices, on the
    LISTEN connection they came on, calls `forward(run_id)` for those the database confirms;
    `reset()` when that connection is new (the workers then read every flag themselves)."""

    def __init__(self, forward: Callable[[uuid.UUID], None]) -> None:
        self._forward = forward
        # Insertion-ordered set: a notice repeated within a batch is read once.
        self._pending: dict[uuid.UUID, None] = {}
        # Runs passed on, by when (monotonic), oldest first.
        self._forwarded: OrderedDict[uuid.UUID, float] = OrderedDict()
        # The connection whose statement_timeout is set.
        self._timed: psycopg.AsyncConnection[Any] | None = None
        # Until when (monotonic) notices go on unchecked, after a failed read.
        self._unchecked_until = -math.inf
        self.unconfirmed = 0
        self.dropped = 0
        self.failed_reads = 0
        # Notices that named no run being cancelled (forged, or their run ended before the
        # read), and batches passed on unchecked: each logged with its count, not each time.
        self._noise = NoiseLog()
        self._failures = NoiseLog()

    def add(self, run_id: uuid.UUID) -> None:
        if len(self._pending) < PENDING_MAX:
            self._pending[run_id] = None
        else:
            self.dropped += 1

    def reset(self) -> None:
        """Notices flow anew: those pending are left to the workers' catch-up read."""
        self.dropped += len(self._pending)
        self._pending.clear()

    async def flush(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Confirm what is pending, BATCH ids per read. A lost connection raises (the listener
        reconnects, and the workers catch up); anything else passes the batch on unchecked."""
        if not self._pending:
            return
        while self._pending:
            ids = list(islice(self._pending, BATCH))
            for run_id in ids:
                del self._pending[run_id]
            if time.monotonic() < self._unchecked_until:
                self._send(set(ids))
                continue
            try:
                if conn is not self._timed:
                    await conn.execute(SET_TIMEOUT)
                    self._timed = conn
                cur = await conn.execute(QUERIES["confirm_cancel_notices"], {"ids": ids})
                confirmed = {row[0] for row in await cur.fetchall()}
            except psycopg.errors.QueryCanceled as exc:
                self._unchecked(ids, exc)
                continue
            except psycopg.OperationalError:
                raise
            except psycopg.Error as exc:  # a role that may not read runs, say
                self._unchecked(ids, exc)
                continue
            self._send(confirmed)
            noise = len(ids) - len(confirmed)
            self.unconfirmed += noise
            if noise and (count := self._noise.count(noise)):
                logger.info("dropped %d cancel notices naming no run with a cancel request",
                            count, extra={"action": "relay_cancel_unconfirmed", "count": count})
        # The LISTEN again, a no-op to the server: pg_stat_activity shows a session's last
        # statement, and that is how an operator (and the tests) tell the host's LISTEN
        # connection at a glance.
        await conn.execute(LISTEN)

    def _send(self, run_ids: set[uuid.UUID]) -> None:
        now = time.monotonic()
        forwarded = self._forwarded
        # Amortised O(1): each entry is dropped once, from the old end.
        while forwarded and now - forwarded[next(iter(forwarded))] >= FORWARD_SPACING:
            forwarded.popitem(last=False)
        for run_id in run_ids:
            if run_id not in forwarded:
                forwarded[run_id] = now
                self._forward(run_id)

    def _unchecked(self, ids: list[uuid.UUID], exc: psycopg.Error) -> None:
        self.failed_reads += 1
        self._unchecked_until = time.monotonic() + RECHECK_SECONDS
        if count := self._failures.count(len(ids)):
            logger.warning("could not check %d cancel notices, passed them on unchecked: %s",
                           count, one_line(exc),
                           extra={"action": "relay_cancel_check_failed", "count": count})
        self._send(set(ids))
