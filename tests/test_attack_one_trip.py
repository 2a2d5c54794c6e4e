"""Attacks on the one-round-trip claim (db.one_trip): a claim task cancelled mid-trip, a
statement of the trip failing, a transaction-local setting outliving its claim, a quota'd
tenant's row held open by an operator (skipped, never waited for)."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest

import runpool
from runpool.claiming import claim
from runpool.db import aconnect
from runpool.harness.measure import wait_until
from runpool.queries import QUERIES
from runpool.testing.proxy import Proxy

from .helpers import claim_cancelled_after, claim_told, running_pool, status_of, wait_for
from .pgbouncer import pgbouncer

IDLE = psycopg.pq.TransactionStatus.IDLE


async def _wait_lock(dsn: str, pid: int) -> None:
    async with await aconnect(dsn, autocommit=True) as watcher:
        for _ in range(500):
            cur = await watcher.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,))
            row = await cur.fetchone()
            if row and row[0] == "Lock":
                return
            await asyncio.sleep(0.01)
    raise AssertionError("the claim never waited on the tenant lock")



def _held_tenant_and_a_free_one(conn: psycopg.Connection, dsn: str) -> psycopg.Connection:
    """A run of quota'd tenant 'held' and one of 'free'; the returned (hostile) connection
    blocks every claim's tenant locks in an open transaction. A table lock: a quota'd tenant's
    row held open is skipped, never waited for (the tests below), but no claim can
    skip a lock on the table its locks need."""
    conn.execute("SELECT runpool.set_tenant_quota('held', 5)")
    runpool.enqueue(conn, "held", "noop")
    runpool.enqueue(conn, "free", "noop")
    conn.commit()
    hostile = psycopg.connect(dsn)
    hostile.execute("LOCK TABLE runpool.tenants IN EXCLUSIVE MODE")
    return hostile


def test_one_trip__a_claim_cancelled_while_blocked_rolls_back_and_leaves_idle(
        conn: psycopg.Connection, dsn: str) -> None:
    hostile = _held_tenant_and_a_free_one(conn, dsn)

    async def main() -> tuple[object, object, int]:
        async with await aconnect(dsn, autocommit=True) as c:
            task = asyncio.create_task(claim(c, limit=5, worker_id=uuid.uuid4(),
                                             lease_seconds=30, handlers=["noop"]))
            await _wait_lock(dsn, c.info.backend_pid)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            status = c.info.transaction_status
            pipe = c.pgconn.pipeline_status
            hostile.rollback()
            got = await claim(c, limit=5, worker_id=uuid.uuid4(), lease_seconds=30,
                              handlers=["noop"])
            return status, pipe, len(got)

    try:
        status, pipe, got = asyncio.run(main())
    finally:
        hostile.close()
    assert (status, pipe, got) == (IDLE, psycopg.pq.PipelineStatus.OFF, 2)
    assert {t for (t,) in conn.execute(
        "SELECT tenant FROM runpool.runs WHERE status = 'running'")} == {"held", "free"}


@pytest.mark.parametrize("delay_us", range(0, 3000, 191))
def test_one_trip__a_claim_cancelled_anywhere_strands_nothing_silently(
        conn: psycopg.Connection, dsn: str, delay_us: int) -> None:
    """Cancelled at any point: the connection is idle, out of pipeline mode, with no result
    pending; a run is claimed only if the claim returned it (committed-but-unread: the
    cancellation came after COMMIT was processed, reported below)."""
    runpool.enqueue_many(conn, [runpool.RunSpec(f"t{i}", "noop") for i in range(4)])
    conn.commit()

    async def main() -> tuple[object, object, bool, list[uuid.UUID]]:
        async with await aconnect(dsn, autocommit=True) as c:
            cancelled, got = await claim_cancelled_after(
                c, delay_us, limit=5, worker_id=uuid.uuid4(), lease_seconds=30,
                handlers=["noop"])
            status = c.info.transaction_status
            pipe = c.pgconn.pipeline_status
            cur = await c.execute("SELECT 42")
            assert await cur.fetchone() == (42,)
            return status, pipe, cancelled, got

    status, pipe, cancelled, got = asyncio.run(main())
    running = [r for (r,) in conn.execute("SELECT id FROM runpool.runs WHERE status = 'running'")]
    assert (status, pipe) == (IDLE, psycopg.pq.PipelineStatus.OFF)
    if not cancelled:
        assert sorted(running) == sorted(got)


def test_one_trip__a_trip_committed_after_its_connection_was_cut_is_reclaimed_once(
        conn: psycopg.Connection, dsn: str) -> None:
    """The whole trip reached the server, then the path broke while the claim waited on the
    tenants' lock: the server commits the claim nobody hears about. The run stays leased until
    the lease expires, then the next claim takes it again (attempt 2), once."""
    conn.execute("SELECT runpool.set_tenant_quota('held', 5)")
    run_id = runpool.enqueue(conn, "held", "noop")
    conn.commit()
    hostile = psycopg.connect(dsn)
    hostile.execute("LOCK TABLE runpool.tenants IN EXCLUSIVE MODE")
    proxy = Proxy(dsn)
    lost = uuid.uuid4()

    async def main() -> bool:
        c = await aconnect(proxy.dsn(dsn), autocommit=True)
        task = asyncio.create_task(claim(c, limit=5, worker_id=lost, lease_seconds=30,
                                         handlers=["noop"]))
        await _wait_lock(dsn, c.info.backend_pid)
        proxy.cut()
        hostile.commit()
        with pytest.raises(psycopg.OperationalError):
            await asyncio.wait_for(task, 10)
        return c.closed

    try:
        closed = asyncio.run(main())
    finally:
        hostile.close()
        proxy.close()
    assert closed
    # The server finished the claim behind the cut (the client's error came from its COMMIT
    # being unanswerable, after the hostile let the locks go).
    wait_until(conn, "SELECT count(*) FROM runpool.runs WHERE status = 'running'", 1, timeout=10)
    assert conn.execute("SELECT status, worker_id, attempt FROM runpool.runs WHERE id = %s",
                        (run_id,)).fetchone() == ("running", lost, 1)

    async def again() -> list[tuple[uuid.UUID, int]]:
        async with await aconnect(dsn, autocommit=True) as c:
            first = await claim(c, limit=5, worker_id=uuid.uuid4(), lease_seconds=30,
                                handlers=["noop"])
            assert first == []  # leased still
            await c.execute("UPDATE runpool.runs SET lease_expires_at = now()"
                            " - interval '1 second' WHERE id = %s", (run_id,))
            got = await claim(c, limit=5, worker_id=uuid.uuid4(), lease_seconds=30,
                              handlers=["noop"])
            return [(r.id, r.attempt) for r in got]

    assert asyncio.run(again()) == [(run_id, 2)]


def test_one_trip__a_lock_timeout_in_the_locks_rolls_back_and_the_next_trip_claims(
        conn: psycopg.Connection, dsn: str) -> None:
    """A hostile open transaction holds the tenants table: the trip's lock_tenants hits
    lock_timeout, the server skips the claim and COMMIT, one_trip rolls back, and the same
    connection's next trip (the hostile gone) claims every tenant's run."""
    hostile = _held_tenant_and_a_free_one(conn, dsn)

    async def main() -> tuple[object, str, int]:
        async with await aconnect(dsn, autocommit=True) as c:
            await c.execute("SET lock_timeout = '100ms'")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                await claim(c, limit=5, worker_id=uuid.uuid4(), lease_seconds=30,
                            handlers=["noop"])
            status = c.info.transaction_status
            cur = await c.execute("SELECT current_setting('runpool.claim_tenants', true)")
            row = await cur.fetchone()
            hostile.rollback()
            got = await claim(c, limit=5, worker_id=uuid.uuid4(), lease_seconds=30,
                              handlers=["noop"])
            return status, (row[0] or "") if row else "", len(got)

    try:
        assert asyncio.run(main()) == (IDLE, "", 2)
    finally:
        hostile.close()


def test_one_trip__the_claims_tenants_never_outlive_its_transaction(
        conn: psycopg.Connection, dsn: str) -> None:
    """After a claim that chose tenants, the same session (autocommit, as pooled) reads no
    runpool.claim_tenants; a claim_runs sent alone (no lock_tenants before it in its
    transaction) claims nothing rather than the previous claim's tenants."""
    runpool.enqueue_many(conn, [runpool.RunSpec(f"t{i}", "noop") for i in range(3)])
    conn.commit()

    async def main() -> tuple[str, str, int, int]:
        async with await aconnect(dsn, autocommit=True) as c:
            got = await claim(c, limit=1, worker_id=uuid.uuid4(), lease_seconds=30,
                              handlers=["noop"])
            cur = await c.execute("SELECT current_setting('runpool.claim_tenants', true),"
                                  " current_setting('runpool.claim_limited', true)")
            row = await cur.fetchone()
            assert row is not None
            alone = await c.execute(QUERIES["claim_runs"], {
                "limit": 5, "worker_id": uuid.uuid4(), "lease_seconds": 30,
                "handlers": ["noop"]})
            return row[0], row[1], len(got), len(await alone.fetchall())

    assert asyncio.run(main()) == ("", "", 1, 0)


def test_one_trip__through_pgbouncer_a_cancelled_claim_leaves_nothing_to_the_next_client(
        conn: psycopg.Connection, dsn: str, server_dsn: str) -> None:
    """PgBouncer in transaction mode with one server connection: a claim cancelled while it
    waits on a tenant lock is cancelled and rolled back on the server connection, and the next
    client handed that connection sees no transaction and no runpool.claim_tenants, and its
    own claim takes every run."""
    hostile = _held_tenant_and_a_free_one(conn, dsn)

    async def main(through: str) -> tuple[object, tuple[object, ...] | None, int]:
        a = await aconnect(through, autocommit=True, stateless=True)
        b = await aconnect(through, autocommit=True, stateless=True)
        async with a, b:
            task = asyncio.create_task(claim(a, limit=5, worker_id=uuid.uuid4(),
                                             lease_seconds=30, handlers=["noop"]))
            await _wait_lock(dsn, await _pid_waiting(dsn))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            status = a.info.transaction_status
            cur = await b.execute("SELECT current_setting('runpool.claim_tenants', true),"
                                  " now() = statement_timestamp()")
            seen = await cur.fetchone()
            hostile.rollback()
            got = await claim(b, limit=5, worker_id=uuid.uuid4(), lease_seconds=30,
                              handlers=["noop"])
            return status, seen, len(got)

    try:
        with pgbouncer(server_dsn, pool_size=1) as bouncer:
            status, seen, got = asyncio.run(main(bouncer.dsn(dsn)))
    finally:
        hostile.close()
    assert status == IDLE
    assert seen is not None and seen[0] in (None, "") and seen[1]  # not inside a transaction
    assert got == 2


async def _pid_waiting(dsn: str) -> int:
    """The backend (behind the pooler) of the claim that waits on a tenant lock."""
    async with await aconnect(dsn, autocommit=True) as watcher:
        for _ in range(500):
            cur = await watcher.execute(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND datname = current_database()")
            row = await cur.fetchone()
            if row:
                return int(row[0])
            await asyncio.sleep(0.01)
    raise AssertionError("no claim waited on the tenant lock")


# How an operator holds a quota'd tenant's row: set_tenant_quota (which rings the doorbell at
# its commit), or a bare row lock (which rings nothing: the worker's retry must find it).
HOLDS = {"set_tenant_quota": "SELECT runpool.set_tenant_quota('held', 5)",
         "row_lock": "SELECT 1 FROM runpool.tenants WHERE tenant = 'held' FOR UPDATE"}


def test_held_tenant__a_claim_skips_it_takes_the_others_and_says_it_skipped(
        conn: psycopg.Connection, dsn: str) -> None:
    """An operator's open transaction on a quota'd tenant's row: the claim takes the other
    tenants' runs without waiting for the lock (before: every claim picking that tenant
    waited out its lock timeout, here none is set, so it would hang), says it skipped one,
    and once the lock goes the next claim takes the held tenant's run."""
    conn.execute("SELECT runpool.set_tenant_quota('held', 5)")
    held = runpool.enqueue(conn, "held", "noop")
    free = [runpool.enqueue(conn, f"free{i}", "noop") for i in range(3)]
    conn.commit()
    hostile = psycopg.connect(dsn)
    hostile.execute(HOLDS["set_tenant_quota"])
    told: list[bool] = []
    try:
        first = claim_told(dsn, 10, told)
        assert status_of(conn, held) == "queued"
        hostile.commit()
    finally:
        hostile.close()
    assert sorted(first) == sorted(free)
    assert claim_told(dsn, 10, told) == [held]
    assert told == [True, False]


@pytest.mark.parametrize("hold", sorted(HOLDS))
def test_held_tenant__a_pool_runs_other_tenants_meanwhile_and_its_runs_after_the_commit(
        conn: psycopg.Connection, dsn: str, hold: str) -> None:
    """A real pool (its poll a minute away, so only a doorbell or the skip's retry can start
    anything late): other tenants' runs, enqueued while the operator holds the quota'd
    tenant's row, succeed meanwhile; the held tenant's runs stay queued, and start once the
    operator commits."""
    conn.execute("SELECT runpool.set_tenant_quota('held', 5)")
    conn.commit()
    hostile = psycopg.connect(dsn)
    hostile.execute(HOLDS[hold])
    try:
        with running_pool(dsn, poll_seconds=60):
            # An enqueue reads the held tenant's row, never waits for it (0021).
            held = [runpool.enqueue(conn, "held", "noop") for _ in range(2)]
            conn.commit()
            free = []
            for i in range(4):
                free.append(runpool.enqueue(conn, f"free{i}", "noop"))
                conn.commit()
            wait_for(lambda: all(status_of(conn, r) == "succeeded" for r in free),
                     timeout=30, what="the other tenants' runs, the held tenant's row locked")
            assert [status_of(conn, r) for r in held] == ["queued", "queued"]
            hostile.commit()
            wait_for(lambda: all(status_of(conn, r) == "succeeded" for r in held),
                     timeout=30, what="the held tenant's runs, after the operator's commit")
    finally:
        hostile.close()
