"""Sharing between tenants: W5 (a small tenant's wait beside one that enqueues 10x more, under
the default quota) and W15 (workers sharing one rate-limit key)."""

from __future__ import annotations

from typing import Any

import psycopg

from ..db import connect
from ..enqueue import RunSpec, enqueue_many
from ..testing.databases import scratch_database
from .measure import COUNT_DONE, LIVE_WORKERS, bench_pool, percentile, wait_until

__all__ = ["w5_fairness", "w15_rate_limit"]


def _w5_waits(server: str, burst: list[RunSpec], watch: set[str]) -> dict[str, float]:
    """p95 wait (enqueue -> start) per watched tenant, for one burst on a fresh pool."""
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
        with bench_pool(dsn, workers=2, concurrency=10, tenant_quota=5):
            wait_until(conn, LIVE_WORKERS, 2, timeout=60)
            enqueue_many(conn, burst)
            wait_until(conn, COUNT_DONE, len(burst), timeout=600)
        waits: dict[str, list[float]] = {}
        for tenant, wait in conn.execute(
                "SELECT tenant, extract(epoch FROM started_at - created_at) FROM runpool.runs"):
            waits.setdefault(tenant, []).append(float(wait))
    return {t: percentile(waits[t], 95) for t in watch}


def w5_fairness(server: str, *, small: int = 40, seconds: float = 0.05) -> dict[str, Any]:
    """W5: 4 tenants, one enqueues 10x the others in one burst (first in line); each small
    tenant's p95 wait versus its p95 wait running alone. Default quota 5, 2 workers x 10."""
    smalls = ["small1", "small2", "small3"]
    alone = _w5_waits(server, [RunSpec("small1", "sleep", {"seconds": seconds})
                               for _ in range(small)], {"small1"})["small1"]
    burst = [RunSpec("big", "sleep", {"seconds": seconds}) for _ in range(small * 10)]
    burst += [RunSpec(t, "sleep", {"seconds": seconds}) for _ in range(small) for t in smalls]
    shared = _w5_waits(server, burst, set(smalls))
    worst = max(shared.values())
    return {"workload": "W5", "alone_p95_s": round(alone, 3),
            "shared_p95_s": {t: round(v, 3) for t, v in sorted(shared.items())},
            "worst_ratio": round(worst / alone, 2)}


def w15_rate_limit(server: str, *, seconds: float = 30.0, per_minute: float = 600.0,
                   burst: float = 10.0, window: float = 10.0) -> dict[str, Any]:
    """W15: 4 workers acquiring one shared key of `per_minute` (burst `burst`) for `seconds`:
    the achieved rate against the limit, the most units admitted in any `window` seconds
    against per_minute * window / 60 + burst, and an acquire's overhead when admitted at once
    (a key that never makes anyone wait)."""
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT runpool.set_rate_limit('w15', %s, %s)", (per_minute, burst))
        conn.execute("SELECT runpool.set_rate_limit('w15-free', 1e12)")
        specs = [RunSpec(f"tenant{i}", "rate_loop", {"key": "w15", "free_key": "w15-free",
                                                     "probes": 250, "seconds": seconds})
                 for i in range(4)]
        enqueue_many(conn, specs)
        with bench_pool(dsn, workers=4, concurrency=1):
            wait_until(conn, COUNT_DONE, len(specs), timeout=seconds + 120)
        results = [r for (r,) in conn.execute("SELECT result FROM runpool.runs")]
        workers = scalar_count(conn, "SELECT count(DISTINCT worker_id) FROM runpool.runs")
    admitted = sorted(t for r in results for t in r["admitted"])
    planned = sorted(t for r in results for t in r["planned"])
    overheads = [ms for r in results for ms in r["overheads_ms"]]
    span = admitted[-1] - admitted[0]
    # The steady rate: what was admitted after the first burst, over the time it took.
    rate = (len(admitted) - 1 - burst) / span * 60 if span > 0 else 0.0

    def most(times: list[float]) -> int:
        return max(sum(1 for b in times if a <= b < a + window) for a in times)

    late = [a - p for r in results for a, p in zip(r["admitted"], r["planned"], strict=True)]
    return {"workload": "W15", "workers": workers, "admitted": len(admitted),
            "rate_per_min": round(rate, 1), "of_limit": round(rate / per_minute, 3),
            # As reserved (the limiter's guarantee), and as the handlers woke (plus timers'
            # lateness, which a loaded machine adds).
            "max_in_window": most(planned), "max_in_window_woken": most(admitted),
            "wake_late_p99_ms": round(percentile(late, 99) * 1000, 2), "window_s": window,
            "window_bound": per_minute * window / 60 + burst,
            "acquire_p50_ms": round(percentile(overheads, 50), 3),
            "acquire_p99_ms": round(percentile(overheads, 99), 3)}


def scalar_count(conn: psycopg.Connection[Any], query: Any) -> int:
    row = conn.execute(query).fetchone()
    return int(row[0]) if row else 0
