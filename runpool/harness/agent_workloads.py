"""W11: agent-shaped load. Thousands of long runs in flight at once, each turn a model call (a
sleep), a tool call with its checkpoint and a message: what a pool of agents costs and where
it gives (leases, heartbeats, checkpoint latency, commits, CPU and memory per run)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Final

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..db import connect
from ..enqueue import RunSpec, enqueue_many
from ..testing.databases import scratch_database
from ..testing.pools import running_pool
from .measure import (
    CLEAR_SNAPSHOT,
    LIVE_WORKERS,
    XACTS,
    ActivitySampler,
    cpu_seconds,
    percentile,
    wait_until,
)

__all__ = ["w11_agent_load"]

BENCH_APP: Final = "runpool.harness.benchapp:app"
# Seconds since each running run's lease was last taken or renewed, by the database's clock.
LEASE_AGES: Final = """
SELECT %(lease)s - extract(epoch FROM lease_expires_at - now())::float8
FROM runpool.runs WHERE status = 'running'
"""
# Runs ended (any way), and runs still queued or running.
PROGRESS: Final = """
SELECT count(*) FILTER (WHERE status NOT IN ('queued', 'running')),
       count(*) FILTER (WHERE status = 'running')
FROM runpool.runs
"""
# Attempts beyond the first (a lease lost or expired, a retry) and runs that did not succeed.
LOSSES: Final = """
SELECT coalesce(sum(attempt - 1), 0), count(*) FILTER (WHERE status <> 'succeeded')
FROM runpool.runs
"""
RESULTS: Final = "SELECT result FROM runpool.runs WHERE status = 'succeeded'"


def _rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def _xacts(stats: psycopg.Connection[Any], name: str) -> int:
    stats.execute(CLEAR_SNAPSHOT)
    row = stats.execute(XACTS, (name,)).fetchone()
    return int(row[0]) if row else 0


def w11_agent_load(server: str, *, workers: int = 2, slots: int = 1000, runs: int = 5000,
                   turns: int = 20, low: float = 0.2, high: float = 2.0,
                   pool_size: int = 16, lease: float = 30.0) -> dict[str, Any]:
    """W11: `runs` agent runs of `turns` turns (a `low`..`high` s model call, one tool call
    with its checkpoint, one message) on `workers` workers of `slots` slots, `pool_size`
    connections each. Reports lease losses, heartbeat lag (time since a running run's lease
    was renewed, beyond the heartbeat interval), write latencies (a tool call: its intent, the
    tool and its checkpoint; the checkpoint alone; a message), database commits
    per tool call, worker CPU per turn and memory per run in flight; and where a write's time
    goes when it is slow: how late the workers' event loops woke the model calls (a loop
    busy elsewhere), the share of checkpoint writes a garbage collection stopped and their p99
    less the pauses, and what the server's backends did meanwhile (on a CPU or waiting for one,
    or waiting for the WAL's flush, a lock, ...: mean backends, ActivitySampler)."""
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn, \
            connect(server, autocommit=True) as stats:
        name = str(conninfo_to_dict(dsn)["dbname"])
        with running_pool(dsn, BENCH_APP, stop="drain", output="discard", workers=workers,
                          concurrency=slots, pool_size=pool_size, lease_seconds=lease) as pool:
            wait_until(conn, LIVE_WORKERS, workers, timeout=60)
            pids = pool.workers()
            idle_rss = _rss_bytes(pids)
            commits = _xacts(stats, name)
            spec = RunSpec("bench", "agent", {"turns": turns, "low": low, "high": high})
            batches = range(0, runs, 1000)
            for start in batches:
                enqueue_many(conn, [spec] * min(1000, runs - start))
            cpu, began = cpu_seconds(pids), time.monotonic()
            ages: list[float] = []
            peak_rss, peak_flight, polls = 0, 0, 0
            # At least 100 turns a second beyond the runs' own model time (a slot's runs one
            # after another, each sleep its longest), or the load is reported as given up
            # where it stood: 4 runs a slot at 2 x 25 need ~90 s of model time alone.
            rounds = -(-runs // (workers * slots))
            deadline = began + 60 + runs * turns / 100 + rounds * turns * high
            with ActivitySampler(server, name) as sampler:
                while True:
                    ended, flight = conn.execute(PROGRESS).fetchone() or (0, 0)
                    ages.extend(a for (a,) in conn.execute(LEASE_AGES, {"lease": lease}))
                    polls += 2
                    peak_flight = max(peak_flight, flight)
                    peak_rss = max(peak_rss, _rss_bytes(pids))
                    if ended >= runs or time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                elapsed = time.monotonic() - began
            cpu = cpu_seconds(pids) - cpu
            # The poll's own statements are transactions of this database too.
            commits = _xacts(stats, name) - commits - polls - len(batches)
        extra, failed = conn.execute(LOSSES).fetchone() or (0, 0)
        results = [r for (r,) in conn.execute(RESULTS)]
    tool_ms = [ms for r in results for ms in r["tool_ms"]]
    checkpoint_ms = [ms for r in results for ms in r["checkpoint_ms"]]
    message_ms = [ms for r in results for ms in r["message_ms"]]
    loop_lag_ms = [ms for r in results for ms in r["lag_ms"]]
    # Each checkpoint write with the time collections stopped it (a turn an earlier attempt
    # committed has neither: benchapp.agent).
    paused = [(ms, gc) for r in results for ms, gc in zip(r["checkpoint_ms"], r["gc_ms"],
                                                          strict=True)]
    stopped = sum(1 for _, gc in paused if gc > 0.0)
    # Each write less the pause time inside it: a lower bound of what it would have taken
    # without the pauses (one while the worker only waited for the server's answer did not
    # lengthen it). Dropping the paused writes instead would drop the long ones, which any
    # pause is likelier to overlap, pause or not.
    less_gc = [ms - gc for ms, gc in paused]
    calls = len(tool_ms)
    beat = lease / 3
    lag = [max(a - beat, 0.0) for a in ages]
    return {
        "workload": "W11", "workers": workers, "slots": slots, "runs": runs, "turns": turns,
        "ended": int(ended), "seconds": round(elapsed, 1),
        "turns_per_s": round(calls / elapsed, 1),
        "peak_in_flight": peak_flight, "lease_losses": int(extra), "not_succeeded": int(failed),
        "heartbeat_lag_p99_s": round(percentile(lag, 99), 3) if lag else 0.0,
        "heartbeat_lag_max_s": round(max(lag), 3) if lag else 0.0,
        "lease_over_6_s": round(lease / 6, 2),
        "tool_call_p50_ms": round(percentile(tool_ms, 50), 2),
        "tool_call_p99_ms": round(percentile(tool_ms, 99), 2),
        "checkpoint_p50_ms": round(percentile(checkpoint_ms, 50), 2),
        "checkpoint_p99_ms": round(percentile(checkpoint_ms, 99), 2),
        "message_p50_ms": round(percentile(message_ms, 50), 2),
        "message_p99_ms": round(percentile(message_ms, 99), 2),
        "commits_per_tool_call": round(commits / calls, 3),
        "worker_cpu_ms_per_turn": round(cpu / calls * 1000, 3),
        "worker_cpu_pct_of_core": round(cpu / elapsed / workers * 100, 1),
        "rss_kb_per_run_in_flight": round((peak_rss - idle_rss) / max(peak_flight, 1) / 1024, 1),
        "loop_lag_p50_ms": round(percentile(loop_lag_ms, 50), 2),
        "loop_lag_p99_ms": round(percentile(loop_lag_ms, 99), 2),
        "checkpoints_gc_paused_pct": round(100 * stopped / max(len(paused), 1), 2),
        "checkpoint_gc_pause_max_ms": round(max((gc for _, gc in paused), default=0.0), 2),
        "checkpoint_p99_ms_less_gc": round(percentile(less_gc, 99), 2),
        "server_backends": sampler.mean(sampler.events),
        "server_samples": sampler.samples,
        **({"server_sampler_error": sampler.error} if sampler.error else {}),
    }
