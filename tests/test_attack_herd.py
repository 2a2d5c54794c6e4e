"""Attacks on the claim herd (3f24221): a tenant's quota stays exact whatever the claimers
saw of it when they chose which tenants to lock."""

from __future__ import annotations

import asyncio
import threading
import uuid
from datetime import UTC, datetime

import psycopg
import pytest

import runpool
from runpool import firing
from runpool.db import aconnect
from runpool.queries import QUERIES
from runpool.schedules import plan_key
from tests.helpers import wait_for

# Live leases of one tenant.
LIVE = "SELECT count(*) FROM runpool.runs WHERE tenant = %s AND status = 'running'"


def _lock(conn: psycopg.Connection, limit: int) -> list[tuple[str, bool]]:
    """lock_tenants in the caller's open transaction: the tenants it chose, and whether it
    locked each (none skipped: no other transaction holds a tenant's row here)."""
    params = {"handlers": ["noop"], "limit": limit, "roomy": False}
    rows = conn.execute(QUERIES["lock_tenants"], params).fetchall()
    assert not any(skipped for (_, _, skipped) in rows)
    return [(t, limited) for (t, limited, _) in rows]


def _claim(conn: psycopg.Connection, limit: int) -> list[uuid.UUID]:
    """claim_runs in the caller's open transaction (not committed), of the tenants its
    lock_tenants chose."""
    rows = conn.execute(QUERIES["claim_runs"], {
        "handlers": ["noop"], "limit": limit, "worker_id": uuid.uuid4(), "lease_seconds": 30})
    return [r[0] for r in rows]


def _two_claimers_across_a_quota_change(
        conn: psycopg.Connection, dsn: str, change: str) -> int:
    """Two claimers choose their tenants while 'acme' has no quota (so neither locks it),
    `change` gives it a quota of 1, then both claim and commit: the tenant's live leases."""
    runpool.enqueue_many(conn, [runpool.RunSpec("acme", "noop") for _ in range(10)])
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        chose_first = _lock(first, 5)
        chose_second = _lock(second, 5)
        assert chose_first == chose_second == [("acme", False)]
        conn.execute(change)
        _claim(first, 5)
        _claim(second, 5)
        first.commit()
        second.commit()
    live = conn.execute(LIVE, ("acme",)).fetchone()
    assert live is not None
    return int(live[0])


def test_quota_set_between_a_claimers_tenant_choice_and_its_claim__is_never_exceeded(
        conn: psycopg.Connection, dsn: str) -> None:
    assert _two_claimers_across_a_quota_change(
        conn, dsn, "SELECT runpool.set_tenant_quota('acme', 1)") <= 1


def test_default_quota_set_between_a_claimers_tenant_choice_and_its_claim__is_never_exceeded(
        conn: psycopg.Connection, dsn: str) -> None:
    assert _two_claimers_across_a_quota_change(
        conn, dsn, "UPDATE runpool.config SET default_quota = 1") <= 1


@pytest.mark.parametrize("hold", ["serial key", "idempotency key"])
def test_fire__a_tenant_holding_a_lock_its_schedule_needs_holds_back_no_other_tenants_run(
        conn: psycopg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch, hold: str) -> None:
    """A hostile tenant's enqueue left open, on its schedule's serial key or on the very
    idempotency key of its next plan: the other tenant's plan must be committed (visible)
    without waiting out that lock, whatever LOCK_TIMEOUT is (the contract: a due plan fires
    within 2 s; a run counts once committed). Both held every plan of the firing 2.2 s."""
    monkeypatch.setattr(firing, "LOCK_TIMEOUT", "60s")
    conn.execute("SELECT runpool.set_schedule('evil', '* * * * *', 'evil', 'tick',"
                 " serial_key => 'k')")
    conn.execute("SELECT runpool.set_schedule('victim', '* * * * *', 'acme', 'tick')")
    plan = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
    conn.execute("UPDATE runpool.schedules SET next_fire_at = %s", (plan,))
    ticks: list[firing.Tick] = []

    async def fire() -> None:
        async with await aconnect(dsn, autocommit=True) as c:
            ticks.append(await firing.fire_due(c, catch_up_max=100, now=plan))

    with psycopg.connect(dsn) as hostile:
        if hold == "serial key":
            hostile.execute("SELECT runpool.enqueue('evil', 'tick', serial_key => 'k')")
        else:
            hostile.execute("SELECT runpool.enqueue('evil', 'tick', idempotency_key => %s)",
                            (plan_key("evil", plan),))
        firer = threading.Thread(target=asyncio.run, args=(fire(),), daemon=True)
        firer.start()
        wait_for(lambda: conn.execute(
            "SELECT count(*) FROM runpool.runs WHERE idempotency_key = %s",
            (plan_key("victim", plan),)).fetchone() == (1,),
            what="the victim's plan committed while the evil tenant holds its lock")
        firer.join(20)
        assert not firer.is_alive() and ticks[0].fired == {"victim": [plan]}
    assert fire_now(dsn, plan).fired == {"evil": [plan]}


def fire_now(dsn: str, plan: datetime) -> firing.Tick:
    async def main() -> firing.Tick:
        async with await aconnect(dsn, autocommit=True) as c:
            return await firing.fire_due(c, catch_up_max=100, now=plan)
    return asyncio.run(main())
