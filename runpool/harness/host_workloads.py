"""The many-hosts workloads (issue 19): W1p, W1 through a transaction-mode PgBouncer; W16,
many claimers (16 worker processes x 50 slots) against the W1 shape (2 x 10) on one database."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from typing import Any, Final

import psycopg

from ..claim_times import merged_percentiles
from ..db import connect
from ..enqueue import RunSpec, enqueue_many
from ..testing.databases import database_name, scratch_database
from ..testing.pgbouncer import pgbouncer
from ..testing.pools import PoolProcess, running_pool
from .measure import COUNT_DONE, DRAIN_RATE, XACTS, ActivitySampler, cpu_seconds, wait_until

__all__ = ["w1p_pooler", "w16_many_claimers", "wcommits"]

BENCH_APP: Final = "runpool.harness.benchapp:app"
BACKENDS: Final = "SELECT pid FROM pg_stat_activity WHERE datname = %s"


def _enqueue(conn: psycopg.Connection[Any], runs: int, tenants: int = 1) -> None:
    specs = [RunSpec(f"tenant{i % tenants}", "noop") for i in range(runs)]
    for chunk in range(0, runs, 2000):
        enqueue_many(conn, specs[chunk:chunk + 2000])
    conn.commit()
    conn.autocommit = True


def w1p_pooler(server: str, *, runs: int = 20_000) -> dict[str, Any]:
    """W1p: W1's drain (2 workers x 10) with RUNPOOL_DSN through PgBouncer in transaction mode
    (as many server connections as the pool would hold directly: 2 x (6 + 1)) and LISTEN
    direct: the price of stateless work connections (no prepared statements, no session
    plan_cache_mode)."""
    with scratch_database(server) as dsn, pgbouncer(server, pool_size=14) as bouncer, \
            connect(dsn) as conn:
        _enqueue(conn, runs)
        with running_pool(bouncer.dsn(dsn), BENCH_APP, stop="drain", output="discard",
                          workers=2, concurrency=10, listen_dsn=dsn):
            wait_until(conn, COUNT_DONE, runs, timeout=900)
        row = conn.execute(DRAIN_RATE).fetchone()
        assert row is not None
        return {"workload": "W1p", "runs": runs, "runs_per_s": round(float(row[0]), 1)}


def _claim_times(pool: PoolProcess) -> dict[str, Any]:
    """Drain the pool and merge its workers' claim histograms (their `worker_stopped` lines):
    claim transactions per run, the share that claimed nothing, p50/p99/max in ms."""
    pool.send_signal(signal.SIGTERM)
    try:
        pool.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pass  # running_pool kills it on the way out; the lines logged so far still count
    claims = []
    for line in pool.log().splitlines():
        if line.startswith("{") and '"worker_stopped"' in line:
            claims.append(json.loads(line)["claims"])
    n = sum(c["n"] for c in claims)
    p50, p99, top = merged_percentiles(claims)
    return {"claims": n, "claims_empty": sum(c["empty"] for c in claims),
            "runs_per_claim": round(sum(c["runs"] for c in claims) / max(n, 1), 2),
            "claim_p50_ms": p50, "claim_p99_ms": p99, "claim_max_ms": top}


def _many(server: str, runs: int, workers: int, concurrency: int,
          host_connections: int | None, tenants: int) -> dict[str, Any]:
    with scratch_database(server) as dsn, connect(dsn) as conn, \
            psycopg.connect(server, autocommit=True) as admin:
        name = database_name(dsn)
        _enqueue(conn, runs, tenants)
        with running_pool(dsn, BENCH_APP, stop="drain", output="capture", workers=workers,
                          concurrency=concurrency, host_connections=host_connections,
                          log_format="json") as pool:
            wait_until(conn, "SELECT count(*) FROM runpool.workers WHERE stopped_at IS NULL",
                       workers, timeout=120)
            backends = [p for (p,) in admin.execute(BACKENDS, (name,))]
            processes = [pool.pid, *pool.workers()]
            listener = pool.listener()
            if listener is not None:
                processes.append(listener)
            cpu_pool, cpu_server = cpu_seconds(processes), cpu_seconds(backends)
            xacts = admin.execute(XACTS, (name,)).fetchone()
            with ActivitySampler(server, name) as sampler:
                wait_until(conn, COUNT_DONE, runs, timeout=900)
            cpu_pool = cpu_seconds(processes) - cpu_pool
            cpu_server = cpu_seconds(backends) - cpu_server
            admin.execute("SELECT pg_stat_clear_snapshot()")
            after = admin.execute(XACTS, (name,)).fetchone()
            claims = _claim_times(pool)
        row = conn.execute(DRAIN_RATE).fetchone()
        assert row is not None and xacts is not None and after is not None
        samples = max(sampler.samples, 1)
        return {
            "runs_per_s": round(float(row[0]), 1),
            "xacts_per_run": round((after[0] - xacts[0]) / runs, 3),
            "lock_waiters_mean": round(sum(sampler.waiting) / samples, 2),
            "lock_waiters_max": max(sampler.waiting, default=0),
            "active_mean": round(sum(sampler.active) / samples, 2),
            "lock_waits_by_kind": sampler.mean(sampler.kinds, floor=0.0),
            "activity_samples": sampler.samples,
            **({"activity_sampler_error": sampler.error} if sampler.error else {}),
            "pool_cpu_ms_per_run": round(cpu_pool * 1000 / runs, 3),
            "server_cpu_ms_per_run": round(cpu_server * 1000 / runs, 3),
            **claims,
        }


def w16_many_claimers(server: str, *, runs: int = 20_000, tenants: int = 1) -> dict[str, Any]:
    """W16: `runs` no-op runs drained by 16 worker processes x 50 slots (the host capped at
    96 work connections: 5 pooled + 1 heartbeat each), against the W1 shape (2 x 10) on the
    same server in the same sitting: throughput, transactions per run (empty claims of a
    herd show here), lock waiters, and CPU per run of the pool and of its server backends.
    Needs max_connections >= 120. `tenants`: the runs spread over that many tenants (W16t:
    16), whose claims lock different tenant rows."""
    base = _many(server, runs, 2, 10, None, tenants)
    many = _many(server, runs, 16, 50, 96, tenants)
    return {"workload": "W16" if tenants == 1 else "W16t", "runs": runs, "tenants": tenants,
            **{f"w1_{k}": v for k, v in base.items()},
            **{f"w16_{k}": v for k, v in many.items()},
            "ratio": round(many["runs_per_s"] / max(base["runs_per_s"], 1e-6), 3)}


# One small write per transaction, with and without a doorbell in it (runpool's terminal
# statuses ring one per run, inside the outcome batch's commit).
COMMIT_TABLE: Final = "CREATE TABLE bench_commits (session int, n int)"
PLAIN_COMMIT: Final = "INSERT INTO bench_commits VALUES (%s, %s)"
NOTIFY_COMMIT: Final = ("WITH w AS (INSERT INTO bench_commits VALUES (%s, %s))"
                        " SELECT pg_notify('bench_doorbell', '')")


def _commits(dsn: str, statement: str, sessions: int, seconds: float) -> float:
    counts = [0] * sessions
    time_limit = threading.Event()

    def session(i: int) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not time_limit.is_set():
                conn.execute(statement, (i, counts[i]))
                counts[i] += 1

    threads = [threading.Thread(target=session, args=(i,), daemon=True) for i in range(sessions)]
    for t in threads:
        t.start()
    time_limit.wait(seconds)
    time_limit.set()
    for t in threads:
        t.join(30)
    return sum(counts) / seconds


def wcommits(server: str, *, sessions: int = 8, seconds: float = 5.0) -> dict[str, Any]:
    """Wcommits: how many commits/s the server takes from `sessions` sessions writing one row
    per transaction, plain and with a NOTIFY in each (NOTIFY serialises commits on a
    database-wide lock): the ceiling of doorbells a single primary can ring."""
    with scratch_database(server, migrated=False) as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(COMMIT_TABLE)
        plain = _commits(dsn, PLAIN_COMMIT, sessions, seconds)
        notify = _commits(dsn, NOTIFY_COMMIT, sessions, seconds)
    return {"workload": "Wcommits", "sessions": sessions, "plain_per_s": round(plain, 1),
            "notify_per_s": round(notify, 1), "ratio": round(notify / max(plain, 1e-6), 3)}
