"""The schedule workloads: W18 (fire lateness of a few schedules, three pools racing for every
plan) and W18x1000 (a storm: 1,000 schedules of 50 tenants due in the same second, one pool)."""

from __future__ import annotations

import contextlib
import time
from datetime import datetime
from typing import Any, Final

from ..db import connect
from ..testing.databases import scratch_database
from .measure import LIVE_WORKERS, bench_pool, percentile, wait_until

__all__ = ["w18_schedule_lateness", "w18_schedule_storm"]

# Pin every bench schedule's next plan a few whole seconds ahead, spread over 4 seconds.
PIN_SCHEDULES: Final = """
UPDATE runpool.schedules SET
    next_fire_at = date_trunc('second', now()) + (2 + mod(substr(name, 5)::int, 4)) * interval '1 s'
WHERE left(name, 4) = 'w18-'
"""
SCHEDULED_RUNS: Final = "SELECT count(*) FROM runpool.runs WHERE idempotency_key LIKE 'schedule:%'"
# Fire lateness: the run's creation (the firing transaction's start) minus its plan time.
LATENESS: Final = """
SELECT extract(epoch FROM created_at - (input ->> 'scheduled_at')::timestamptz)::float8
FROM runpool.runs WHERE idempotency_key LIKE 'schedule:%'
"""


def w18_schedule_lateness(server: str, *, schedules: int = 20, rounds: int = 5
                          ) -> dict[str, Any]:
    """W18: fire lateness (run created - plan time) of 20 schedules whose plans are pinned
    2-5 s ahead, 5 rounds, three pools of 1 worker racing for every plan (plus any real
    minute boundary that passes meanwhile)."""
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
        for i in range(schedules):
            conn.execute("SELECT runpool.set_schedule(%s, '* * * * *', 'bench', 'noop',"
                         " catch_up => 'skip')", (f"w18-{i}",))
        with contextlib.ExitStack() as pools:
            for _ in range(3):
                pools.enter_context(bench_pool(dsn, workers=1))
            wait_until(conn, LIVE_WORKERS, 3, timeout=60)
            for r in range(rounds):
                conn.execute(PIN_SCHEDULES)
                wait_until(conn, SCHEDULED_RUNS, schedules * (r + 1), timeout=60)
                time.sleep(0.5)
        late = [float(v) for (v,) in conn.execute(LATENESS)]
        duplicates = conn.execute(
            "SELECT count(*) - count(DISTINCT idempotency_key) FROM runpool.runs").fetchone()
    assert duplicates is not None
    return {"workload": "W18", "plans": len(late), "p50_ms": round(percentile(late, 50) * 1000, 2),
            "p99_ms": round(percentile(late, 99) * 1000, 2), "max_ms": round(max(late) * 1000, 2),
            "duplicates": int(duplicates[0])}


# Pin every storm schedule's next plan to one whole second, 3 s ahead; answers that second.
PIN_STORM: Final = """
WITH t AS (SELECT date_trunc('second', now()) + interval '3 s' AS at)
UPDATE runpool.schedules SET next_fire_at = t.at FROM t WHERE left(name, 6) = 'storm-'
RETURNING t.at
"""
# How many storm schedules have fired plan %s, by the database's clock.
STORM_FIRED: Final = """
SELECT count(*), clock_timestamp() FROM runpool.schedules
WHERE left(name, 6) = 'storm-' AND last_fire_at >= %s
"""
# Each run's lateness (created_at: its firing transaction's start) for the plan %s.
STORM_LATENESS: Final = """
SELECT extract(epoch FROM created_at - %s)::float8 FROM runpool.runs
WHERE idempotency_key LIKE 'schedule:storm-%%' AND input ->> 'scheduled_at' = %s
"""


def w18_schedule_storm(server: str, *, schedules: int = 1000, tenants: int = 50,
                       rounds: int = 3) -> dict[str, Any]:
    """W18x1000: `schedules` schedules `* * * * *` of `tenants` tenants, all pinned to one plan
    3 s ahead, fired by one pool of one worker, `rounds` times: each run's lateness (its firing
    transaction's start minus the plan time) and the round's end (the last schedule's firing
    seen committed, polled every 10 ms, minus the plan time)."""
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
        # Inserted, not set_schedule'd (its zone check reads pg_timezone_names, ~0.2 s a call);
        # next_fire_at NULL: the pool plans them.
        conn.execute("INSERT INTO runpool.schedules (name, cron, tenant, handler, catch_up)"
                     " SELECT 'storm-' || i, '* * * * *', 'tenant-' || i %% %s, 'noop', 'skip'"
                     " FROM generate_series(1, %s) i", (tenants, schedules))
        late: list[float] = []
        ends: list[float] = []
        with bench_pool(dsn, workers=1):
            wait_until(conn, LIVE_WORKERS, 1, timeout=60)
            # Every schedule planned by the pool (its first plan is the next real minute).
            wait_until(conn, "SELECT count(*) FROM runpool.schedules WHERE next_fire_at IS NOT"
                       " NULL", schedules, timeout=120)
            for _ in range(rounds):
                row = conn.execute(PIN_STORM).fetchone()
                assert row is not None
                plan: datetime = row[0]
                deadline = time.monotonic() + 120
                while True:
                    fired = conn.execute(STORM_FIRED, (plan,)).fetchone()
                    assert fired is not None
                    if fired[0] >= schedules:
                        ends.append((fired[1] - plan).total_seconds())
                        break
                    assert time.monotonic() < deadline, f"{fired[0]} of {schedules} fired"
                    time.sleep(0.01)
                text = f"{plan:%Y-%m-%dT%H:%M:%SZ}"
                late += [float(v) for (v,) in conn.execute(STORM_LATENESS, (plan, text))]
        duplicates = conn.execute(
            "SELECT count(*) - count(DISTINCT idempotency_key) FROM runpool.runs").fetchone()
    assert duplicates is not None
    return {"workload": "W18x1000", "plans": len(late),
            "p50_ms": round(percentile(late, 50) * 1000, 2),
            "p99_ms": round(percentile(late, 99) * 1000, 2),
            "max_ms": round(max(late) * 1000, 2),
            "last_committed_ms": [round(e * 1000) for e in ends],
            "duplicates": int(duplicates[0])}
