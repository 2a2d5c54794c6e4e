"""The background purge: finished runs past RUNPOOL_RETENTION_SECONDS leave the database with
everything of theirs, one short batch per transaction, one pool at a time across the cluster.

Every pool runs a Purger; the database decides whose turn it is (runpool._purge_turn locks the
'purge' row of runpool.maintenance with SKIP LOCKED and keeps the next due time), so a cluster
of many pools purges as one purger would, and a pool that dies mid-turn leaves nothing held.
Each batch commits on its own: a purge never holds back vacuum (xmin) for longer than one batch,
and never waits for a lock (SKIP LOCKED rows, a 2 s lock_timeout).
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Final

import psycopg
from psycopg_pool import AsyncConnectionPool

from .deadlines import bounded
from .queries import QUERIES

__all__ = ["BATCH_SIZE", "Purger", "purge_every"]

logger = logging.getLogger("runpool.retention")

# Runs per batch: one batch is tens of milliseconds (W17, README: Performance), short
# enough that nothing queues behind its transaction.
BATCH_SIZE: Final = 1000
# The longest wait between two turns of the cluster's purge (and between two looks of one
# pool at whether it is due).
MAX_EVERY_SECONDS: Final = 60.0
# A batch that found a full batch to remove is followed by the next one after this pause: the
# backlog drains at full speed without one pool hogging a connection back to back.
BETWEEN_BATCHES_SECONDS: Final = 0.05
# Bound on one batch: it normally takes milliseconds.
BATCH_TIMEOUT_SECONDS: Final = 30.0


def purge_every(retention_seconds: float) -> float:
    """How often the cluster purges: a tenth of the retention (runs stay at most 10 % past
    it), at least every second, at most every MAX_EVERY_SECONDS."""
    return min(max(retention_seconds / 10, 1.0), MAX_EVERY_SECONDS)


class Purger:
    """A pool's part of the cluster's purge (see the module docstring)."""

    def __init__(self, pool: AsyncConnectionPool, *, retention_seconds: float,
                 log: dict[str, str], batch_size: int = BATCH_SIZE) -> None:
        self._pool = pool
        self._retention = retention_seconds
        self._every = purge_every(retention_seconds)
        self._batch = batch_size
        self._log = log

    async def run(self) -> None:
        """Until cancelled. A failed turn (database gone, a batch timing out) is logged and
        tried again at the next look: the purge must never stop the pool."""
        while True:
            try:
                removed = await self.turn()
            except (psycopg.Error, TimeoutError) as exc:
                logger.warning("purge turn failed: %r", exc,
                               extra={"action": "purge_failed", **self._log})
                removed = None
            if removed is not None and removed >= self._batch:
                await asyncio.sleep(BETWEEN_BATCHES_SECONDS)
                continue
            # Jittered, so the pools of a cluster do not all look at once.
            await asyncio.sleep(self._every * random.uniform(0.5, 1.0))

    async def turn(self) -> int | None:
        """One turn: None if it was another pool's (or not due), else the runs removed."""
        async with bounded(self._pool, BATCH_TIMEOUT_SECONDS) as conn:
            cur = await conn.execute(QUERIES["purge_turn"], {
                "older_than": self._retention, "batch_size": self._batch,
                "every": self._every})
            row = await cur.fetchone()
        removed = None if row is None or row[0] is None else int(row[0])
        if removed:
            logger.info("purged %d finished runs older than %gs", removed, self._retention,
                        extra={"action": "runs_purged", "runs": removed, **self._log})
        return removed
