"""Attacks on the claim herd (3f24221): a tenant's quota stays exact whatever the claimers
saw of it when they chose which tenants to lock."""

from __future__ import annotations

import uuid

import psycopg

import runpool
from runpool.queries import QUERIES

# Live leases of one tenant.
LIVE = "SELECT count(*) FROM runpool.runs WHERE tenant = %s AND status = 'running'"


def _lock(conn: psycopg.Connection, limit: int) -> list[tuple[str, bool]]:
    """lock_tenants in the caller's open transaction: the tenants it chose, and whether it
    locked each."""
    params = {"handlers": ["noop"], "limit": limit}
    return [(t, limited) for (t, limited) in conn.execute(QUERIES["lock_tenants"], params)]


def _claim(conn: psycopg.Connection, chosen: list[tuple[str, bool]],
           limit: int) -> list[uuid.UUID]:
    """claim_runs in the caller's open transaction (not committed)."""
    rows = conn.execute(QUERIES["claim_runs"], {
        "handlers": ["noop"], "limit": limit, "tenants": [t for (t, _) in chosen],
        "limited": [t for (t, limited) in chosen if limited],
        "worker_id": uuid.uuid4(), "lease_seconds": 30})
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
        _claim(first, chose_first, 5)
        _claim(second, chose_second, 5)
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
