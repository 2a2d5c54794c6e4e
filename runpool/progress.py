"""Progress: a handler's ephemeral events (streamed tokens, "searching…") for whoever follows
the run right now. Not stored with the run: the latest value of each run is published to an
unlogged table and its doorbell rung, coalesced by the worker to one publication per run per
FLUSH_SECONDS, all of a worker's runs in one statement; nothing a handler does with progress can
fail or slow its run (publication happens off the run's path; a failed one is logged and
dropped, the next carries the newer value)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Final

from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from .codec import dumps, jsonb
from .deadlines import bounded
from .errors import InvalidInput

__all__ = ["FLUSH_SECONDS", "MAX_PROGRESS_BYTES", "Publisher", "encode"]

logger = logging.getLogger("runpool.progress")

# Each run's progress is published at most this often: 200 runs emitting 20 events a second
# cost the database 10 coalesced publications per second per run, in one statement per worker.
FLUSH_SECONDS: Final = 0.1
# The largest progress value (its JSON text): what a NOTIFY payload may carry, although
# progress travels in a table; a follower's read stays small whatever a handler sends.
MAX_PROGRESS_BYTES: Final = 8000
# A publication that takes longer is abandoned (the next one carries the newer values).
WRITE_SECONDS: Final = 5.0

# Publish the latest progress of held runs and forget that of ended runs (see 0009).
PUBLISH: Final = ("SELECT runpool.publish_progress(%(ids)s::uuid[], %(attempts)s::integer[],"
                  " %(data)s::jsonb[], %(ended)s::uuid[])")


def encode(data: Any) -> bytes:
    """The progress value as JSON, or InvalidInput (nothing published): not JSON, or over
    MAX_PROGRESS_BYTES — a handler's bug, said at once rather than dropped silently."""
    text = dumps(data)
    if len(text) > MAX_PROGRESS_BYTES:
        raise InvalidInput(f"progress data is {len(text)} bytes of JSON, over the limit of"
                           f" {MAX_PROGRESS_BYTES} bytes")
    return text


class Publisher:
    """The worker's progress outbox: offer() never blocks; run() publishes in the background."""

    def __init__(self, pool: AsyncConnectionPool, *, log: dict[str, str]) -> None:
        self._pool = pool
        self._log = log
        self._pending: dict[uuid.UUID, tuple[int, bytes]] = {}
        # Runs whose progress row this worker wrote: forgotten (deleted) when they end.
        self._published: set[uuid.UUID] = set()
        self._ended: set[uuid.UUID] = set()
        self._wake = asyncio.Event()
        self.publications = 0

    def offer(self, run_id: uuid.UUID, attempt: int, data: bytes) -> None:
        """The run's latest progress; replaces any not yet published (coalescing)."""
        self._pending[run_id] = (attempt, data)
        self._wake.set()

    def ended(self, run_id: uuid.UUID) -> None:
        """The run's attempt ended here: its unpublished progress is dropped, its row deleted."""
        self._pending.pop(run_id, None)
        if run_id in self._published:
            self._published.discard(run_id)
            self._ended.add(run_id)
            self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            pending, self._pending = self._pending, {}
            ended, self._ended = self._ended, set()
            try:
                await self._publish(pending, ended)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # best effort: never the worker's failure
                logger.warning("progress not published (%d runs): %r", len(pending), exc,
                               extra={"action": "progress_dropped", **self._log})
                self._ended |= ended
            # The coalescing window: offers meanwhile replace each other.
            await asyncio.sleep(FLUSH_SECONDS)

    async def _publish(self, pending: dict[uuid.UUID, tuple[int, bytes]],
                       ended: set[uuid.UUID]) -> None:
        ids = list(pending)
        data: list[Jsonb] = [jsonb(pending[i][1]) for i in ids]
        async with bounded(self._pool, WRITE_SECONDS) as conn:
            await conn.execute(PUBLISH, {"ids": ids, "attempts": [pending[i][0] for i in ids],
                                         "data": data, "ended": list(ended)})
        self._published.update(ids)
        self.publications += len(ids)
