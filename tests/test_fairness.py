"""Strict per-tenant quotas, fair order across tenants, priority aging, depth-independence."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg

import runpool
from runpool.claiming import claim
from runpool.db import aconnect
from runpool.queries import QUERIES
from tests.helpers import race_claimers, scalar

# Tenants holding more live leases than their quota (must always be empty).
OVER_QUOTA = """
SELECT r.tenant, count(*), t.max_running FROM runpool.runs r
JOIN runpool.tenants t ON t.tenant = r.tenant
WHERE r.status = 'running' AND r.lease_expires_at > now()
GROUP BY r.tenant, t.max_running HAVING count(*) > t.max_running
"""


def test_quotas__16_claimers_20_tenants_never_exceeded_and_work_conserving(
        conn: psycopg.Connection, dsn: str) -> None:
    quotas = {f"t{i:02d}": 1 + i % 5 for i in range(20)}
    for tenant, quota in quotas.items():
        conn.execute("SELECT runpool.set_tenant_quota(%s, %s)", (tenant, quota))
    runpool.enqueue_many(conn, [runpool.RunSpec(t, "noop") for t in quotas for _ in range(12)])
    violations, samples = race_claimers(dsn, claimers=16, max_limit=6, probe=OVER_QUOTA)
    assert violations == []
    assert samples > 20  # the sampler really watched the race
    # Work-conserving: every run was claimed and finished, none left waiting.
    assert conn.execute("SELECT status, count(*) FROM runpool.runs GROUP BY status").fetchall() \
        == [("succeeded", 240)]


def test_quotas__a_claim_fills_every_free_quota_slot(conn: psycopg.Connection, dsn: str) -> None:
    quotas = {"a": 2, "b": 0, "c": 3}
    for tenant, quota in quotas.items():
        conn.execute("SELECT runpool.set_tenant_quota(%s, %s)", (tenant, quota))
    runpool.enqueue_many(conn, [runpool.RunSpec(t, "noop") for t in [*quotas, "d"]
                                for _ in range(5)])

    async def main() -> list[runpool.claiming.ClaimedRun]:
        async with await aconnect(dsn, autocommit=True) as c:
            return await claim(c, worker_id=uuid.uuid4(), limit=100, lease_seconds=30)

    got = asyncio.run(main())
    counts = {t: sum(r.tenant == t for r in got) for t in [*quotas, "d"]}
    # b is paused; d has no quota row of its own and the default is unlimited.
    assert counts == {"a": 2, "b": 0, "c": 3, "d": 5}
    assert asyncio.run(main()) == []
    # Raising a quota takes effect on the next claim; expired leases stop counting.
    conn.execute("SELECT runpool.set_tenant_quota('b', 1)")
    conn.execute("UPDATE runpool.runs SET lease_expires_at = now() - interval '1 second'"
                 " WHERE tenant = 'a' AND status = 'running'")
    again = asyncio.run(main())
    assert sorted(r.tenant for r in again) == ["a", "a", "b"]
    # The reclaimed runs kept their place in line, so they are the ones claimed again.
    assert {r.attempt for r in again if r.tenant == "a"} == {2}


def test_default_quota__applies_to_tenants_without_their_own(conn: psycopg.Connection,
                                                          dsn: str) -> None:
    conn.execute("UPDATE runpool.config SET default_quota = 2")
    runpool.enqueue_many(conn, [runpool.RunSpec(t, "noop") for t in "xy" for _ in range(4)])

    async def main() -> list[str]:
        async with await aconnect(dsn, autocommit=True) as c:
            got = await claim(c, worker_id=uuid.uuid4(), limit=100, lease_seconds=30)
            return sorted(r.tenant for r in got)

    assert asyncio.run(main()) == ["x", "x", "y", "y"]


def test_flooding_tenant_at_quota__does_not_delay_another_tenants_run(
        conn: psycopg.Connection, dsn: str) -> None:
    conn.execute("SELECT runpool.set_tenant_quota('flood', 10)")
    conn.execute(
        "INSERT INTO runpool.runs (tenant, handler, rank, max_attempts)"
        " SELECT 'flood', 'noop', extract(epoch FROM now()) - 1000 + g * 1e-6, 3"
        " FROM generate_series(1, 50000) g")
    conn.execute("INSERT INTO runpool.tenants (tenant) VALUES ('flood') ON CONFLICT DO NOTHING")
    conn.execute("ANALYZE runpool.runs")

    async def claim_all() -> list[runpool.claiming.ClaimedRun]:
        async with await aconnect(dsn, autocommit=True) as c:
            return await claim(c, worker_id=uuid.uuid4(), limit=20, lease_seconds=30)

    assert len(asyncio.run(claim_all())) == 10  # flood is now at quota
    small = runpool.enqueue(conn, "small", "noop")
    assert [r.id for r in asyncio.run(claim_all())] == [small]


def _explain(conn: psycopg.Connection, query: Any, params: dict[str, Any]) -> dict[str, Any]:
    stmt = psycopg.sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + psycopg.sql.SQL(query)
    return scalar(conn, stmt, params)[0]  # type: ignore[no-any-return]


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    out = [plan]
    for child in plan.get("Plans", []):
        out += _nodes(child)
    return out


def _claim_plans(conn: psycopg.Connection, depth: int) -> list[dict[str, Any]]:
    """EXPLAIN ANALYZE of lock_tenants and claim_runs with `depth` runs queued for one tenant
    at quota and nine other tenants with one run each; every claim is rolled back."""
    conn.execute("TRUNCATE runpool.runs, runpool.tenants CASCADE")
    conn.execute("SELECT runpool.set_tenant_quota('flood', 5)")
    conn.execute(
        "INSERT INTO runpool.runs (tenant, handler, rank, max_attempts, status,"
        " lease_expires_at) SELECT 'flood', 'noop', g, 3, CASE WHEN g <= 5 THEN 'running'"
        " ELSE 'queued' END, CASE WHEN g <= 5 THEN now() + interval '1 hour' END"
        " FROM generate_series(1, %s) g", (depth,))
    tenants = [f"small{t}" for t in range(9)]
    for tenant in tenants:
        runpool.enqueue(conn, tenant, "noop")
    conn.execute("ANALYZE runpool.runs")
    conn.execute("SET jit = off")
    plans = []
    claim_params = {"limit": 10, "worker_id": uuid.uuid4(), "lease_seconds": 30,
                    "handlers": ["noop"]}
    lock_params = {"handlers": ["noop"], "limit": 10, "roomy": False}
    # The claim is given the tenant at quota too, locked (lock_tenants passes it over), as
    # lock_tenants leaves its choice: so its recount of a deep backlog's quota is measured.
    every = "{" + ",".join(["flood", *tenants]) + "}"
    for query, params in ((QUERIES["lock_tenants"], lock_params),
                          (QUERIES["claim_runs"], claim_params)):
        with conn.transaction():  # EXPLAIN ANALYZE really claims: undo it
            conn.execute("SELECT set_config('runpool.claim_tenants', %s, true),"
                         " set_config('runpool.claim_limited', '{flood}', true)", (every,))
            plans.append(_explain(conn, query, params))
            raise psycopg.Rollback()
    return plans


def _blocks(plan: dict[str, Any]) -> int:
    return int(plan["Plan"]["Shared Hit Blocks"] + plan["Plan"]["Shared Read Blocks"])


def test_claim_plan__cost_does_not_grow_with_the_backlog_of_a_tenant_at_quota(
        conn: psycopg.Connection) -> None:
    shallow = _claim_plans(conn, 1_000)
    deep = _claim_plans(conn, 200_000)
    for plan in deep:
        scans = [n for n in _nodes(plan["Plan"])
                 if n["Node Type"] == "Seq Scan" and n.get("Relation Name") == "runs"]
        assert scans == [], "the claim scans the queue"
    for small, big in zip(shallow, deep, strict=True):
        # 200x the backlog: pages touched grow only with B-tree depth (one more level), never
        # with the number of queued rows.
        assert _blocks(big) < 1.6 * _blocks(small), (_blocks(small), _blocks(big))
