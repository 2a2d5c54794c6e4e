"""A worker's pool (pools.open_pool) hands out the connection returned last: one after another,
a worker's trips go to one server session, warm in the CPU's caches, instead of to each of
its sessions in turn (psycopg_pool's own order). Checked on a real pool, through psycopg_pool's
public interface: a psycopg_pool that stopped keeping its idle connections where open_pool
puts its own list fails here."""

from __future__ import annotations

import asyncio
import select
import types

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from runpool import pools
from runpool.pools import open_pool
from tests.helpers import scalar, wait_for

BACKEND = "SELECT pg_backend_pid()"


async def _backend(pool: AsyncConnectionPool) -> int:
    async with pool.connection() as conn:
        row = await (await conn.execute(BACKEND)).fetchone()
        assert row is not None
        return int(row[0])


async def _burst(pool: AsyncConnectionPool, n: int) -> list[int]:
    """The backends of `n` checkouts held at once (all out before any statement runs)."""
    gate, out, checked_out = asyncio.Event(), asyncio.Event(), []

    async def held() -> int:
        async with pool.connection() as conn:
            checked_out.append(conn)
            if len(checked_out) == n:
                out.set()
            await gate.wait()
            row = await (await conn.execute(BACKEND)).fetchone()
            assert row is not None
            return int(row[0])

    tasks = [asyncio.create_task(held()) for _ in range(n)]
    await asyncio.wait_for(out.wait(), 10)
    gate.set()
    return list(await asyncio.gather(*tasks))


def test_pool__one_after_another_uses_the_connection_returned_last(dsn: str) -> None:
    async def main() -> tuple[list[int], list[int]]:
        pool = await open_pool(dsn, size=4, name="test-pool-order")
        try:
            sequential = [await _backend(pool) for _ in range(8)]
            return sequential, await _burst(pool, 4)  # side by side: a session each
        finally:
            await pool.close()

    sequential, side_by_side = asyncio.run(main())
    assert len(set(sequential)) == 1, sequential  # FIFO: each of the 4 in turn
    assert len(set(side_by_side)) == 4


@pytest.mark.parametrize("looks", ["poll", "select"])
def test_pool__sessions_the_server_closed_while_idle_are_replaced_at_checkout(
        conn: psycopg.Connection, dsn: str, looks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every session of the pool closed by the server (a restart, say) while idle: no statement
    # meets one, neither the next one alone nor a burst using all four at once (the sessions
    # at the back of the pool's order, which only a burst reaches). `select`: where the
    # select module has no poll (Windows, for an embedded pool).
    if looks == "select":
        monkeypatch.setattr(pools, "select", types.SimpleNamespace(select=select.select))

    async def main() -> tuple[set[int], int, list[int]]:
        pool = await open_pool(dsn, size=4, name="test-pool-order-closed")
        try:
            before = set(await _burst(pool, 4))
            for pid in before:
                scalar(conn, "SELECT pg_terminate_backend(%s)", pid)
            wait_for(lambda: not scalar(conn, "SELECT count(*) FROM pg_stat_activity"
                                        " WHERE pid = ANY(%s)", list(before)),
                     what="the sessions gone")
            return before, await _backend(pool), await _burst(pool, 4)
        finally:
            await pool.close()

    before, alone, after = asyncio.run(main())
    assert len(before) == 4
    assert not before & {alone, *after}
    assert len(set(after)) == 4
