"""A group commit's batches as trips (runpool.batch_sends.send_all): on worker sessions one
simple query of the batch statements they prepared, their JSON as one literal; behind a
transaction-mode pooler, psycopg's pipeline. What each write stores is the same either way."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from runpool.commits import MAX_INFLIGHT, CommitGroup
from runpool.context import Run
from runpool.db import aconnect, connect
from runpool.doorbells import Doorbells
from runpool.enqueue import RunSpec, enqueue_many
from runpool.live import channel
from runpool.pooled import Route
from runpool.pools import open_pool
from runpool.trips import HOT_STATEMENTS, Via

# The runs as a worker holds them (attempt 1), as runpool.harness.turn_cost does.
HOLD = """
UPDATE runpool.runs SET status = 'running', attempt = 1, started_at = now(),
       lease_expires_at = now() + interval '1 hour'
WHERE id = ANY(%s)
"""
# The batch statements a session prepared (the trips' names, runpool.trips.BATCHES).
PREPARED = "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'runpool_batch_%'"
# Contents a tenant may send: quotes, backslashes, SQL, escapes, non-ASCII, deep nesting.
HOSTILE: list[Any] = [
    "it's", "\\", "\\\\'", "'); DROP TABLE runpool.runs; --", "$$", "E'\\x41'", "\u00e9\u4e2d",
    "\U0001f600", {"'": "\\\"", "k\\": ["\t\n\r"]}, [[[[["deep"]]]]], None, 1e308, -0.0, "",
    "%(rows)s", "%s", "$1",
]


def _held(dsn: str, n: int) -> list[uuid.UUID]:
    with connect(dsn, autocommit=True) as conn:
        ids = enqueue_many(conn, [RunSpec("acme", "agent", {})] * n)
        conn.execute(HOLD, (ids,))
        return ids


async def _write_all(dsn: str, ids: list[uuid.UUID], *, via: Via | Route) -> tuple[int, int]:
    """Every run writes each HOSTILE content as a message, all at once through one group;
    the group's commits, and how many pool sessions prepared the batch statements. Each
    run's doorbell was rung once its writes committed (the batch statements ring none)."""
    size = MAX_INFLIGHT + 1
    pool: AsyncConnectionPool = await open_pool(dsn, size=size, name="commit-trips",
                                                stateless=via != "prepared")
    listener = await aconnect(dsn, autocommit=True)
    try:
        for run_id in ids:
            await listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel(run_id))))
        bells = Doorbells(pool)
        # Every batch rings after its commit (as a loaded worker's do), so that every
        # run's doorbell rings through `bells`.
        group = CommitGroup(pool, via=via, doorbells=bells, busy_commits=0)

        async def agent(run_id: uuid.UUID) -> None:
            run = Run(id=run_id, tenant="acme", handler="agent", attempt=1, input={},
                      pool=pool, commits=group)
            for content in HOSTILE:
                await run.add_message("assistant", content)

        await asyncio.wait_for(asyncio.gather(*(agent(r) for r in ids)), 60)
        await bells.close()
        unheard = {channel(r) for r in ids}
        async for notice in listener.notifies(timeout=10):
            unheard.discard(notice.channel)
            if not unheard:
                break
        assert not unheard, f"{len(unheard)} of {len(ids)} runs' doorbells never rang"
        assert bells.rings <= group.commits, (bells.rings, group.commits)  # rung together
        # Every session of the pool at once, each asked what it prepared.
        conns = [await pool.getconn(timeout=10) for _ in range(size)]
        try:
            prepared = [(await (await c.execute(PREPARED)).fetchone() or (0,))[0]
                        for c in conns]
        finally:
            for c in conns:
                await pool.putconn(c)
        return group.commits, sum(1 for n in prepared if n)
    finally:
        await listener.close()
        await pool.close()


@pytest.mark.parametrize("via", ["prepared", "functions", "pipeline"])
def test_batches__as_trips_on_worker_sessions__store_what_each_write_said(
        dsn: str, via: Via) -> None:
    ids = _held(dsn, 40)
    commits, sessions = asyncio.run(_write_all(dsn, ids, via=via))
    writes = len(ids) * len(HOSTILE)
    assert commits < writes / 4, (commits, writes)  # batched
    # Trips of prepared statements prepare the batch statements on the sessions that sent
    # them; trips of their functions (behind a pooler) and the pipeline never.
    assert (sessions > 0) is (via == "prepared"), sessions
    _stored_once(dsn, ids)


def _stored_once(dsn: str, ids: list[uuid.UUID]) -> None:
    with connect(dsn, autocommit=True) as conn:
        for run_id in ids:
            stored = [content for (content,) in conn.execute(
                "SELECT content FROM runpool.messages WHERE run_id = %s ORDER BY seq",
                (run_id,))]
            assert stored == HOSTILE


def test_batches__a_batch_function_gone_falls_back_and_loses_nothing(dsn: str) -> None:
    """Behind a pooler, a batch statement's function dropped (by hand, or made for a schema a
    migration changed since): the trip rolled back whole, the route turns to the pipeline,
    and the writes go again that way, each stored once."""
    ids = _held(dsn, 40)
    with connect(dsn, autocommit=True) as conn:
        (function,) = [h.function.decode() for h in HOT_STATEMENTS
                       if h.name == b"runpool_batch_message"]
        conn.execute(sql.SQL("DROP FUNCTION runpool.{}").format(sql.Identifier(function)))
    route = Route("functions")
    commits, _ = asyncio.run(_write_all(dsn, ids, via=route))
    assert route.via == "pipeline"
    assert commits < len(ids) * len(HOSTILE) / 4  # batched all the same
    _stored_once(dsn, ids)


def test_trips_of_one_kind__psycopg_keeps_none_of_their_strings(dsn: str) -> None:
    """A trip of one kind is one statement, its JSON inline: a distinct string each time,
    which psycopg's per-connection cache of queries (counted to decide what to prepare) kept
    even with prepare=False, up to 100 a connection (attack15: 19.5 MB a connection after
    195 kB writes), pushing out the statements it should prepare."""
    ids = _held(dsn, 40)

    async def main() -> list[int]:
        pool: AsyncConnectionPool = await open_pool(dsn, size=MAX_INFLIGHT + 1,
                                                    name="commit-trips")
        try:
            group = CommitGroup(pool)
            runs = [Run(id=run_id, tenant="acme", handler="agent", attempt=1, input={},
                        pool=pool, commits=group) for run_id in ids]
            for turn in range(5):  # messages of every run at once: batches of one kind
                await asyncio.gather(*(run.add_message("tool", {"page": f"{turn}" + "x" * 1000})
                                       for run in runs))
            assert group.commits < len(ids) * 5 / 4, group.commits  # batched
            conns = [await pool.getconn(timeout=10) for _ in range(MAX_INFLIGHT + 1)]
            try:
                # psycopg's own bookkeeping (no public view of it): the strings it counts.
                return [sum(1 for key in c._prepared._counts if b"runpool_batch" in key[0])
                        for c in conns]
            finally:
                for c in conns:
                    await pool.putconn(c)
        finally:
            await pool.close()

    assert asyncio.run(main()) == [0] * (MAX_INFLIGHT + 1)


# An operator's policy on messages: its refusal's SQLSTATE is one a missing function's call
# raises too, and its message quotes the tenant's text.
POLICY = """
CREATE FUNCTION public.policy() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.content::text LIKE '%forbidden%' THEN
        RAISE EXCEPTION 'refused by policy: %', NEW.content::text
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER policy BEFORE INSERT ON runpool.messages
    FOR EACH ROW EXECUTE FUNCTION public.policy();
"""


def test_batches__a_refusal_naming_hot_from_deeper_down_is_the_writes_own(dsn: str) -> None:
    """A tenant whose text says "hot_" in an error an operator's trigger raises (42501 here)
    gets its write refused, alone; the worker's route stays on the functions."""
    ids = _held(dsn, 40)
    with connect(dsn, autocommit=True) as conn:
        conn.execute(POLICY)
    route = Route("functions")

    async def main() -> list[BaseException | None]:
        pool = await open_pool(dsn, size=MAX_INFLIGHT + 1, name="commit-trips", stateless=True)
        try:
            group = CommitGroup(pool, via=route)

            async def agent(run_id: uuid.UUID) -> BaseException | None:
                run = Run(id=run_id, tenant="acme", handler="agent", attempt=1, input={},
                          pool=pool, commits=group)
                await run.add_message("assistant", "fine")
                try:
                    await run.add_message("assistant", "forbidden: drop hot_functions")
                except psycopg.Error as exc:
                    refused: BaseException | None = exc
                else:
                    refused = None
                await run.add_message("assistant", "after")
                return refused

            return await asyncio.wait_for(asyncio.gather(*(agent(r) for r in ids)), 60)
        finally:
            await pool.close()

    refusals = asyncio.run(main())
    assert all(isinstance(r, psycopg.errors.InsufficientPrivilege) for r in refusals)
    assert route.via == "functions"
    with connect(dsn, autocommit=True) as conn:
        stored = conn.execute("SELECT count(*) FROM runpool.messages").fetchone()
        assert stored == (2 * len(ids),)
