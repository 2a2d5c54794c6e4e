"""A worker session plans its hot statements when the pool opens it (runpool.warmup): the
first claims and outcome batches of a pool use those plans instead of planning anew."""

from __future__ import annotations

import asyncio
import functools
import uuid
from typing import Any

import psycopg

from runpool.claiming import claim
from runpool.enqueue import RunSpec, enqueue_many
from runpool.outcomes import Outcome, finish_params
from runpool.pools import open_pool
from runpool.queries import QUERIES
from runpool.trips import Trip
from runpool.warmup import UPKEEP, plan_ahead

# How many times each of the session's prepared statements ran (PostgreSQL counts its plans).
PREPARED = "SELECT name, generic_plans + custom_plans FROM pg_prepared_statements"
PLANNED_AHEAD = {f"runpool_{n}" for n in
                 (*UPKEEP, "touch_worker", "lock_tenants", "claim_runs", "finish_runs")}


async def _runs(c: psycopg.AsyncConnection[Any]) -> dict[str, int]:
    return {name: n for name, n in await (await c.execute(PREPARED)).fetchall()}


def test_plan_ahead__the_first_claim_and_finish_use_the_plans_made_when_the_session_opened(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    ids = enqueue_many(conn, [RunSpec("acme", "noop", {"n": i}) for i in range(3)])
    conn.commit()
    worker = uuid.uuid4()
    handlers = ["noop", "other"]

    async def main() -> tuple[dict[str, int], dict[str, int], list[uuid.UUID],
                              list[tuple[uuid.UUID, int, str]]]:
        pool = await open_pool(dsn, size=1, name="warmup-test", prepare=functools.partial(
            plan_ahead, worker_id=worker, lease_seconds=30.0, handlers=handlers))
        try:
            async with pool.connection() as c:
                before = await _runs(c)
                # As the worker claims and finishes: its handlers, its lease, a trip each.
                got = await claim(c, limit=10, worker_id=worker, lease_seconds=30.0,
                                  handlers=handlers, reap_expired=False, promote=False,
                                  via="prepared")
                outcomes = [Outcome(r.id, r.attempt, "succeeded", result=b'{"ok": 1}')
                            for r in got]
                trip = Trip(c)
                answer = await trip.execute(QUERIES["finish_runs"], finish_params(outcomes))
                await trip.send()
                after = await _runs(c)
                return before, after, [r.id for r in got], await answer.fetchall()
        finally:
            await pool.close()

    before, after, claimed, finished = asyncio.run(main())
    # Every statement of the claim and the batch was prepared, and run (planned) once, when
    # the session opened; the serial keys' three are prepared only.
    assert {name for name, n in before.items() if n == 1} == PLANNED_AHEAD
    assert {name for name, n in before.items() if n == 0} == {
        "runpool_defer_serial_release", "runpool_lock_ended_serial_keys",
        "runpool_release_serial_keys"}
    # The claim and the finish ran those plans: nothing was prepared again.
    assert after == before | {"runpool_lock_tenants": 2, "runpool_claim_runs": 2,
                              "runpool_finish_runs": 2}
    assert sorted(claimed) == sorted(ids)
    assert sorted(finished) == sorted((i, 1, "succeeded") for i in ids)


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
