"""Runs' doorbells rung after their writes committed, in a transaction of their own.

Why: a transaction that NOTIFYs takes the server's one notification lock at its commit and
holds it until the commit is flushed (PostgreSQL's async.c), so every such commit waits for
the one before it, flush and all. W11 (2 × 1,000 runs, group-committed checkpoint writes that
each rang their runs' doorbells) had on average 1.5 backends waiting for that lock. A loaded
worker's checkpoint batches (runpool.commits BUSY_COMMITS) now commit without their rings, and
this rings their runs afterwards:

- one ring statement at a time per worker, the runs written meanwhile together in the next;
  BURST rings at once after a quiet spell, then at most one every GAP seconds (a token
  bucket). A ring costs the worker ~0.17 ms of CPU (psycopg's execute, measured on the bench
  host) and the server a commit, so a sustained load's rings are spaced;
- in a transaction that commits asynchronously (synchronous_commit off: a doorbell carries
  nothing that must survive a crash), so the notification lock is held for a moment, not
  through a flush;
- after the write's commit, as before: a follower woken by it reads the write.

A worker that is not loaded still rings in its writes' commits: ringing here costs a checkout
and a round trip, which put W12's follow p50 at 3-7 ms against 1-3 ms.

A ring that fails (a cut connection, a failover) is sent again after a pause growing from
RETRY_PAUSE, up to TRIES times in all for a run (counted afresh when the run writes again;
ringing twice costs a follower one read); then its runs are dropped, said at WARNING
(`doorbells_dropped`, one line a failed ring): followers and waiters poll as well, so a lost
ring delays them by at most their `poll` (the live-runs contract). A worker killed between a
commit and its ring loses the ring likewise. A closing worker (its drain done) drops what is
due at the first failure: its exit must not wait for rings. Writes made by
anyone else (the checkpoints API on a caller's connection, an operator's UPDATE,
resolve_tool_call) ring in their own transactions.

What a ring costs besides: a NOTIFY needs a transaction id, so each ring takes one and
writes a commit record (at most 200 a second a worker: a loaded pool's autovacuum freezes
that much sooner).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import Iterable
from typing import Final

from psycopg_pool import AsyncConnectionPool

from .deadlines import bounded

__all__ = ["Doorbells"]

logger = logging.getLogger("runpool.worker")

# Ring the runs' doorbells (runpool._ring: skipped while the server's notification queue is
# past its limit), committed without waiting for the WAL's flush. The ids come as one array
# literal of hex digits: psycopg dumps a list of UUIDs at ~5 us each.
RING: Final = """
SELECT count(runpool._ring(r.id)), pg_catalog.set_config('synchronous_commit', 'off', true)
FROM unnest(%(ids)s::text::uuid[]) AS r(id)
"""
# How long one ring may take before it is given up, how many times a run's ring is sent in
# all before it is dropped (the runs' followers then poll), and the pause before a failed
# ring's runs go again (with the runs written meanwhile).
RING_SECONDS: Final = 5.0
TRIES: Final = 4
RETRY_PAUSE: Final = 0.1
RETRY_PAUSE_MAX: Final = 2.0
# The rings a worker sends at once after a quiet spell, and the time from one to the next
# past them: at most 200 a second under sustained load (W11 rang ~0.55 times a turn without a
# bound, each ring ~0.17 ms of worker CPU and a commit). A follower of a loaded worker hears a
# write up to GAP later.
BURST: Final = 4
GAP: Final = 0.005


class Doorbells:
    """One per worker: the runs to ring, rung one statement at a time."""

    def __init__(self, pool: AsyncConnectionPool, *, log: dict[str, str] | None = None) -> None:
        self._pool = pool
        self._log = log or {}
        self._due: set[uuid.UUID] = set()
        # Runs whose ring failed, and how many times (until rung, or dropped at TRIES).
        self._failed: dict[uuid.UUID, int] = {}
        self._pause = RETRY_PAUSE  # after the next failure (RETRY_PAUSE again after a success)
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        # The rings that may go at once, as of `_at` (the loop's clock): BURST, less one a
        # ring, plus one every GAP.
        self._tokens = float(BURST)
        self._at = 0.0
        # Rings sent, those that failed, and the runs rung by the others (the tests' view).
        self.rings = 0
        self.failures = 0
        self.rung = 0

    def ring(self, run_ids: Iterable[uuid.UUID]) -> None:
        """Ring these runs' doorbells soon (their writes committed)."""
        if self._failed:  # (a new write: its run's ring gets its tries afresh)
            run_ids = list(run_ids)
            for run_id in run_ids:
                self._failed.pop(run_id, None)
        self._due.update(run_ids)
        if self._due and self._task is None:
            # In a context of its own: not the run's whose write started it (its log fields).
            self._task = asyncio.get_running_loop().create_task(
                self._ring_due(), context=contextvars.Context())

    async def _ring_due(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._due:
                now = loop.time()
                self._tokens = min(float(BURST), self._tokens + (now - self._at) / GAP)
                self._at = now
                if self._tokens < 1:
                    await asyncio.sleep((1 - self._tokens) * GAP)
                    continue
                self._tokens -= 1
                ids, self._due = self._due, set()
                self.rings += 1
                try:
                    async with bounded(self._pool, RING_SECONDS) as conn:
                        await conn.execute(RING, {"ids": _array(ids)})
                except Exception as exc:
                    self.failures += 1
                    self._again(ids, exc)
                    await asyncio.sleep(self._pause)
                    self._pause = min(self._pause * 4, RETRY_PAUSE_MAX)
                else:
                    self._pause = RETRY_PAUSE
                    self.rung += len(ids)
                    if self._failed:
                        for run_id in ids:
                            self._failed.pop(run_id, None)
        finally:
            self._task = None

    def _again(self, ids: set[uuid.UUID], exc: Exception) -> None:
        """A ring failed: its runs go again with the next, unless they have had TRIES."""
        dropped = 0
        if self._closing:
            dropped, self._due = len(self._due), set()
        for run_id in ids:
            tries = self._failed.get(run_id, 0) + 1
            if tries >= TRIES or self._closing:
                self._failed.pop(run_id, None)
                dropped += 1
            else:
                self._failed[run_id] = tries
                self._due.add(run_id)
        if dropped:
            logger.warning("%d runs' doorbells were not rung (%r): their followers see their"
                           " last writes at their next poll", dropped, exc,
                           extra={"action": "doorbells_dropped", "runs": dropped, **self._log})

    async def close(self) -> None:
        """Ring what is due (a draining worker's last writes); from now on a ring that fails
        is not sent again."""
        self._closing = True
        task = self._task
        if task is not None:
            await asyncio.shield(task)


def _array(ids: set[uuid.UUID]) -> str:
    """The ids as a PostgreSQL array literal (hex digits only: nothing to quote)."""
    return "{" + ",".join([run_id.hex for run_id in ids]) + "}"
