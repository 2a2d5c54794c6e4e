"""Drain throughput: W1 (no-op runs enqueued in bulk, then drained; its variants W1q, W1w1,
W1w4) and W10 (the same through serial keys, with the order they started in checked)."""

from __future__ import annotations

import time
from typing import Any, Final

import psycopg

from ..db import connect
from ..enqueue import RunSpec, enqueue_many
from ..testing.databases import scratch_database
from .measure import COUNT_DONE, DRAIN_RATE, bench_pool, cpu_seconds, wait_until

__all__ = ["ORDER_VIOLATIONS", "w1_throughput", "w10_serial_keys"]


def _drain(conn: psycopg.Connection[Any], dsn: str, specs: list[RunSpec], *, workers: int = 2
           ) -> tuple[float, float, float]:
    """Enqueue `specs` in bulk (chunks of 2,000, one transaction), then drain them with
    `workers` workers x 10; returns (enqueue runs/s, drain runs/s by the database's clock,
    the workers' CPU seconds from their start to the drain's end)."""
    started = time.perf_counter()
    for chunk in range(0, len(specs), 2000):
        enqueue_many(conn, specs[chunk:chunk + 2000])
    conn.commit()
    enqueue_rate = len(specs) / (time.perf_counter() - started)
    conn.autocommit = True
    with bench_pool(dsn, workers=workers, concurrency=10) as pool:
        wait_until(conn, COUNT_DONE, len(specs), timeout=900)
        cpu = cpu_seconds(pool.workers())
    row = conn.execute(DRAIN_RATE).fetchone()
    assert row is not None
    return enqueue_rate, float(row[0]), cpu


def w1_throughput(server: str, *, runs: int = 20_000, quotas: bool = False, workers: int = 2
                  ) -> dict[str, Any]:
    """W1: `runs` no-op runs enqueued in bulk, drained by `workers` (2) workers x 10."""
    with scratch_database(server) as dsn, connect(dsn) as conn:
        tenants = 4 if quotas else 1
        if quotas:
            for t in range(tenants):
                conn.execute("SELECT runpool.set_tenant_quota(%s, 5)", (f"tenant{t}",))
            conn.commit()
        enqueue_rate, drain_rate, cpu = _drain(conn, dsn, [
            RunSpec(f"tenant{i % tenants}", "noop", priority=(i % 7) - 3 if quotas else 0)
            for i in range(runs)], workers=workers)
        name = "W1q" if quotas else "W1" if workers == 2 else f"W1w{workers}"
        return {"workload": name, "runs": runs, "workers": workers,
                "runs_per_s": round(drain_rate, 1), "enqueue_per_s": round(enqueue_rate, 1),
                # Startup included (the same for every size): a ceiling, compared across sizes.
                "worker_cpu_us_per_run": round(cpu / runs * 1e6, 1)}


# Runs of a key that started before an earlier-enqueued run of the same key.
ORDER_VIOLATIONS: Final = """
SELECT count(*) FROM (
    SELECT serial_order < lag(serial_order) OVER (PARTITION BY tenant, serial_key
                                                  ORDER BY started_at, id) AS backwards
    FROM runpool.runs WHERE serial_key IS NOT NULL
) s WHERE backwards
"""


def w10_serial_keys(server: str, *, keys: int = 1000, per_key: int = 20) -> dict[str, Any]:
    """W10: `keys` serial keys x `per_key` no-op runs, drained by 2 workers x 10."""
    runs = keys * per_key
    with scratch_database(server) as dsn, connect(dsn) as conn:
        enqueue_rate, drain_rate, _ = _drain(conn, dsn, [
            RunSpec("tenant0", "noop", serial_key=f"conversation-{k}")
            for _ in range(per_key) for k in range(keys)])
        violations = conn.execute(ORDER_VIOLATIONS).fetchone()
        assert violations is not None
        return {"workload": "W10", "runs": runs, "keys": keys,
                "runs_per_s": round(drain_rate, 1), "enqueue_per_s": round(enqueue_rate, 1),
                "order_violations": int(violations[0])}
