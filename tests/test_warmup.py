"""A worker session plans its hot statements when the pool opens it (runpool.warmup): the
first claims and outcome batches of a pool use those plans instead of planning anew."""

from __future__ import annotations

import asyncio
import functools
import uuid
from typing import Any

import psycopg

from runpool.claiming import claim
from runpool.db import open_pool
from runpool.enqueue import RunSpec, enqueue_many
from runpool.outcomes import Outcome, finish_params
from runpool.queries import QUERIES
from runpool.warmup import plan_ahead

# How many times each of the session's prepared statements ran (PostgreSQL counts its plans),
# in the order psycopg prepared them (it names them _pg3_0, _pg3_1, ...).
PREPARED = """
SELECT generic_plans + custom_plans FROM pg_prepared_statements
ORDER BY substring(name FROM '[0-9]+$')::int
"""


def test_plan_ahead__the_first_claim_and_finish_use_the_plans_made_when_the_session_opened(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    ids = enqueue_many(conn, [RunSpec("acme", "noop", {"n": i}) for i in range(3)])
    conn.commit()
    worker = uuid.uuid4()
    handlers = ["noop", "other"]

    async def main() -> tuple[list[int], list[int], list[uuid.UUID],
                              list[tuple[uuid.UUID, str]]]:
        pool = await open_pool(dsn, size=1, name="warmup-test", prepare=functools.partial(
            plan_ahead, worker_id=worker, lease_seconds=30.0, handlers=handlers))
        try:
            async with pool.connection() as c:
                before = [n for (n,) in await (await c.execute(PREPARED)).fetchall()]
                # As the worker claims: its handlers, its lease, no reap or promotion (those
                # are not planned ahead).
                got = await claim(c, limit=10, worker_id=worker, lease_seconds=30.0,
                                  handlers=handlers, reap_expired=False, promote=False,
                                  no_jit=False)
                outcomes = [Outcome(r.id, r.attempt, "succeeded", result=b'{"ok": 1}')
                            for r in got]
                finished = await (await c.execute(QUERIES["finish_runs"],
                                                  finish_params(outcomes))).fetchall()
                after = [n for (n,) in await (await c.execute(PREPARED)).fetchall()]
                return before, after, [r.id for r in got], finished
        finally:
            await pool.close()

    before, after, claimed, finished = asyncio.run(main())
    # The claim's upkeep (6 statements), touch_worker, lock_tenants, claim_runs and
    # finish_runs, prepared and run once when the session opened ...
    assert before == [1] * 10
    # ... are the ones the claim and the finish ran (psycopg keys a prepared statement by its
    # text and its parameters' types: with other types they would have been parsed and
    # planned anew, unprepared, until their fifth run).
    assert after == [1] * 7 + [2, 2, 2]
    assert sorted(claimed) == sorted(ids)
    assert sorted(finished) == sorted((i, "succeeded") for i in ids)


def test_plan_ahead__claims_and_writes_nothing(dsn: str, conn: psycopg.Connection[Any]) -> None:
    ids = enqueue_many(conn, [RunSpec("acme", "noop", {})] * 2)
    conn.commit()

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
            await plan_ahead(c, worker_id=uuid.uuid4(), lease_seconds=30.0, handlers=["noop"])

    asyncio.run(main())
    rows = conn.execute("SELECT status, attempt FROM runpool.runs WHERE id = ANY(%s)",
                        (ids,)).fetchall()
    assert rows == [("queued", 0), ("queued", 0)]
    assert conn.execute("SELECT count(*) FROM runpool.run_events WHERE kind <> 'enqueued'"
                        ).fetchone() == (0,)
