"""The benchmark workloads (W1-W18, Wcommits; W14 is wait_bench's, W1p, W16 and Wcommits
host_workloads', W17 ops_workloads', W11 agent_workloads', W18 schedule_workloads');
`python -m runpool bench` runs them."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any, Final

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..db import connect
from ..enqueue import RunSpec, enqueue, enqueue_many
from ..testing.databases import scratch_database
from .agent_workloads import w11_agent_load
from .host_workloads import w1p_pooler, w16_many_claimers, wcommits
from .live_workloads import w12_follow_latency, w13_progress_cost
from .measure import (
    CLEAR_SNAPSHOT,
    COUNT_DONE,
    DRAIN_RATE,
    LIVE_WORKERS,
    XACTS,
    bench_pool,
    cpu_seconds,
    percentile,
    wait_until,
)
from .ops_workloads import w17_purge
from .schedule_workloads import w18_schedule_lateness, w18_schedule_storm
from .turn_cost import w11_turn_cost

__all__ = ["WORKLOADS"]

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


def w2_latency(server: str, *, runs: int = 300, gap: float = 0.02) -> dict[str, Any]:
    """W2: idle pool; runs enqueued one at a time; enqueue commit -> handler start."""
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
        with bench_pool(dsn, workers=2, concurrency=10):
            wait_until(conn, LIVE_WORKERS, 2, timeout=60)
            warm = enqueue(conn, "bench", "stamp")
            wait_until(conn, COUNT_DONE, 1, timeout=60)
            # Per run: when the enqueue call began, and when its commit was acknowledged.
            sent: dict[uuid.UUID, tuple[float, float]] = {}
            for _ in range(runs):
                t0 = time.time()
                run_id = enqueue(conn, "bench", "stamp")  # autocommit: returns after COMMIT
                sent[run_id] = (t0, time.time())
                time.sleep(gap)
            wait_until(conn, COUNT_DONE, runs + 1, timeout=120)
        started = dict(conn.execute(
            "SELECT id, result FROM runpool.runs WHERE id <> %s", (warm,)).fetchall())
    latencies = [(float(started[i]) - acked) * 1000 for i, (_, acked) in sent.items()]
    # The stricter view: from the moment the enqueue call began (includes its own statement).
    from_call = [(float(started[i]) - t0) * 1000 for i, (t0, _) in sent.items()]
    return {"workload": "W2", "runs": runs, "p50_ms": round(percentile(latencies, 50), 2),
            "p99_ms": round(percentile(latencies, 99), 2), "max_ms": round(max(latencies), 2),
            "p50_from_call_ms": round(percentile(from_call, 50), 2),
            "p99_from_call_ms": round(percentile(from_call, 99), 2)}


def w3_idle(server: str, *, seconds: float = 60.0) -> dict[str, Any]:
    """W3: an idle pool of 2 workers with default settings; database transactions per second."""
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn, \
            connect(server, autocommit=True) as stats:
        name = conninfo_to_dict(dsn)["dbname"]
        with bench_pool(dsn, workers=2):
            wait_until(conn, LIVE_WORKERS, 2, timeout=60)
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


# Bench setup only (W1 measures enqueue): load a backlog straight into the table, one tenant
# holding 90% of it with ranks ahead of everyone else's.
LOAD_BACKLOG: Final = """
INSERT INTO runpool.runs (tenant, handler, rank, max_attempts)
SELECT CASE WHEN g <= %(big)s THEN 'flood' ELSE 'small' || (g %% 9) END, 'noop',
       extract(epoch FROM now()) - 1e6 + g * 1e-3, 3
FROM generate_series(1, %(depth)s) g
"""
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


def w7_checkpoint_cost(server: str, *, calls: int = 1000) -> dict[str, Any]:
    """W7: one run making `calls` no-op tool calls; checkpoint overhead per call."""
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
        run_id = enqueue(conn, "bench", "tool_loop", {"calls": calls})
        with bench_pool(dsn, workers=1, concurrency=1):
            wait_until(conn, COUNT_DONE, 1, timeout=600)
        row = conn.execute("SELECT result FROM runpool.runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    overheads = row[0]["overheads_ms"]
    return {"workload": "W7", "calls": calls, "p50_ms": round(percentile(overheads, 50), 3),
            "p99_ms": round(percentile(overheads, 99), 3)}


# Bytes one run's checkpoints take: its messages and tool calls, row by row.
RUN_BYTES: Final = """
SELECT (SELECT coalesce(sum(pg_column_size(m.*)), 0) FROM runpool.messages m
        WHERE m.run_id = %(id)s)
     + (SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM runpool.tool_calls t
        WHERE t.run_id = %(id)s)
"""


def w8_resume_cost(server: str, *, calls: int = 1000) -> dict[str, Any]:
    """W8: a run with `calls` committed calls is reclaimed; time from its claim to the first
    new tool call, and checkpoint bytes per call at 10 and `calls` calls."""
    out: dict[str, Any] = {"workload": "W8", "calls": calls}
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
        small = enqueue(conn, "bench", "tool_loop", {"calls": 10})
        big = enqueue(conn, "bench", "tool_loop", {"calls": calls, "crash": True})
        with bench_pool(dsn, workers=1, concurrency=2,
                          lease_seconds=2):
            wait_until(conn, COUNT_DONE, 2, timeout=600)
        row = conn.execute(
            "SELECT result, extract(epoch FROM started_at) FROM runpool.runs WHERE id = %s",
            (big,)).fetchone()
        assert row is not None
        result, claimed = row
        out["resume_ms"] = round((result["first_new_call"] - float(claimed)) * 1000, 2)
        out["handler_start_to_first_new_call_ms"] = round(
            (result["first_new_call"] - result["handler_started"]) * 1000, 2)
        for label, run_id, n in (("10", small, 10), (str(calls), big, calls + 1)):
            size = conn.execute(RUN_BYTES, {"id": run_id}).fetchone()
            assert size is not None
            out[f"bytes_per_call_at_{label}"] = round(int(size[0]) / n, 1)
    return out


RUNNING: Final = "SELECT count(*) FROM runpool.runs WHERE status = 'running'"
CANCELLED: Final = "SELECT count(*) FROM runpool.runs WHERE status = 'cancelled'"


def _cancel_latencies(server: str, *, rounds: int, per_round: int, **settings: Any
                      ) -> list[float]:
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
        latencies: list[float] = []
        with bench_pool(dsn, workers=2, concurrency=per_round // 2,
                          **settings):
            wait_until(conn, LIVE_WORKERS, 2, timeout=60)
            for r in range(rounds):
                ids = [enqueue(conn, "bench", "await_cancel") for _ in range(per_round)]
                wait_until(conn, RUNNING, per_round, timeout=120)
                committed = {}
                for run_id in ids:
                    conn.execute("SELECT runpool.cancel_run(%s, 'bench')", (run_id,))
                    committed[run_id] = time.time()  # autocommit: returns after COMMIT
                wait_until(conn, CANCELLED, per_round * (r + 1), timeout=120)
                for run_id, content in conn.execute(
                        "SELECT run_id, content FROM runpool.messages WHERE run_id = ANY(%s)",
                        (ids,)):
                    latencies.append((content["seen"] - committed[run_id]) * 1000)
    return latencies


def w9_cancel_latency(server: str) -> dict[str, Any]:
    """W9: cancel_run commit -> the handler seeing the cancellation; 200 running runs with
    LISTEN, and 20 with LISTEN off (the heartbeat must bring it, default lease 30 s)."""
    notified = _cancel_latencies(server, rounds=10, per_round=20)
    polled = _cancel_latencies(server, rounds=1, per_round=20, listen=0)
    return {"workload": "W9", "cancels": len(notified),
            "p50_ms": round(percentile(notified, 50), 2),
            "p99_ms": round(percentile(notified, 99), 2),
            "no_listen_cancels": len(polled), "no_listen_max_ms": round(max(polled), 1),
            "no_listen_heartbeat_s": 10.0}


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


WORKLOADS: Final[dict[str, Callable[[str], dict[str, Any]]]] = {
    "W1": w1_throughput,
    "W1q": lambda server: w1_throughput(server, quotas=True),
    "W1w1": lambda server: w1_throughput(server, workers=1),
    "W1w4": lambda server: w1_throughput(server, workers=4),
    "W2": w2_latency,
    "W3": w3_idle,
    "W5": w5_fairness,
    "W6": w6_claim_depth,
    "W6cost": w6_claim_cost,
    "W7": w7_checkpoint_cost,
    "W8": w8_resume_cost,
    "W9": w9_cancel_latency,
    "W10": w10_serial_keys,
    "W11": w11_agent_load,
    "W11x500": lambda server: {**w11_agent_load(server, slots=500), "workload": "W11x500"},
    "W11x2000": lambda server: {**w11_agent_load(server, slots=2000), "workload": "W11x2000"},
    "W11cpu": w11_turn_cost,
    "W12": w12_follow_latency,
    "W13": w13_progress_cost,
    "W15": w15_rate_limit,
    "W1p": w1p_pooler,
    "W16": w16_many_claimers,
    "W16t": lambda server: w16_many_claimers(server, tenants=16),
    "Wcommits": wcommits,
    "W17": w17_purge,
    "W18": w18_schedule_lateness,
    "W18x1000": w18_schedule_storm,
}
