"""A worker's doorbells (runpool.doorbells): rung after the writes committed, in a transaction
of their own, one statement at a time, spaced under load; a ring that fails is dropped (the
runs' followers poll) without touching the worker."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from runpool.commits import CommitGroup
from runpool.db import aconnect
from runpool.doorbells import BURST, GAP, TRIES, Doorbells
from runpool.live import channel
from runpool.logs import RunContextFilter, run_log_context
from runpool.pools import open_pool

from .helpers import until


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


def test_a_ring_that_fails__goes_again_and_after_its_tries_is_dropped(
        dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> tuple[tuple[int, int, int], tuple[int, int, int], Doorbells]:
        pool = await open_pool(dsn, size=1, name="test-doorbells")
        try:
            bells = Doorbells(pool)
            # The pool's one session: its rings' statements fail (_ring reads the bound).
            await _limit(pool, "'not a number'")
            bells.ring([uuid.uuid4()])
            await until(lambda: bells.failures == 1, "the ring's failure", interval=0.005)
            await _limit(pool, None)  # before its next try (RETRY_PAUSE)
            await until(lambda: bells.rung == 1, "the ring again", interval=0.005)
            again = _counts(bells)
            # Failing every time: dropped after TRIES, said at WARNING (as the worker's, not
            # as the run's whose write started the ring).
            await _limit(pool, "'not a number'")
            with run_log_context(run_id="the run that wrote"):
                bells.ring([uuid.uuid4()])
            await until(lambda: bells.failures == 1 + TRIES, "its tries", interval=0.005)
            await asyncio.wait_for(bells.close(), 30)
            dropped = _counts(bells)
            # A closing worker's ring that fails is dropped at once; the next goes.
            bells.ring([uuid.uuid4()])
            await asyncio.wait_for(bells.close(), 30)
            await _limit(pool, None)
            bells.ring([uuid.uuid4()])
            await asyncio.wait_for(bells.close(), 30)
            return again, dropped, bells
        finally:
            await pool.close()

    caplog.handler.addFilter(RunContextFilter())
    with caplog.at_level(logging.WARNING, logger="runpool.worker"):
        again, dropped, bells = asyncio.run(main())
    assert again == (2, 1, 1)  # (rings, failures, rung)
    assert dropped == (2 + TRIES, 1 + TRIES, 1)
    assert _counts(bells) == (4 + TRIES, 2 + TRIES, 2)
    drops = [r for r in caplog.records if getattr(r, "action", "") == "doorbells_dropped"]
    assert [getattr(r, "runs", None) for r in drops] == [1, 1]
    assert [getattr(r, "run_id", None) for r in drops] == [None, None]


async def _limit(pool: AsyncConnectionPool, value: str | None) -> None:
    async with pool.connection() as conn:
        if value is None:
            await conn.execute("RESET runpool.notify_queue_limit")
        else:
            await conn.execute(sql.SQL("SET runpool.notify_queue_limit = {}").format(
                sql.SQL(value)))


def _counts(bells: Doorbells) -> tuple[int, int, int]:
    return bells.rings, bells.failures, bells.rung


def test_a_group_is_loaded_by_its_last_windows_commits() -> None:
    """commits.BUSY_COMMITS: a group rings after its commits from the window after one with
    that many commits; a window with fewer, or a quiet spell, makes it ring in them again."""
    group = CommitGroup(AsyncConnectionPool("", open=False), busy_commits=3)
    assert not group._loaded(100.0)  # the first window begins
    group.commits += 2
    assert not group._loaded(100.05)  # (still in it)
    assert not group._loaded(100.12)  # two in the window: not loaded; the next begins
    group.commits += 3
    assert not group._loaded(100.17)
    assert group._loaded(100.24)  # three: loaded for the next window
    group.commits += 5
    assert group._loaded(100.3)
    assert not group._loaded(101.0)  # its window ended long ago: it counts none
    assert not CommitGroup(AsyncConnectionPool("", open=False), busy_commits=3)._loaded(0.0)
    assert CommitGroup(AsyncConnectionPool("", open=False), busy_commits=0)._loaded(0.0)
