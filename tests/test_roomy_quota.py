"""Roomy quota'd tenants (queries.sql, "Roomy tenants"; migration 0025): a tenant whose free
quota is at least twice the fleet's slots is claimed without its row lock, one nearer its
quota is locked as before, and a worker that registers waits, at its fleet fence, for the
claims that judged without its slots."""

from __future__ import annotations

import asyncio
import logging
import uuid

import psycopg
import pytest

import runpool
from runpool import worker
from runpool.claiming import claim
from runpool.db import aconnect
from runpool.queries import QUERIES

from .helpers import running_pool, scalar, status_of, wait_for

# What a claim of a roomy tenant holds while it runs, and what a session can hold the same way.
FENCE_SHARED = "SELECT pg_try_advisory_xact_lock_shared(1920298608, 25)"
HOLD_ROW = "SELECT 1 FROM runpool.tenants WHERE tenant = %s FOR UPDATE"
# A backend waiting for the fleet fence: a starting worker's.
FENCE_WAITER = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND wait_event = 'advisory'")


def _register(conn: psycopg.Connection, concurrency: int) -> uuid.UUID:
    worker_id = uuid.uuid4()
    conn.execute(QUERIES["register_worker"], {
        "worker_id": worker_id, "host": "test", "pid": 0, "concurrency": concurrency,
        "handlers": ["noop"]})
    return worker_id


def _claim(dsn: str, worker_id: uuid.UUID, *, roomy: bool, told: list[bool]) -> list[str]:
    """One claim of up to 10 noop runs (bounded: 30 s); the tenants of the runs it took."""

    async def one() -> list[str]:
        async with await aconnect(dsn, autocommit=True) as c:
            got = await asyncio.wait_for(claim(
                c, limit=10, worker_id=worker_id, lease_seconds=30, handlers=["noop"],
                on_skipped=told.append, roomy=roomy), 30)
            return sorted(r.tenant for r in got)

    return asyncio.run(one())


def test_roomy_tenant__claimed_while_a_session_holds_its_row_a_tight_one_is_skipped(
        conn: psycopg.Connection, dsn: str) -> None:
    """The margin is twice the registered slots: 2 x 5 = 10. 'wide' (quota 10, exactly the
    margin) is roomy, 'tight' (9) is not. With both rows held by a session, a roomy claim
    takes wide's runs and skips tight; a claim without `roomy` (its slots not counted)
    skips both, as before. Once wide's live runs eat into the margin it is locked again."""
    worker_id = _register(conn, 5)
    for tenant, quota in (("wide", 10), ("tight", 9)):
        conn.execute("SELECT runpool.set_tenant_quota(%s, %s)", (tenant, quota))
        runpool.enqueue_many(conn, [runpool.RunSpec(tenant, "noop")] * 3)
    assert scalar(conn, "SELECT margin FROM runpool.quota_margin") == 10
    hostile = psycopg.connect(dsn)
    told: list[bool] = []
    try:
        for tenant in ("wide", "tight"):
            hostile.execute(HOLD_ROW, (tenant,))
        assert _claim(dsn, worker_id, roomy=False, told=told) == []
        assert _claim(dsn, worker_id, roomy=True, told=told) == ["wide"] * 3
        # wide: 3 live, so 7 free, under the margin: locked, so skipped while held.
        runpool.enqueue(conn, "wide", "noop")
        assert _claim(dsn, worker_id, roomy=True, told=told) == []
        hostile.commit()
        assert _claim(dsn, worker_id, roomy=True, told=told) == ["tight"] * 3 + ["wide"]
    finally:
        hostile.close()
    assert told == [True, True, True, False]
    live = "SELECT count(*) FROM runpool.runs WHERE tenant = %s AND status = 'running'"
    assert (scalar(conn, live, "wide"), scalar(conn, live, "tight")) == (4, 3)


def test_fence__a_starting_worker_waits_for_roomy_claims_in_flight_then_claims_roomy(
        conn: psycopg.Connection, dsn: str) -> None:
    """A session holds the fence as a roomy claim in flight does. A real worker starting
    meanwhile waits at its fence before any claim; while it waits, a roomy claim cannot take
    the fence's share mode and locks the tenant instead (here: skips it, its row held). Once
    the fence is free the worker claims the roomy tenant's run, its row still held."""
    conn.execute("SELECT runpool.set_tenant_quota('acme', 1000)")
    other = _register(conn, 5)
    run_id = runpool.enqueue(conn, "acme", "noop")
    holder, hostile = psycopg.connect(dsn), psycopg.connect(dsn)
    told: list[bool] = []
    try:
        assert holder.execute(FENCE_SHARED).fetchone() == (True,)
        hostile.execute(HOLD_ROW, ("acme",))
        with running_pool(dsn, poll_seconds=0.2):
            wait_for(lambda: scalar(conn, FENCE_WAITER) == 1, timeout=30,
                     what="the starting worker waiting at its fence")
            assert _claim(dsn, other, roomy=True, told=told) == []
            assert told == [True]
            assert status_of(conn, run_id) == "queued"
            holder.commit()
            wait_for(lambda: status_of(conn, run_id) == "succeeded", timeout=30,
                     what="the roomy tenant's run, its row still held")
        # The row lock was held throughout: the session's transaction is still open.
        assert hostile.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    finally:
        holder.close()
        hostile.close()


def test_fence__held_past_its_timeout_the_worker_starts_anyway_and_says_so(
        conn: psycopg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A session that never lets the fence go (a hung claim, a hostile login) delays a
    starting worker by FENCE_SECONDS, not forever: it warns and serves."""
    monkeypatch.setattr(worker, "FENCE_SECONDS", 0.5)
    run_id = runpool.enqueue(conn, "acme", "noop")
    holder = psycopg.connect(dsn)
    app = runpool.App()

    @app.handler("noop")
    async def noop(run: runpool.Run) -> None:
        return None

    async def main() -> None:
        async with runpool.Pool(app, dsn=dsn, concurrency=2, poll_seconds=0.2):
            await asyncio.to_thread(wait_for, lambda: status_of(conn, run_id) == "succeeded",
                                    timeout=30, what="the run, the fence never released")

    try:
        assert holder.execute(FENCE_SHARED).fetchone() == (True,)
        with caplog.at_level(logging.WARNING, logger="runpool.worker"):
            asyncio.run(main())
    finally:
        holder.close()
    assert [r.action for r in caplog.records  # type: ignore[attr-defined]
            if getattr(r, "action", None) == "fence_timeout"] == ["fence_timeout"]
