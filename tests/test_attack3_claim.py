"""Attacks on the claim's wake-ups (lock_tenants skipping a held quota'd tenant, the skip's
retry, the promotion cadence, a freed slot covered by its refill) and on the outcome batch's
array literals (outcomes.finish_params)."""

from __future__ import annotations

import psycopg

import runpool
from runpool.queries import QUERIES

from .helpers import claim_told, running_pool, status_of, wait_for


def test_held_tenant__a_claim_of_one_takes_another_tenants_run_not_nothing(
        conn: psycopg.Connection, dsn: str) -> None:
    """The claim-level form of the test below: the held tenant ranks best, a claim of one run
    comes back empty (and says it skipped), though another tenant's run is ready."""
    conn.execute("SELECT runpool.set_tenant_quota('held', 5)")
    runpool.enqueue(conn, "held", "noop")
    free = runpool.enqueue(conn, "free", "noop")
    conn.commit()
    hostile = psycopg.connect(dsn)
    hostile.execute("SELECT 1 FROM runpool.tenants WHERE tenant = 'held' FOR UPDATE")
    told: list[bool] = []
    try:
        got = claim_told(dsn, 1, told)
    finally:
        hostile.close()
    assert (got, told) == ([free], [True])


def test_held_tenant__the_next_ranked_takes_its_place_and_tenants_ranked_below_stay_unlocked(
        conn: psycopg.Connection, dsn: str) -> None:
    """Quota'd tenants are locked as the claim reaches them in rank order: the held best-ranked
    one is skipped (and said so), the next takes its place, and the one ranked below the
    claim's %(limit)s places is not locked (another claimer may take it meanwhile)."""
    for tenant in ("held", "next", "below"):
        conn.execute("SELECT runpool.set_tenant_quota(%s, 5)", (tenant,))
        runpool.enqueue(conn, tenant, "noop")
    conn.commit()
    with psycopg.connect(dsn) as hostile, psycopg.connect(dsn) as claimer, \
            psycopg.connect(dsn) as other:
        hostile.execute("SELECT 1 FROM runpool.tenants WHERE tenant = 'held' FOR UPDATE")
        chose = claimer.execute(QUERIES["lock_tenants"], {"handlers": ["noop"], "limit": 1,
                                                              "roomy": False})
        assert chose.fetchall() == [("next", True, False), ("held", True, True)]
        other.execute("SET lock_timeout = '2s'")
        assert other.execute("SELECT tenant FROM runpool.tenants WHERE tenant = 'below'"
                             " FOR NO KEY UPDATE NOWAIT").fetchall() == [("below",)]


def test_held_tenant__a_one_slot_pool_runs_other_tenants_while_the_best_ranked_is_held(
        conn: psycopg.Connection, dsn: str) -> None:
    """lock_tenants says a quota'd tenant whose row another transaction holds is skipped and
    'its other tenants are not held up'. But the skipped tenant still takes one of the
    claim's %(limit)s places in `best`: when it ranks best (its runs are the oldest, and
    they only grow older while it is held) a claim of one run (a one-slot worker, or any
    worker's last free slot, or a refill for one freed slot) takes nothing at all, retried
    forever. Here every other tenant's run waits for the operator's commit. (Quota 1: under
    the margin of a one-slot pool, 2, so its claims lock the tenant; a roomy tenant's row is
    never locked, see test_roomy_quota.)"""
    conn.execute("SELECT runpool.set_tenant_quota('held', 1)")
    held = runpool.enqueue(conn, "held", "noop")
    conn.commit()
    hostile = psycopg.connect(dsn)
    hostile.execute("SELECT 1 FROM runpool.tenants WHERE tenant = 'held' FOR UPDATE")
    try:
        with running_pool(dsn, concurrency=1, poll_seconds=1):
            free = [runpool.enqueue(conn, f"free{i}", "noop") for i in range(3)]
            conn.commit()
            wait_for(lambda: all(status_of(conn, r) == "succeeded" for r in free),
                     timeout=30, what="the other tenants' runs, one quota'd tenant's row held")
            assert status_of(conn, held) == "queued"
            hostile.commit()
            wait_for(lambda: status_of(conn, held) == "succeeded", timeout=30,
                     what="the held tenant's run, after the operator's commit")
    finally:
        hostile.close()
