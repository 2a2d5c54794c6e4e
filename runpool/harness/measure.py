"""What the workloads measure with: counters read from PostgreSQL, bounded waits, percentiles."""

from __future__ import annotations

import os
import statistics
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Final

import psycopg

from ..testing.pools import PoolProcess, running_pool, wait_for

__all__ = ["BENCH_APP", "CLEAR_SNAPSHOT", "COUNT_DONE", "DRAIN_RATE", "LIVE_WORKERS", "XACTS",
           "bench_pool", "cpu_seconds", "median_of", "percentile", "wait_until"]

BENCH_APP: Final = "runpool.harness.benchapp:app"

# Server-wide transaction counter of one database (read from another database, so the
# reading itself is not counted).
XACTS: Final = "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s"
CLEAR_SNAPSHOT: Final = "SELECT pg_stat_clear_snapshot()"
# Drain rate measured by the database's own clock, from first claim to last finish.
DRAIN_RATE: Final = """
SELECT count(*) / greatest(extract(epoch FROM max(finished_at) - min(started_at)), 1e-6)
FROM runpool.runs WHERE status = 'succeeded'
"""
COUNT_DONE: Final = "SELECT count(*) FROM runpool.runs WHERE status = 'succeeded'"
LIVE_WORKERS: Final = "SELECT count(*) FROM runpool.workers WHERE stopped_at IS NULL"


def bench_pool(dsn: str, **settings: Any) -> AbstractContextManager[PoolProcess]:
    """A pool serving the bench handlers, drained at the end."""
    return running_pool(dsn, BENCH_APP, stop="drain", output="discard", **settings)


def wait_until(conn: psycopg.Connection[Any], query: Any, target: int, timeout: float) -> None:
    """Until `query`'s first column reaches `target` (AssertionError after `timeout` s)."""

    def reached() -> bool:
        row = conn.execute(query).fetchone()
        return bool(row and row[0] >= target)

    wait_for(reached, timeout, what=f"the benchmark to reach {target}")


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def median_of(results: list[dict[str, Any]]) -> dict[str, Any]:
    merged = dict(results[0])
    for key, value in merged.items():
        if isinstance(value, float):
            merged[key] = round(statistics.median(r[key] for r in results), 3)
    if len(results) > 1:
        merged["repeats"] = len(results)
    return merged


_TICKS: Final = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of live processes (Linux /proc), in seconds; gone ones count 0."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICKS
