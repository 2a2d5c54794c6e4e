"""Writes finished attempts in batches: one statement for every outcome ready at the time."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from .queries import QUERIES

__all__ = ["Outcome", "OutcomeWriter"]

logger = logging.getLogger("runpool.outcomes")

OutcomeKind = Literal["succeeded", "failed", "cancelled", "retry"]


def _raw(data: Any) -> Any:
    return data


@dataclass(frozen=True, slots=True)
class Outcome:
    run_id: uuid.UUID
    attempt: int
    kind: OutcomeKind
    # Pre-serialised JSON (bytes), so a value that cannot be stored never reaches a batch.
    result: bytes | None = None
    error: bytes | None = None
    retry_delay: float = 0.0


class OutcomeWriter:
    """Batches outcomes from all slots of a worker.

    Batches form naturally: while one statement is in flight, the outcomes finished meanwhile
    wait in the queue and all go in the next one.
    """

    def __init__(self, pool: AsyncConnectionPool, *, worker_id: uuid.UUID) -> None:
        self._pool = pool
        self._worker_id = worker_id
        self._queue: asyncio.Queue[tuple[Outcome, asyncio.Future[str | None]]] = asyncio.Queue()

    async def submit(self, outcome: Outcome) -> str | None:
        """Record an outcome; returns the run's new status, or None if the attempt no longer
        held its lease (the write was fenced)."""
        done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        await self._queue.put((outcome, done))
        return await done

    async def run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty() and len(batch) < 500:
                batch.append(self._queue.get_nowait())
            await self._write(batch)

    async def _write(self, batch: list[tuple[Outcome, asyncio.Future[str | None]]]) -> None:
        outcomes = [o for o, _ in batch]
        params = {
            "ids": [o.run_id for o in outcomes],
            "attempts": [o.attempt for o in outcomes],
            "outcomes": [o.kind for o in outcomes],
            "results": [None if o.result is None else Jsonb(o.result, _raw) for o in outcomes],
            "errors": [None if o.error is None else Jsonb(o.error, _raw) for o in outcomes],
            "delays": [o.retry_delay for o in outcomes],
        }
        delay = 0.05
        for attempt in range(8):
            try:
                async with self._pool.connection() as conn:
                    cur = await conn.execute(QUERIES["finish_runs"], params)
                    statuses = {run_id: status for run_id, status in await cur.fetchall()}
                break
            except psycopg.OperationalError as exc:
                # The database is unreachable: keep trying for a while; if it stays away the
                # leases expire and the runs are reclaimed elsewhere, which is the safe outcome.
                logger.warning(
                    "writing %d outcomes failed (try %d): %s", len(batch), attempt + 1, exc,
                    extra={"action": "outcome_write_failed", "worker_id": str(self._worker_id)},
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        else:
            statuses = {}
        for outcome, done in batch:
            if not done.done():
                done.set_result(statuses.get(outcome.run_id))
