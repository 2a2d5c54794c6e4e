"""A worker's doorbells (runpool.doorbells): rung after the writes committed, in a transaction
of their own, one statement at a time, spaced under load; a ring that fails is dropped (the
runs' followers poll) without touching the worker."""

from __future__ import annotations

import asyncio
import uuid

from psycopg import sql

from runpool.db import aconnect, open_pool
from runpool.doorbells import BURST, GAP, Doorbells
from runpool.live import channel


def test_rung_runs__each_is_heard_on_its_own_channel(dsn: str) -> None:
    ids = [uuid.uuid4() for _ in range(5)]

    async def main() -> tuple[set[str], Doorbells]:
        pool = await open_pool(dsn, size=2, name="test-doorbells")
        try:
            async with await aconnect(dsn, autocommit=True) as listener:
                for run_id in [*ids, uuid.uuid4()]:  # and one nobody rings
                    await listener.execute(
                        sql.SQL("LISTEN {}").format(sql.Identifier(channel(run_id))))
                bells = Doorbells(pool)
                bells.ring(ids[:2])
                bells.ring(ids[2:])
                await bells.close()
                heard: set[str] = set()
                async for notice in listener.notifies(timeout=5):
                    heard.add(notice.channel)
                    if len(heard) == len(ids):
                        break
                return heard, bells
        finally:
            await pool.close()

    heard, bells = asyncio.run(main())
    assert heard == {channel(r) for r in ids}
    assert bells.rung == len(ids) and 1 <= bells.rings <= 2


def test_rings_under_load__a_burst_then_one_per_gap(dsn: str) -> None:
    """Runs written one after another, each its own ring() (a loaded worker's commits): the
    rings go one statement at a time, BURST at once, then at most one per GAP; every run is
    rung."""

    async def main() -> tuple[Doorbells, float, int]:
        pool = await open_pool(dsn, size=2, name="test-doorbells")
        try:
            bells = Doorbells(pool)
            loop = asyncio.get_running_loop()
            began = loop.time()
            n = 0
            while loop.time() - began < 0.3:
                bells.ring([uuid.uuid4()])
                n += 1
                await asyncio.sleep(0.0005)
            await bells.close()
            return bells, loop.time() - began, n
        finally:
            await pool.close()

    bells, seconds, n = asyncio.run(main())
    assert bells.rung == n
    assert bells.rings <= BURST + seconds / GAP + 1, (bells.rings, seconds, n)
    assert bells.rings < n  # runs written meanwhile went together


def test_a_ring_that_fails__is_dropped_and_the_next_goes(dsn: str) -> None:
    async def main() -> tuple[tuple[int, int], Doorbells]:
        pool = await open_pool(dsn, size=1, name="test-doorbells")
        try:
            bells = Doorbells(pool)
            async with pool.connection() as conn:
                # The pool's one session: its ring's statement fails (_ring reads the bound).
                await conn.execute("SET runpool.notify_queue_limit = 'not a number'")
            bells.ring([uuid.uuid4()])
            await asyncio.wait_for(bells.close(), 30)
            failed = _counts(bells)
            async with pool.connection() as conn:
                await conn.execute("RESET runpool.notify_queue_limit")
            bells.ring([uuid.uuid4()])
            await asyncio.wait_for(bells.close(), 30)
            return failed, bells
        finally:
            await pool.close()

    failed, bells = asyncio.run(main())
    assert failed == (1, 0)
    assert _counts(bells) == (2, 1)


def _counts(bells: Doorbells) -> tuple[int, int]:
    return bells.rings, bells.rung
