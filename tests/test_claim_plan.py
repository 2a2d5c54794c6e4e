"""The claim's cost does not grow with the queue under the worker's generic plans, even with no
statistics (a bulk load with autovacuum off, as in W1): pages a claim touches at 12,300 queued
runs against 300."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg

import runpool
from runpool.claiming import claim_statements, read_claimed
from runpool.db import WORKER_SESSION, aconnect

# Pages of runs (heap and indexes) this session read, as of its last flushed statistics.
PAGES = """
SELECT heap_blks_hit + heap_blks_read + idx_blks_hit + idx_blks_read
FROM pg_statio_user_tables WHERE schemaname = 'runpool' AND relname = 'runs'
"""
CLAIMS = 12


async def _pages_per_claim(dsn: str) -> float:
    """Claims of 10, each rolled back (the queue stays as it is), in a worker's session: the
    first five plan afresh, then psycopg prepares and the generic plan is used."""
    async with await aconnect(dsn, autocommit=True) as conn:
        await conn.execute(WORKER_SESSION)

        async def pages() -> int:
            await conn.execute("SELECT pg_stat_force_next_flush()")
            await conn.execute("SELECT pg_stat_clear_snapshot()")
            cur = await conn.execute(PAGES)
            row = await cur.fetchone()
            assert row is not None
            return int(row[0])

        async def one() -> int:
            async with conn.transaction(force_rollback=True):
                pending = await claim_statements(conn, worker_id=uuid.uuid4(), limit=10,
                                                 lease_seconds=30, reap_expired=False,
                                                 handlers=["noop"])
                return len(await read_claimed(pending))

        for _ in range(6):
            assert await one() == 10
        before = await pages()
        for _ in range(CLAIMS):
            await one()
        return (await pages() - before) / CLAIMS


def test_a_claim_reads_as_many_pages_at_12300_queued_runs_as_at_300(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    specs = [runpool.RunSpec("acme", "noop") for _ in range(300)]
    runpool.enqueue_many(conn, specs)
    conn.commit()
    shallow = asyncio.run(_pages_per_claim(dsn))
    runpool.enqueue_many(conn, [runpool.RunSpec("acme", "noop") for _ in range(12_000)])
    conn.commit()
    deep = asyncio.run(_pages_per_claim(dsn))
    # The code before read every queued run's row per claim (+240 pages here), then every
    # queued run's entry in runs_queued_tenant (+60); a claim's own pages are a few dozen.
    assert deep - shallow < 30, (shallow, deep)
