from __future__ import annotations

import asyncio
import threading
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta

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
    assert conn.execute(QUERIES["finish_runs"], params).fetchall() == [(retried, "queued")]
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


async def _claim_once(dsn: str, worker_id: uuid.UUID, **options: bool) -> list[uuid.UUID]:
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
        (run_id, "succeeded")]


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


def _claim_in(conn: psycopg.Connection, limit: int, worker_id: uuid.UUID | None = None
              ) -> list[uuid.UUID]:
    """lock_tenants then claim_runs in the caller's open transaction (not committed), as
    `worker_id` (by default a claimer no worker row announces)."""
    params = {"handlers": ["noop"], "limit": limit, "worker_id": worker_id or uuid.uuid4()}
    conn.execute(QUERIES["lock_tenants"], params)
    rows = conn.execute(QUERIES["claim_runs"], {
        **params, "lease_seconds": 30})
    return [r[0] for r in rows]


# Announce a worker (as a pool does before it claims) with `concurrency` slots.
REGISTER = """
INSERT INTO runpool.workers (id, host, pid, concurrency, handlers)
VALUES (%s, 'test', 1, %s, '{noop}')
"""


def test_claim__a_quota_that_cannot_bind__registered_workers_take_its_runs_side_by_side(
        conn: psycopg.Connection, dsn: str) -> None:
    """A quota above the tenant's live leases plus every worker's slots plus the claim cannot
    bind, whatever the claims in flight do: its tenant is locked in share mode, and two
    workers' claims take its runs side by side (with the exclusive lock they took turns: W1
    through the peer bench's quota of 100,000 drained slower on two workers than on one).
    Where it could bind, and for a claimer no worker row announces, the exclusive lock and the
    exact recount stay; an exclusive claimer skips the tenant while share holders are in
    flight (so its recount cannot miss their claims)."""
    runpool.enqueue_many(conn, [runpool.RunSpec("big", "noop") for _ in range(40)])
    one, two = uuid.uuid4(), uuid.uuid4()
    conn.execute(REGISTER, (one, 10))
    conn.execute(REGISTER, (two, 10))
    conn.execute("SELECT runpool.set_tenant_quota('big', 100)")  # 0 + 5 + 20 <= 100
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second, \
            psycopg.connect(dsn) as third:
        third.execute("SET lock_timeout = '2s'")
        held = _claim_in(first, 5, one)
        taken = _claim_in(second, 5, two)
        assert len(held) == 5 and len(taken) == 5 and not set(taken) & set(held)
        # An unannounced claimer must count exactly: it skips the share-locked tenant.
        assert _claim_in(third, 5) == []
        assert third.execute(QUERIES["lock_tenants"], {
            "handlers": ["noop"], "limit": 5, "worker_id": uuid.uuid4()}
        ).fetchall() == [("big", True, True)]
        third.rollback()
        first.commit()
        second.commit()
        # live 10: 10 + 5 + 20 > 34, so the quota could bind: exclusive, in turn, exact.
        conn.execute("SELECT runpool.set_tenant_quota('big', 34)")
        held = _claim_in(first, 5, one)
        assert len(held) == 5
        assert _claim_in(second, 5, two) == []
        second.rollback()
        first.commit()
        # live 15: the exact recount gives the last free quota and no more.
        conn.execute("SELECT runpool.set_tenant_quota('big', 17)")
        assert len(_claim_in(second, 5, two)) == 2
        second.commit()
    assert scalar(conn, "SELECT count(*) FROM runpool.runs WHERE status = 'running'") == 17


def test_claim__racing_claimers_around_the_roomy_bound__the_quota_is_never_exceeded(
        conn: psycopg.Connection, dsn: str) -> None:
    """Four announced workers of 3 slots (S = 12), each keeping at most its slots, and one
    claimer no worker row announces (it takes up to 10 a claim, always by the exclusive lock
    and the exact recount) claim one tenant at once, quota 20: the workers' claims are roomy
    (share mode) while live <= 5. Runs never end, so every claim adds; were an exclusive
    recount to miss share claims in flight, the total would pass 20."""
    runpool.enqueue_many(conn, [runpool.RunSpec("edge", "noop") for _ in range(80)])
    workers = [uuid.uuid4() for _ in range(4)]
    for w in workers:
        conn.execute(REGISTER, (w, 3))
    conn.execute("SELECT runpool.set_tenant_quota('edge', 20)")
    barrier = threading.Barrier(len(workers) + 1)
    errors: list[BaseException] = []

    def claimer(w: uuid.UUID | None) -> None:
        try:
            with psycopg.connect(dsn) as c:
                held = 0
                barrier.wait(timeout=30)
                for _ in range(40):
                    want = 10 if w is None else 3 - held
                    if want:
                        held += len(_claim_in(c, want, w))
                    c.commit()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(w,)) for w in [*workers, None]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert scalar(conn, "SELECT count(*) FROM runpool.runs WHERE status = 'running'") == 20


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
        assert second.execute(QUERIES["lock_tenants"], {"handlers": ["noop"], "limit": 5,
                                                          "worker_id": uuid.uuid4()}
                              ).fetchall() == [("free", True, True)]
        second.rollback()
        first.commit()
        assert len(_claim_in(second, 5)) == 5
        second.commit()
