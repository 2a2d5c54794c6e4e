"""W14: durable waits — signal commit to the handler continuing past wait_for on an idle pool,
and what 10,000 runs waiting at once cost the claim and the worker."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any, Final

from ..db import connect
from ..enqueue import RunSpec, enqueue_many
from ..testing.databases import scratch_database
from ..testing.pools import running_pool
from ..waits import signal_run
from .claim_workloads import LOAD_BACKLOG, LOAD_TENANTS, claim_latencies
from .measure import COUNT_DONE, LIVE_WORKERS, percentile, wait_until

__all__ = ["w14_waits"]

BENCH_APP: Final = "runpool.harness.benchapp:app"
WAITING: Final = "SELECT count(*) FROM runpool.runs WHERE status = 'waiting'"
# 10,000 runs waiting for a signal (one day's timeout each), as the wait commit leaves them.
LOAD_WAITING: Final = """
WITH made AS (
    INSERT INTO runpool.runs (tenant, handler, rank, max_attempts, status, attempt,
                              attempt_offset)
    SELECT 'waiter' || (g %% 10), 'noop', extract(epoch FROM now()) + g * 1e-3, 3,
           'waiting', 1, 1
    FROM generate_series(1, %(count)s) g
    RETURNING id
)
INSERT INTO runpool.waits (run_id, seq, kind, name, attempt, until)
SELECT id, 1, 'signal', 'go', 1, now() + interval '1 day' FROM made
"""


def _rss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total


def _latencies(server: str, runs: int, gap: float) -> tuple[list[float], dict[str, Any]]:
    """Signal commit acknowledged -> the handler past wait_for, one run at a time on an idle
    pool; then the workers' memory before and after 10,000 more runs wait."""
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn, \
            running_pool(dsn, BENCH_APP, stop="drain", output="discard", workers=2,
                         concurrency=10) as pool:
        wait_until(conn, LIVE_WORKERS, 2, timeout=60)
        ids = enqueue_many(conn, [RunSpec("bench", "await_signal") for _ in range(runs)])
        wait_until(conn, WAITING, runs, timeout=120)
        acked: dict[uuid.UUID, float] = {}
        for run_id in ids:
            answer = signal_run(conn, run_id, "go")  # autocommit: returns after COMMIT
            acked[run_id] = time.time()
            assert answer == "delivered", answer
            time.sleep(gap)
        wait_until(conn, COUNT_DONE, runs, timeout=120)
        seen = dict(conn.execute("SELECT id, result FROM runpool.runs").fetchall())
        before = _rss_kib(pool.workers())
        many = 10_000
        for _ in range(0, many, 2000):
            enqueue_many(conn, [RunSpec("bench", "await_signal") for _ in range(2000)])
        wait_until(conn, WAITING, many, timeout=600)
        after = _rss_kib(pool.workers())
    memory = {"worker_rss_mib_idle": round(before / 1024, 1),
              "worker_rss_mib_10k_waiting": round(after / 1024, 1),
              "worker_rss_bytes_per_waiting_run": round((after - before) * 1024 / many, 1)}
    return [(float(seen[i]) - t) * 1000 for i, t in acked.items()], memory


def _claim_cost(server: str, claims: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for label, waiting in (("none", 0), ("10k", 10_000)):
        with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
            conn.execute(LOAD_TENANTS)
            conn.execute(LOAD_BACKLOG, {"depth": 1000, "big": 0})
            if waiting:
                conn.execute(LOAD_WAITING, {"count": waiting})
            conn.execute("VACUUM ANALYZE runpool.runs")
            conn.execute("VACUUM ANALYZE runpool.waits")
            times = asyncio.run(claim_latencies(dsn, claims))
        out[f"claim_p50_ms_{label}_waiting"] = round(percentile(times, 50), 3)
        out[f"claim_p99_ms_{label}_waiting"] = round(percentile(times, 99), 3)
    out["claim_p50_ratio_10k_to_none"] = round(out["claim_p50_ms_10k_waiting"]
                                               / out["claim_p50_ms_none_waiting"], 2)
    return out


def w14_waits(server: str, *, runs: int = 200, gap: float = 0.02,
              claims: int = 300) -> dict[str, Any]:
    """W14: p50/p99 of signal commit -> handler continues; claim p50 with 10,000 runs
    waiting against none; worker memory with 10,000 runs waiting."""
    latencies, memory = _latencies(server, runs, gap)
    return {"workload": "W14", "signals": len(latencies),
            "p50_ms": round(percentile(latencies, 50), 2),
            "p99_ms": round(percentile(latencies, 99), 2),
            "max_ms": round(max(latencies), 2), **memory, **_claim_cost(server, claims)}

