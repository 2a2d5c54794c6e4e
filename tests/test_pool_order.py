"""A worker's pool (db.open_pool) hands out the connection returned last: one after another,
a worker's trips go to one server session, warm in the CPU's caches, instead of to each of
its sessions in turn (psycopg_pool's own order). Checked on a real pool, through psycopg_pool's
public interface: a psycopg_pool that stopped keeping its idle connections where open_pool
puts its own list fails here."""

from __future__ import annotations

import asyncio

import psycopg
from psycopg_pool import AsyncConnectionPool

from runpool.db import open_pool
from tests.helpers import scalar, wait_for

BACKEND = "SELECT pg_backend_pid()"


async def _backend(pool: AsyncConnectionPool) -> int:
    async with pool.connection() as conn:
        row = await (await conn.execute(BACKEND)).fetchone()
        assert row is not None
        return int(row[0])


def test_pool__one_after_another_uses_the_connection_returned_last(dsn: str) -> None:
    async def main() -> tuple[list[int], set[int]]:
        pool = await open_pool(dsn, size=4, name="test-pool-order")
        try:
            sequential = [await _backend(pool) for _ in range(8)]
            # Work side by side still gets a session each.
            gate, out, checked_out = asyncio.Event(), asyncio.Event(), []

            async def held() -> int:
                async with pool.connection() as conn:
                    checked_out.append(conn)
                    if len(checked_out) == 4:
                        out.set()
                    await gate.wait()
                    row = await (await conn.execute(BACKEND)).fetchone()
                    assert row is not None
                    return int(row[0])

            tasks = [asyncio.create_task(held()) for _ in range(4)]
            await asyncio.wait_for(out.wait(), 10)
            gate.set()
            return sequential, set(await asyncio.gather(*tasks))
        finally:
            await pool.close()

    sequential, side_by_side = asyncio.run(main())
    assert len(set(sequential)) == 1, sequential  # FIFO: each of the 4 in turn
    assert len(side_by_side) == 4


def test_pool__the_session_used_last_broken_is_replaced(
        conn: psycopg.Connection, dsn: str) -> None:
    async def main() -> tuple[int, int]:
        pool = await open_pool(dsn, size=2, name="test-pool-order-broken")
        try:
            first = await _backend(pool)
            scalar(conn, "SELECT pg_terminate_backend(%s)", first)
            wait_for(lambda: not scalar(conn, "SELECT count(*) FROM pg_stat_activity"
                                        " WHERE pid = %s", first), what="the session gone")
            # The broken session fails the statement that meets it; the pool then drops it
            # and the next checkout gets a live one.
            try:
                await _backend(pool)
            except psycopg.OperationalError:
                pass
            return first, await _backend(pool)
        finally:
            await pool.close()

    first, after = asyncio.run(main())
    assert after != first
