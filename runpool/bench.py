"""`python -m runpool bench`: the benchmarks, one JSON line per workload.

Each workload runs in a scratch database created on the configured server (or the embedded
one) and dropped afterwards. Nothing here asserts a time: the numbers are reported, and the
README records them with the machine they came from.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .app import App, Run
from .db import connect
from .embedded import resolve_dsn
from .enqueue import RunSpec, enqueue, enqueue_many
from .migrate import migrate
from .pool_process import pool_process
from .settings import Settings

__all__ = ["app", "run_bench"]

app = App()


@app.handler("noop")
async def noop(run: Run) -> Any:
    return None


@app.handler("stamp")
async def stamp(run: Run) -> Any:
    """Returns when the handler started, for wake-up latency."""
    return time.time()


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


@contextmanager
def scratch_database(server_dsn: str) -> Iterator[str]:
    name = f"runpool_bench_{uuid.uuid4().hex[:10]}"
    create = psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name))
    drop = psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
        psycopg.sql.Identifier(name))
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(create)
    params = conninfo_to_dict(server_dsn)
    params["dbname"] = name
    dsn = make_conninfo(**params)  # type: ignore[arg-type]
    try:
        with connect(dsn, autocommit=True) as conn:
            migrate(conn)
        yield dsn
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(drop)


def _wait(conn: psycopg.Connection[Any], query: Any, target: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        row = conn.execute(query).fetchone()
        if row and row[0] >= target:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"benchmark did not reach {target} within {timeout}s")
        time.sleep(0.05)


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def w1_throughput(server: str, *, runs: int = 20_000, quotas: bool = False) -> dict[str, Any]:
    """W1: `runs` no-op runs enqueued in bulk, drained by 2 workers x 10."""
    with scratch_database(server) as dsn, connect(dsn) as conn:
        tenants = 4 if quotas else 1
        if quotas:
            for t in range(tenants):
                conn.execute("SELECT runpool.set_tenant_quota(%s, 5)", (f"tenant{t}",))
            conn.commit()
        started = time.perf_counter()
        for chunk in range(0, runs, 2000):
            enqueue_many(conn, [
                RunSpec(f"tenant{i % tenants}", "noop", priority=(i % 7) - 3 if quotas else 0)
                for i in range(chunk, min(chunk + 2000, runs))])
        conn.commit()
        enqueue_rate = runs / (time.perf_counter() - started)
        conn.autocommit = True
        with pool_process(dsn, "runpool.bench:app", workers=2, concurrency=10):
            _wait(conn, COUNT_DONE, runs, timeout=600)
        row = conn.execute(DRAIN_RATE).fetchone()
        assert row is not None
        return {"workload": "W1q" if quotas else "W1", "runs": runs,
                "runs_per_s": round(float(row[0]), 1), "enqueue_per_s": round(enqueue_rate, 1)}


def w2_latency(server: str, *, runs: int = 300, gap: float = 0.02) -> dict[str, Any]:
    """W2: idle pool; runs enqueued one at a time; enqueue commit -> handler start."""
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
        with pool_process(dsn, "runpool.bench:app", workers=2, concurrency=10):
            _wait(conn, LIVE_WORKERS, 2, timeout=60)
            warm = enqueue(conn, "bench", "stamp")
            _wait(conn, COUNT_DONE, 1, timeout=60)
            # Per run: when the enqueue call began, and when its commit was acknowledged.
            sent: dict[uuid.UUID, tuple[float, float]] = {}
            for _ in range(runs):
                t0 = time.time()
                run_id = enqueue(conn, "bench", "stamp")  # autocommit: returns after COMMIT
                sent[run_id] = (t0, time.time())
                time.sleep(gap)
            _wait(conn, COUNT_DONE, runs + 1, timeout=120)
        started = dict(conn.execute(
            "SELECT id, result FROM runpool.runs WHERE id <> %s", (warm,)).fetchall())
    latencies = [(float(started[i]) - acked) * 1000 for i, (_, acked) in sent.items()]
    # The stricter view: from the moment the enqueue call began (includes its own statement).
    from_call = [(float(started[i]) - t0) * 1000 for i, (t0, _) in sent.items()]
    return {"workload": "W2", "runs": runs, "p50_ms": round(_pct(latencies, 50), 2),
            "p99_ms": round(_pct(latencies, 99), 2), "max_ms": round(max(latencies), 2),
            "p50_from_call_ms": round(_pct(from_call, 50), 2),
            "p99_from_call_ms": round(_pct(from_call, 99), 2)}


def w3_idle(server: str, *, seconds: float = 60.0) -> dict[str, Any]:
    """W3: an idle pool of 2 workers with default settings; database transactions per second."""
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn, \
            connect(server, autocommit=True) as stats:
        name = conninfo_to_dict(dsn)["dbname"]
        with pool_process(dsn, "runpool.bench:app", workers=2):
            _wait(conn, LIVE_WORKERS, 2, timeout=60)
            conn.close()
            time.sleep(12)  # past startup, and past the stats collector's idle flush delay
            stats.execute(CLEAR_SNAPSHOT)
            before = stats.execute(XACTS, (name,)).fetchone()
            t0 = time.monotonic()
            time.sleep(seconds)
            stats.execute(CLEAR_SNAPSHOT)
            after = stats.execute(XACTS, (name,)).fetchone()
            elapsed = time.monotonic() - t0
    assert before is not None and after is not None
    return {"workload": "W3", "seconds": seconds,
            "xact_per_s": round((after[0] - before[0]) / elapsed, 3)}


WORKLOADS: Final[dict[str, Callable[[str], dict[str, Any]]]] = {
    "W1": w1_throughput,
    "W1q": lambda server: w1_throughput(server, quotas=True),
    "W2": w2_latency,
    "W3": w3_idle,
}


def _median(results: list[dict[str, Any]]) -> dict[str, Any]:
    merged = dict(results[0])
    for key, value in merged.items():
        if isinstance(value, float):
            merged[key] = round(statistics.median(r[key] for r in results), 3)
    if len(results) > 1:
        merged["repeats"] = len(results)
    return merged


def run_bench(settings: Settings, workloads: list[str] | None, *, repeat: int = 1) -> int:
    server = resolve_dsn(settings)
    names = workloads or list(WORKLOADS)
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}")
    for name in names:
        results = [WORKLOADS[name](server) for _ in range(max(repeat, 1))]
        print(json.dumps(_median(results)), flush=True)
    return 0
