"""Claim cost: W6 (one claim's latency at 1k / 100k / 1M queued runs) and W6cost (beside
runs scheduled for later or of paused tenants). `claim_latencies` and the backlog loads are
W14's too (wait_bench)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Final

from ..db import connect
from ..testing.databases import scratch_database
from .measure import percentile

__all__ = ["LOAD_BACKLOG", "LOAD_TENANTS", "claim_latencies", "w6_claim_cost",
           "w6_claim_depth"]


# Bench setup only (W1 measures enqueue): load a backlog straight into the table, one tenant
# holding 90% of it with ranks ahead of everyone else's.
LOAD_BACKLOG: Final = """
INSERT INTO runpool.runs (tenant, handler, rank, max_attempts)
SELECT CASE WHEN g <= %(big)s THEN 'flood' ELSE 'small' || (g %% 9) END, 'noop',
       extract(epoch FROM now()) - 1e6 + g * 1e-3, 3
FROM generate_series(1, %(depth)s) g
"""
# Nine unlimited small tenants, and the flood at a quota of 10 (the first claim fills it;
# later ones pass it over).
LOAD_TENANTS: Final = """
INSERT INTO runpool.tenants (tenant, max_running)
SELECT 'small' || g, NULL FROM generate_series(0, 8) g
UNION ALL SELECT 'flood', 10
"""


async def claim_latencies(dsn: str, claims: int) -> list[float]:
    from ..claiming import claim
    from ..db import aconnect
    from ..queries import QUERIES

    worker = uuid.uuid4()
    times = []
    async with await aconnect(dsn, autocommit=True) as conn:
        await claim(conn, worker_id=worker, limit=10, lease_seconds=3600)  # flood at quota
        for _ in range(claims):
            t0 = time.perf_counter()
            got = await claim(conn, worker_id=worker, limit=10, lease_seconds=3600)
            times.append((time.perf_counter() - t0) * 1000)
            # Put them back in line (rank kept): the depth stays what it was, and no tenant's
            # queue runs dry, which would make later claims cheaper than the first.
            await conn.execute(QUERIES["release_runs"], {
                "ids": [r.id for r in got], "attempts": [r.attempt for r in got],
                "worker_id": worker})
    return times


# W6's claim-cost cases (issue 11): beside 1,000 runs that can start now, 20,000 runs
# scheduled for tomorrow, or 2,000 paused tenants with one run each. Loaded through the SQL
# API, which is what keeps such runs out of the claim's path.
LOAD_SCHEDULED: Final = """
SELECT count(runpool.enqueue('later', 'noop', run_at => now() + interval '1 day'))
FROM generate_series(1, 20000)
"""
PAUSE_TENANTS: Final = """
SELECT count(runpool.set_tenant_quota('paused' || g, 0)) FROM generate_series(1, 2000) g
"""
LOAD_PAUSED: Final = """
SELECT count(runpool.enqueue('paused' || g, 'noop')) FROM generate_series(1, 2000) g
"""
W6_COST_CASES: Final = {"empty": (), "scheduled_20k": (LOAD_SCHEDULED,),
                        "paused_2k": (PAUSE_TENANTS, LOAD_PAUSED)}


def w6_claim_cost(server: str, *, claims: int = 300) -> dict[str, Any]:
    """W6 (claim cost): claim latency with 1,000 ready runs alone, beside 20,000 runs
    scheduled for tomorrow, and beside 2,000 paused tenants with one run each."""
    out: dict[str, Any] = {"workload": "W6cost"}
    for label, loads in W6_COST_CASES.items():
        with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
            conn.execute(LOAD_TENANTS)
            conn.execute(LOAD_BACKLOG, {"depth": 1000, "big": 0})
            for load in loads:
                conn.execute(load)
            conn.execute("VACUUM ANALYZE runpool.runs")
            times = asyncio.run(claim_latencies(dsn, claims))
        out[f"p50_ms_{label}"] = round(percentile(times, 50), 3)
        out[f"p99_ms_{label}"] = round(percentile(times, 99), 3)
    for label in ("scheduled_20k", "paused_2k"):
        out[f"p50_ratio_{label}_to_empty"] = round(out[f"p50_ms_{label}"]
                                                   / out["p50_ms_empty"], 2)
    return out


def w6_claim_depth(server: str, *, claims: int = 300) -> dict[str, Any]:
    """W6: claim latency at 1k / 100k / 1M queued runs, 90% of them one tenant's at quota;
    then the claim-cost cases of w6_claim_cost."""
    out: dict[str, Any] = {"workload": "W6"}
    for label, depth in (("1k", 1_000), ("100k", 100_000), ("1m", 1_000_000)):
        with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
            conn.execute(LOAD_TENANTS)
            conn.execute(LOAD_BACKLOG, {"depth": depth, "big": depth * 9 // 10})
            conn.execute("VACUUM ANALYZE runpool.runs")
            times = asyncio.run(claim_latencies(dsn, claims))
        out[f"p50_ms_{label}"] = round(percentile(times, 50), 3)
        out[f"p99_ms_{label}"] = round(percentile(times, 99), 3)
    out["p50_ratio_1m_to_1k"] = round(out["p50_ms_1m"] / out["p50_ms_1k"], 2)
    cost = w6_claim_cost(server, claims=claims)
    del cost["workload"]
    return out | cost
