from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

import runpool
from runpool.claiming import claim, reap
from runpool.db import aconnect
from runpool.queries import QUERIES
from tests.helpers import events, finish_params, run_row, scalar, wait_for


async def _claimer(dsn: str, claimed: list[uuid.UUID], ready: asyncio.Barrier) -> None:
    worker_id = uuid.uuid4()
    async with await aconnect(dsn, autocommit=True) as conn:
        await ready.wait()  # all eight connected: release them together
        while True:
            got = await claim(conn, worker_id=worker_id, limit=7, lease_seconds=30)
            if not got:
                return
            claimed.extend(r.id for r in got)


def test_claim__8_claimers_race_over_1000_runs_each_claimed_once(
        conn: psycopg.Connection, dsn: str) -> None:
    ids = runpool.enqueue_many(conn, [runpool.RunSpec(f"t{i % 5}", "noop") for i in range(1000)])

    async def main() -> list[uuid.UUID]:
        claimed: list[uuid.UUID] = []
        ready = asyncio.Barrier(8)
        await asyncio.gather(*(_claimer(dsn, claimed, ready) for _ in range(8)))
        return claimed

    claimed = asyncio.run(main())
    assert Counter(claimed) == Counter(ids)
    assert conn.execute(
        "SELECT count(*) FROM runpool.runs WHERE status = 'running' AND attempt = 1"
    ).fetchone() == (1000,)


def test_claim__takes_priority_then_age(conn: psycopg.Connection, dsn: str) -> None:
    low = runpool.enqueue(conn, "t", "noop", priority=0)
    high = runpool.enqueue(conn, "t", "noop", priority=5)
    later_low = runpool.enqueue(conn, "t", "noop", priority=0)

    async def main() -> list[uuid.UUID]:
        async with await aconnect(dsn, autocommit=True) as c:
            return [r.id for r in await claim(c, worker_id=uuid.uuid4(), limit=3,
                                              lease_seconds=30)]

    assert asyncio.run(main()) == [high, low, later_low]


def test_lease_expired__reclaimed_with_next_attempt(conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "t", "noop")

    async def claim_once(lease: float) -> list[runpool.claiming.ClaimedRun]:
        async with await aconnect(dsn, autocommit=True) as c:
            return await claim(c, worker_id=uuid.uuid4(), limit=1, lease_seconds=lease)

    first = asyncio.run(claim_once(0.3))
    assert [(r.id, r.attempt, r.reclaimed) for r in first] == [(run_id, 1, False)]
    # The lease is live: nobody else gets the run.
    assert asyncio.run(claim_once(30)) == []
    wait_for(lambda: scalar(conn, "SELECT lease_expires_at < now() FROM runpool.runs"),
             what="lease expiry")
    second = asyncio.run(claim_once(30))
    assert [(r.id, r.attempt, r.reclaimed) for r in second] == [(run_id, 2, True)]
    assert events(conn, run_id) == ["enqueued", "claimed", "reclaimed", "claimed"]


def test_claim__reclaimed_only_after_a_reap_not_a_retry_or_release__and_the_queue_wait(
        conn: psycopg.Connection, dsn: str) -> None:
    """What the workers' runpool.runs.reclaimed and runpool.run.wait count (runpool.metrics)."""
    retried, released = (runpool.enqueue(conn, "t", "noop") for _ in range(2))
    # Claimable for 5 s already (by the database's clock): that is the wait the claim tells.
    conn.execute("UPDATE runpool.runs SET available_at = now() - interval '5 s'")
    worker_id = uuid.uuid4()

    async def claim_all() -> dict[uuid.UUID, runpool.claiming.ClaimedRun]:
        async with await aconnect(dsn, autocommit=True) as c:
            got = await claim(c, worker_id=worker_id, limit=5, lease_seconds=30)
        return {r.id: r for r in got}

    first = asyncio.run(claim_all())
    assert all(5 <= r.waited < 60 and not r.reclaimed for r in first.values())
    # A failed attempt retried at once, and one released by a draining worker.
    params = {**finish_params([(retried, 1)]), "outcomes": ["retry"],
              "errors": [Jsonb({"reason": "boom"})]}
    assert conn.execute(QUERIES["finish_runs"], params).fetchall() == [(retried, 1, "queued")]
    conn.execute(QUERIES["release_runs"], {"ids": [released], "attempts": [1],
                                           "worker_id": worker_id})
    second = asyncio.run(claim_all())
    assert {i: (r.attempt, r.reclaimed) for i, r in second.items()} == {
        retried: (2, False), released: (2, False)}
    assert all(0 <= r.waited < 5 for r in second.values())


def test_lease_expired_on_last_attempt__fails_with_lease_expired(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "t", "noop", max_attempts=1)
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1,"
                 " lease_expires_at = now() - interval '1 second'")

    async def main() -> int:
        async with await aconnect(dsn, autocommit=True) as c:
            return await reap(c)

    assert asyncio.run(main()) == 1
    row = run_row(conn, run_id)
    assert (row["status"], row["error"]["reason"]) == ("failed", "lease_expired")


def test_heartbeat__renews_only_the_current_attempt(conn: psycopg.Connection) -> None:
    run_id = runpool.enqueue(conn, "t", "noop")
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 2,"
                 " lease_expires_at = now() + interval '1 second'")
    params = {"ids": [run_id], "lease_seconds": 60, "worker_id": uuid.uuid4()}
    stale = conn.execute(QUERIES["heartbeat"], {**params, "attempts": [1]}).fetchall()
    assert stale == []
    current = conn.execute(QUERIES["heartbeat"], {**params, "attempts": [2]}).fetchall()
    assert current == [(run_id, False, None)]  # not cancelled, not overdue
    assert conn.execute("SELECT lease_expires_at > now() + interval '50 seconds'"
                        " FROM runpool.runs").fetchone() == (True,)


def test_zombie_heartbeat_after_its_lease_expired__does_not_revive_it_past_the_quota(
        conn: psycopg.Connection, dsn: str) -> None:
    """Found by the soak: a worker frozen past its lease renewed it on waking, after another
    worker had claimed in its place, and the tenant ran two runs on a quota of one."""
    conn.execute("SELECT runpool.set_tenant_quota('t', 1)")
    first, second = (runpool.enqueue(conn, "t", "noop") for _ in range(2))
    frozen, other = uuid.uuid4(), uuid.uuid4()
    (got,) = asyncio.run(_claim_once(dsn, frozen))
    conn.execute("UPDATE runpool.runs SET lease_expires_at = now() - interval '1 second'"
                 " WHERE id = %s", (got,))
    # The expired lease no longer counts: the other worker may claim the tenant's next run.
    assert asyncio.run(_claim_once(dsn, other, reap_expired=False)) == [second]
    beat = conn.execute(QUERIES["heartbeat"], {
        "ids": [first], "attempts": [1], "lease_seconds": 60, "worker_id": frozen}).fetchall()
    assert beat == []  # not held: the frozen worker abandons the run
    assert scalar(conn, "SELECT count(*) FROM runpool.runs WHERE status = 'running'"
                  " AND lease_expires_at > now()") == 1


async def _claim_once(dsn: str, worker_id: uuid.UUID, **options: Any) -> list[uuid.UUID]:
    async with await aconnect(dsn, autocommit=True) as c:
        got = await claim(c, worker_id=worker_id, limit=5, lease_seconds=30, **options)
    return [r.id for r in got]


def test_finish__fenced_by_attempt(conn: psycopg.Connection) -> None:
    run_id = runpool.enqueue(conn, "t", "noop")
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 2,"
                 " lease_expires_at = now() + interval '30 seconds'")
    stale = conn.execute(QUERIES["finish_runs"], finish_params([(run_id, 1)])).fetchall()
    assert stale == []
    assert run_row(conn, run_id)["status"] == "running"
    assert conn.execute(QUERIES["finish_runs"], finish_params([(run_id, 2)])).fetchall() == [
        (run_id, 2, "succeeded")]


def test_claim__without_promote_a_due_run_waits_for_a_claim_that_promotes(
        conn: psycopg.Connection, dsn: str) -> None:
    # A busy worker's refill claims leave the promotion of due runs to a cadence (see
    # wakeups.PROMOTE_INTERVAL): such a claim must not see a run whose time came since.
    due = runpool.enqueue(conn, "acme", "noop", run_at=datetime.now(UTC) + timedelta(seconds=0.3))
    wait_for(lambda: scalar(conn, "SELECT available_at <= now() FROM runpool.runs WHERE id = %s",
                            due), what="the run's time to come")

    async def main() -> tuple[list[uuid.UUID], list[uuid.UUID]]:
        async with await aconnect(dsn, autocommit=True) as c:
            worker = uuid.uuid4()
            skipped = await claim(c, worker_id=worker, limit=5, lease_seconds=30, promote=False)
            promoted = await claim(c, worker_id=worker, limit=5, lease_seconds=30)
            return [r.id for r in skipped], [r.id for r in promoted]

    assert asyncio.run(main()) == ([], [due])


def _claim_in(conn: psycopg.Connection, limit: int) -> list[uuid.UUID]:
    """lock_tenants then claim_runs in the caller's open transaction (not committed)."""
    params = {"handlers": ["noop"], "limit": limit, "roomy": False}
    conn.execute(QUERIES["lock_tenants"], params)
    rows = conn.execute(QUERIES["claim_runs"], {
        **params, "worker_id": uuid.uuid4(), "lease_seconds": 30})
    return [r[0] for r in rows]


def test_claim__claimers_of_a_tenant_without_quota_take_runs_side_by_side_not_in_turn(
        conn: psycopg.Connection, dsn: str) -> None:
    """Only a quota needs its tenant's lock (W16's herd: every claimer queued on one tenant
    row). A claim still open holds its runs: a second claimer of a tenant without a quota
    takes the next ones at once, never the same; of a tenant with one it takes nothing this
    time (the tenant is skipped, never waited for, and said so), and all once the lock goes."""
    runpool.enqueue_many(conn, [runpool.RunSpec("free", "noop") for _ in range(20)])
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        second.execute("SET lock_timeout = '2s'")
        held = _claim_in(first, 5)
        assert len(held) == 5
        taken = _claim_in(second, 5)
        assert len(taken) == 5 and not set(taken) & set(held)
        second.commit()
        first.commit()
        conn.execute("SELECT runpool.set_tenant_quota('free', 100)")
        held = _claim_in(first, 5)
        assert len(held) == 5
        # (The lock_timeout stays: a claimer that waited would fail, not hang.)
        assert _claim_in(second, 5) == []
        assert second.execute(QUERIES["lock_tenants"],
                              {"handlers": ["noop"], "limit": 5, "roomy": False}
                              ).fetchall() == [("free", True, True)]
        second.rollback()
        first.commit()
        assert len(_claim_in(second, 5)) == 5
        second.commit()
