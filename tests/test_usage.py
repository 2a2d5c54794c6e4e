"""What each tenant spent, by the hour (migration 0014): every change of a run's usage lands in
its tenant's hour in the same transaction, so status and the console read a day per tenant
from a bounded range of buckets instead of every run of the day."""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

import httpx
import psycopg
import pytest
from psycopg.types.json import Jsonb

import runpool
from runpool.status import collect
from runpool.web import create_app
from tests.helpers import scalar
from tests.test_web_console import _cells
from tests.webserver import serving

SINCE = "SELECT * FROM runpool.tenant_usage_since(now() - interval '1 hour') ORDER BY tenant"


def _spend(conn: psycopg.Connection, run_id: uuid.UUID, **usage: Any) -> None:
    conn.execute("UPDATE runpool.runs SET usage = %s WHERE id = %s", (Jsonb(usage), run_id))


def test_usage_changes__add_up_per_tenant_and_count_each_run_once(
        conn: psycopg.Connection) -> None:
    a1, a2 = (runpool.enqueue(conn, "acme", "noop") for _ in range(2))
    g1 = runpool.enqueue(conn, "globex", "noop")
    _spend(conn, a1, input_tokens=100, output_tokens=10, cost=0.25, tool_calls=1, turns=1)
    # A run's totals grow: only the difference is added.
    _spend(conn, a1, input_tokens=150, output_tokens=30, cost=0.5, tool_calls=3, turns=2)
    _spend(conn, a2, input_tokens=1, output_tokens=2, cost=0.001, tool_calls=0, turns=1)
    _spend(conn, g1, input_tokens=7, output_tokens=0, cost=0, tool_calls=0, turns=0)
    # A write rolled back counts nothing.
    with pytest.raises(RuntimeError), conn.transaction():
        _spend(conn, g1, input_tokens=10**9, output_tokens=0, cost=99, tool_calls=0, turns=0)
        raise RuntimeError("rolled back")
    rows = conn.execute(SINCE).fetchall()
    assert rows == [("acme", 2, 151, 32, Decimal("0.501"), 3, 3),
                    ("globex", 1, 7, 0, Decimal("0"), 0, 0)]
    # status reads the same buckets (its window is a few minutes: the current hour).
    by_tenant = {u["tenant"]: u for u in collect(conn)["usage"]}
    assert (by_tenant["acme"]["runs"], by_tenant["acme"]["input_tokens"],
            by_tenant["acme"]["cost"]) == (2, 151, 0.501)


def test_usage_buckets__hours_of_utc_whatever_the_sessions_time_zone(
        conn: psycopg.Connection) -> None:
    conn.execute("SET TimeZone = 'Asia/Kolkata'")  # +05:30: its hours are not UTC's
    run_id = runpool.enqueue(conn, "acme", "noop")
    _spend(conn, run_id, input_tokens=1, output_tokens=1, cost=1, tool_calls=0, turns=0)
    hour = scalar(conn, "SELECT hour FROM runpool.tenant_usage")
    conn.execute("SET TimeZone = 'UTC'")
    assert scalar(conn, "SELECT extract(minute FROM %s::timestamptz)", hour) == 0


def test_usage_reads__a_tenants_day_is_a_bounded_range_of_buckets(
        conn: psycopg.Connection) -> None:
    # A long history of spending: 40 days x 24 hours x 8 shards for one tenant.
    conn.execute("""
        INSERT INTO runpool.tenant_usage (tenant, hour, shard, runs, cost)
        SELECT 'acme', date_bin('1 hour', now(), timestamptz '2000-01-01 00:00:00+00')
                       - h * interval '1 hour', s, 1, 1
        FROM generate_series(0, 40 * 24 - 1) h, generate_series(0, 7) s""")
    conn.execute("ANALYZE runpool.tenant_usage")
    plan = "\n".join(r[0] for r in conn.execute(
        "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) SELECT * FROM runpool.tenant_usage u"
        " WHERE u.tenant = 'acme' AND u.hour >= now() - interval '24 hours'"))
    assert "Index" in plan and "Seq Scan" not in plan, plan
    assert scalar(conn, "SELECT runs FROM runpool.tenant_usage_since(now() - interval '24 hours')"
                        " WHERE tenant = 'acme'") == 25 * 8


def test_the_api_role_may_read_usage_but_not_write_it(conn: psycopg.Connection) -> None:
    conn.execute("SET ROLE runpool_api")
    try:
        assert conn.execute("SELECT count(*) FROM runpool.tenant_usage_since(now())"
                            ).fetchone() == (0,)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("INSERT INTO runpool.tenant_usage (tenant, hour, shard)"
                         " VALUES ('acme', now(), 0)")
    finally:
        conn.execute("RESET ROLE")


def test_console_tenants_page__shows_what_each_tenant_spent_in_the_last_day(
        dsn: str, conn: psycopg.Connection) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    runpool.enqueue(conn, "globex", "noop")
    _spend(conn, run_id, input_tokens=1200, output_tokens=300, cost=0.004, tool_calls=0, turns=1)
    with serving(create_app(dsn)) as url:
        page = httpx.get(url + "/", timeout=20).text
    acme, globex = _cells(page, "acme"), _cells(page, "globex")
    assert (acme["tokens"], acme["cost"]) == ("1,500", "0.0040"), acme
    assert (globex["tokens"], globex["cost"]) == ("–", "–"), globex
