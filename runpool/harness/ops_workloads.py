"""W17: what the retention purge costs, and what dropping partitions would cost instead.

A scratch database gets `runs` finished runs a week old, each with what an agent run leaves
(10 messages, 4 tool calls, 6 run events, 3 status events), beside 2,000 queued runs. Then:
the claim latency with nobody purging; the same while the purge runs as the pools' purger
does (batches of 1,000 runs, each its own transaction, back to back); the purge's rate and its
batches' durations. Then the partitioned alternative for one table: the same messages in a
table partitioned by day, and the time to detach and drop the day's partition.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any, Final

from ..claiming import claim
from ..db import aconnect, connect
from ..queries import QUERIES
from ..retention import BATCH_SIZE
from ..testing.databases import scratch_database
from .measure import percentile

__all__ = ["w17_purge"]

# Finished runs a week old with their rows, set-based (what pools would have left behind).
SEED: Final = """
WITH r AS (
    INSERT INTO runpool.runs (tenant, handler, status, attempt, max_attempts, rank, started_at,
                              finished_at, result)
    SELECT 'old', 'agent', 'succeeded', 1, 3, 0, now() - interval '8 days',
           now() - interval '8 days' + g * interval '1 ms', '{"ok": true}'
    FROM generate_series(1, %(runs)s) g
    RETURNING id
), m AS (
    INSERT INTO runpool.messages (run_id, seq, role, content, attempt)
    SELECT r.id, s, 'assistant', jsonb_build_object('text', repeat('x', 200)), 1
    FROM r, generate_series(1, 10) s
), t AS (
    INSERT INTO runpool.tool_calls (run_id, call_id, name, arguments, status, result, attempt,
                                    finished_at)
    SELECT r.id, 'c' || s, 'lookup', '{"q": 1}', 'succeeded', '{"found": 1}', 1, now()
    FROM r, generate_series(1, 4) s
), e AS (
    INSERT INTO runpool.run_events (run_id, kind, attempt) SELECT r.id, 'x', 1
    FROM r, generate_series(1, 6) s
)
INSERT INTO runpool.status_events (run_id, seq, status, attempt)
SELECT r.id, s, 'running', 1 FROM r, generate_series(2, 4) s
"""
QUEUE: Final = "SELECT count(runpool.enqueue('live', 'noop')) FROM generate_series(1, 2000)"
PURGE_BATCH: Final = "SELECT runpool._purge_batch(interval '7 days', %(batch)s)"
# The partitioned alternative: messages by day; the day past retention is one partition.
PARTITIONED: Final = [
    "CREATE TABLE part_messages (LIKE runpool.messages) PARTITION BY RANGE (created_at)",
    "CREATE TABLE part_old PARTITION OF part_messages FOR VALUES FROM"
    " ('-infinity') TO ('2000-01-02')",
    "CREATE TABLE part_new PARTITION OF part_messages FOR VALUES FROM"
    " ('2000-01-02') TO ('infinity')",
    "CREATE INDEX ON part_messages (run_id, seq)",
    "INSERT INTO part_messages SELECT run_id, seq, role, content, attempt, call_id,"
    " '2000-01-01', event_seq FROM runpool.messages",
]
DROP_PARTITION: Final = [
    "ALTER TABLE part_messages DETACH PARTITION part_old",
    "DROP TABLE part_old",
]
MESSAGES_OF_OLD: Final = "SELECT count(*) FROM runpool.messages"


async def _claims(dsn: str, stop: threading.Event, out: list[float]) -> None:
    """Claim 10 at a time and put them back (the queue stays as deep), timing each claim."""
    worker = uuid.uuid4()
    async with await aconnect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            t0 = time.perf_counter()
            got = await claim(conn, worker_id=worker, limit=10, lease_seconds=60)
            out.append((time.perf_counter() - t0) * 1000)
            await conn.execute(QUERIES["release_runs"], {
                "ids": [r.id for r in got], "attempts": [r.attempt for r in got],
                "worker_id": worker})


def _claiming(dsn: str, seconds: float | None, stop: threading.Event) -> tuple[threading.Thread,
                                                                              list[float]]:
    out: list[float] = []
    thread = threading.Thread(target=lambda: asyncio.run(_claims(dsn, stop, out)))
    thread.start()
    if seconds is not None:
        stop.wait(seconds)
        stop.set()
        thread.join()
    return thread, out


def w17_purge(server: str, *, runs: int = 50_000) -> dict[str, Any]:
    """W17 (see the module docstring)."""
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
        conn.execute(SEED, {"runs": runs})
        conn.execute(QUEUE)
        conn.execute("VACUUM ANALYZE")
        for statement in PARTITIONED:
            conn.execute(statement)
        messages = int(conn.execute(MESSAGES_OF_OLD).fetchone()[0])  # type: ignore[index]
        _, idle = _claiming(dsn, 5.0, threading.Event())
        stop = threading.Event()
        thread, during = _claiming(dsn, None, stop)
        batches: list[float] = []
        started = time.perf_counter()
        removed = 0
        try:
            while True:
                t0 = time.perf_counter()
                n = int(conn.execute(PURGE_BATCH, {"batch": BATCH_SIZE}).fetchone()[0])  # type: ignore[index]
                batches.append((time.perf_counter() - t0) * 1000)
                removed += n
                if n < BATCH_SIZE:
                    break
        finally:
            elapsed = time.perf_counter() - started
            stop.set()
            thread.join()
        t0 = time.perf_counter()
        for statement in DROP_PARTITION:
            conn.execute(statement)
        drop_ms = (time.perf_counter() - t0) * 1000
        rows_per_run = 10 + 4 + 6 + 3 + 1
        return {
            "workload": "W17", "runs": removed,
            "purge_runs_per_s": round(removed / elapsed),
            "purge_rows_per_s": round(removed * rows_per_run / elapsed),
            "batch_p50_ms": round(percentile(batches, 50), 1),
            "batch_p99_ms": round(percentile(batches, 99), 1),
            "claim_p50_ms_idle": round(percentile(idle, 50), 2),
            "claim_p99_ms_idle": round(percentile(idle, 99), 2),
            "claim_p50_ms_purging": round(percentile(during, 50), 2),
            "claim_p99_ms_purging": round(percentile(during, 99), 2),
            "partition_messages": messages, "partition_drop_ms": round(drop_ms, 1),
        }
