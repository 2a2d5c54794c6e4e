"""`python -m runpool bench --soak MINUTES --bloat`: the long-lived soak (issue 18).

A real pool (two workers x 10, retention `--retention` seconds, one minute by default) drains
a W1-style stream of runs (nine no-op runs for one that commits two tool calls, so messages,
tool calls and events churn too) kept at a few thousand queued, for MINUTES or `--max-runs`
runs. Beside it a probe claims like a third worker (one run at a time, finished at once) and
times each claim statement. Every `--every` seconds it prints one JSON line: the tables' and
indexes' sizes, dead tuples, claim p50/p99, runs/s, and whether `status` warns of a pinned
xmin. With `--pin-xmin S`, a session holds a snapshot open for S seconds from a third of the
way in (the forgotten-transaction scenario). At the end: a summary line (did sizes plateau,
did the pool log errors) and, with `--plot PATH`, the curves as an image (matplotlib, the
`plot` extra) and as CSV beside it.
"""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Final, TextIO

import psycopg
from psycopg.types.json import Jsonb

from .. import health
from ..claiming import claim
from ..db import aconnect, connect
from ..embedded import resolve_dsn
from ..enqueue import RunSpec, enqueue_many
from ..queries import QUERIES
from ..settings import Settings
from ..testing.databases import scratch_database
from ..testing.pools import running_pool, worker_pids
from .measure import cpu_seconds, percentile

__all__ = ["run_bloat_soak"]

BENCH_APP: Final = "runpool.harness.benchapp:app"
# Queued runs the feeder keeps the queue at (W1's drain, without an ever-growing backlog).
QUEUE_TARGET: Final = 4000
CHUNK: Final = 2000
# The tables whose sizes and dead tuples are reported.
TABLES: Final = ("runs", "messages", "tool_calls", "run_events", "status_events")
SIZES: Final = """
SELECT c.relname, pg_table_size(c.oid), pg_indexes_size(c.oid), coalesce(s.n_dead_tup, 0),
       coalesce(s.n_live_tup, 0)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE n.nspname = 'runpool' AND c.relname = ANY(%s)
"""
QUEUED: Final = "SELECT count(*) FROM runpool.runs WHERE status = 'queued'"
# The claim statement's counters (pg_stat_statements, when the server preloads it): buffers a
# claim reads do not depend on how loaded the machine is, its latency does.
STATEMENTS: Final = "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"
CLAIM_COUNTERS: Final = """
SELECT coalesce(sum(calls), 0)::float8,
       coalesce(sum(shared_blks_hit + shared_blks_read), 0)::float8, coalesce(sum(rows), 0)::float8
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND query LIKE '-- Claim up to %%'
"""
# This database's backends (their CPU is read from /proc when the server runs on this host).
BACKENDS: Final = """
SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()
"""
# Fewer runs than this in a window (the drain's tail) report no CPU per run: what the pool
# spends anyway (autovacuum, the probe, heartbeats) divided by a handful of runs is no cost
# of a run (the million-run soak's last minute showed 388 ms "a run").
MIN_RUNS_FOR_CPU: Final = 100
UNFINISHED: Final = "SELECT count(*) FROM runpool.runs WHERE status IN ('queued', 'running')"


class _Stop(threading.Event):
    pass


def _feed(dsn: str, stop: _Stop, enqueued: list[int], max_runs: int | None) -> None:
    """Keep about QUEUE_TARGET runs queued until stopped (or max_runs were enqueued)."""
    with connect(dsn, autocommit=False) as conn:
        n = 0
        while not stop.is_set() and (max_runs is None or enqueued[0] < max_runs):
            row = conn.execute(QUEUED).fetchone()
            conn.commit()
            if row is not None and row[0] >= QUEUE_TARGET:
                stop.wait(0.1)
                continue
            specs = []
            for _ in range(CHUNK):
                n += 1
                specs.append(RunSpec("soak", "tool_loop", {"calls": 2}) if n % 10 == 0
                             else RunSpec("soak", "noop"))
            enqueue_many(conn, specs)
            conn.commit()
            enqueued[0] += len(specs)


async def _probe(dsn: str, stop: _Stop, samples: list[float]) -> None:
    """Claim like a worker, one run a time, timing each claim statement; finish what it got."""
    worker = uuid.uuid4()
    async with await aconnect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            t0 = time.perf_counter()
            got = await claim(conn, worker_id=worker, limit=1, lease_seconds=60,
                              handlers=["noop"])
            samples.append((time.perf_counter() - t0) * 1000)
            if got:
                await conn.execute(QUERIES["finish_runs"], {
                    "ids": [r.id for r in got], "attempts": [r.attempt for r in got],
                    "outcomes": ["succeeded"] * len(got), "results": [Jsonb(None)] * len(got),
                    "errors": [None] * len(got), "delays": [0.0] * len(got)})
            await asyncio.sleep(0.1)


def _pin(dsn: str, stop: _Stop, at: float, seconds: float, pinned: list[bool]) -> None:
    """From `at` seconds on, hold a snapshot open for `seconds` (pinning xmin)."""
    if stop.wait(at):
        return
    with connect(dsn) as conn:
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT count(*) FROM runpool.runs")
        pinned[0] = True
        stop.wait(seconds)
        pinned[0] = False
        conn.rollback()


def _claim_counters(conn: psycopg.Connection[Any]) -> tuple[float, float, float] | None:
    """(calls, buffers, runs claimed) of the claim so far, or None without
    pg_stat_statements."""
    try:
        with conn.transaction():
            row = conn.execute(CLAIM_COUNTERS).fetchone()
    except psycopg.Error:
        return None
    return (float(row[0]), float(row[1]), float(row[2])) if row else None


def _cpu(conn: psycopg.Connection[Any], pool_pid: int) -> dict[str, float]:
    """CPU seconds so far of the pool's workers, and of each of the database's backends."""
    backends = {int(pid): cpu_seconds([int(pid)]) for (pid,) in conn.execute(BACKENDS)}
    return {"workers": cpu_seconds(worker_pids(pool_pid)), **{str(p): c for p, c in
                                                             backends.items()}}


def _per_run_ms(before: dict[str, float], after: dict[str, float], runs: int) -> dict[str, Any]:
    """Worker and backend CPU per run between two samples (backends alive at both)."""
    if runs < MIN_RUNS_FOR_CPU:
        return {"worker_cpu_ms_per_run": None, "db_cpu_ms_per_run": None}
    db = sum(after[k] - before[k] for k in after if k != "workers" and k in before)
    return {"worker_cpu_ms_per_run": round((after["workers"] - before["workers"]) * 1000 / runs, 3),
            "db_cpu_ms_per_run": round(db * 1000 / runs, 3)}


def _sample(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    sizes = {}
    for name, table, indexes, dead, live in conn.execute(SIZES, (list(TABLES),)):
        sizes[name] = {"table_mb": round(table / 1e6, 2), "index_mb": round(indexes / 1e6, 2),
                       "dead": dead, "live": live}
    return sizes


def run_bloat_soak(settings: Settings, minutes: float, *, retention: float = 60.0,
                   every: float = 60.0, pin_xmin: float = 0.0, pin_at: float | None = None,
                   max_runs: int | None = None, plot: str | None = None,
                   out: TextIO = sys.stdout) -> int:
    server = resolve_dsn(settings, announce=False)
    seconds = minutes * 60
    with scratch_database(server, prefix="runpool_bloat") as dsn, \
            running_pool(dsn, BENCH_APP, workers=2, concurrency=10, poll_seconds=1,
                         retention_seconds=retention, stop="drain") as pool, \
            connect(dsn, autocommit=True) as conn:
        # Without autovacuum nothing removes dead rows: the soak then shows the growth alone.
        autovacuum = str(conn.execute("SHOW autovacuum").fetchone()[0])  # type: ignore[index]
        try:
            with conn.transaction():
                conn.execute(STATEMENTS)
        except psycopg.Error:
            pass  # not preloaded: the report has no claim buffers
        stop, enqueued, pinned = _Stop(), [0], [False]
        samples: list[float] = []
        threads = [threading.Thread(target=_feed, args=(dsn, stop, enqueued, max_runs)),
                   threading.Thread(target=lambda: asyncio.run(_probe(dsn, stop, samples)))]
        if pin_xmin > 0:
            threads.append(threading.Thread(target=_pin, args=(
                dsn, stop, seconds / 3 if pin_at is None else pin_at, pin_xmin, pinned)))
        for t in threads:
            t.start()
        rows: list[dict[str, Any]] = []
        started = time.monotonic()
        last_done, last_at, seen = 0, started, 0
        last_claims, last_cpu = _claim_counters(conn), _cpu(conn, pool.pid)
        try:
            while time.monotonic() - started < seconds:
                stop.wait(min(every, max(seconds - (time.monotonic() - started), 0.1)))
                now = time.monotonic()
                unfinished = int(conn.execute(UNFINISHED).fetchone()[0])  # type: ignore[index]
                done = max(enqueued[0] - unfinished, 0)
                window, seen = samples[seen:], len(samples)
                warnings = [w for w in health.collect(conn, xmin_warn_seconds=min(every, 60))
                            ["warnings"] if w.startswith("xmin held")]
                claims, cpu = _claim_counters(conn), _cpu(conn, pool.pid)
                calls = claims[0] - last_claims[0] if claims and last_claims else 0
                row = {"t_s": round(now - started, 1), "runs_done": done,
                       "runs_per_s": round((done - last_done) / max(now - last_at, 1e-6), 1),
                       "claim_p50_ms": round(percentile(window, 50), 2) if window else None,
                       "claim_p99_ms": round(percentile(window, 99), 2) if window else None,
                       # Buffers a claim reads, and runs a claim takes (a claim's buffers
                       # grow with the runs it takes: each is an update of an indexed row).
                       "claim_buffers": round((claims[1] - last_claims[1]) / calls, 1)
                       if claims and last_claims and calls else None,
                       "claim_runs": round((claims[2] - last_claims[2]) / calls, 2)
                       if claims and last_claims and calls else None,
                       **_per_run_ms(last_cpu, cpu, done - last_done),
                       "xmin_pinned": pinned[0], "xmin_warning": warnings[0] if warnings else None,
                       "tables": _sample(conn)}
                rows.append(row)
                print(json.dumps(row), file=out, flush=True)
                last_done, last_at, last_claims, last_cpu = done, now, claims, cpu
                if max_runs is not None and done >= max_runs:
                    break
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        log = pool.log()
    errors = [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line]
    summary = {**_summary(rows, errors, retention), "server_autovacuum": autovacuum}
    print(json.dumps(summary), file=out, flush=True)
    if plot:
        _plot(rows, Path(plot), out)
    return 0 if not errors else 1


def _mb(row: dict[str, Any], table: str) -> float:
    sizes = row["tables"].get(table, {})
    return float(sizes.get("table_mb", 0) + sizes.get("index_mb", 0))


def _total_mb(row: dict[str, Any]) -> float:
    return float(sum(t["table_mb"] + t["index_mb"] for t in row["tables"].values()))


def _summary(rows: list[dict[str, Any]], errors: list[str], retention: float) -> dict[str, Any]:
    half = rows[len(rows) // 2:] or rows
    p99 = [r["claim_p99_ms"] for r in rows if r["claim_p99_ms"] is not None]
    return {"workload": "soak-bloat", "retention_s": retention,
            "runs_done": rows[-1]["runs_done"] if rows else 0,
            "samples": len(rows),
            # Sizes plateau: the second half's largest total over its first.
            "size_mb_second_half": [round(_total_mb(half[0]), 2),
                                    round(max(map(_total_mb, half)), 2)] if half else None,
            "claim_p99_ms_range": [min(p99), max(p99)] if p99 else None,
            "xmin_warned": any(r["xmin_warning"] for r in rows),
            "pool_errors": len(errors), "first_error": errors[0] if errors else None}


def _plot(rows: list[dict[str, Any]], path: Path, out: TextIO) -> None:
    """The curves as CSV (always) and an image (when matplotlib is installed)."""
    csv_path = path.with_suffix(".csv")
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["t_s", "runs_done", "runs_per_s", "claim_p50_ms", "claim_p99_ms",
                         "claim_buffers", "claim_runs", "worker_cpu_ms_per_run",
                         "db_cpu_ms_per_run",
                         "xmin_pinned", "total_mb", *(f"{t}_mb" for t in TABLES),
                         *(f"{t}_dead" for t in TABLES)])
        for r in rows:
            writer.writerow([r["t_s"], r["runs_done"], r["runs_per_s"], r["claim_p50_ms"],
                             r["claim_p99_ms"], r.get("claim_buffers"), r.get("claim_runs"),
                             r.get("worker_cpu_ms_per_run"), r.get("db_cpu_ms_per_run"),
                             r["xmin_pinned"], round(_total_mb(r), 2),
                             *(round(_mb(r, t), 2) for t in TABLES),
                             *(r["tables"].get(t, {}).get("dead") for t in TABLES)])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"curves written to {csv_path}; pip install 'runpool[plot]' for the image",
              file=out)
        return
    t = [r["t_s"] / 60 for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(8, 11), sharex=True)
    for table in TABLES:
        axes[0].plot(t, [_mb(r, table) for r in rows], label=table)
    axes[0].set_ylabel("size with indexes (MB)")
    axes[0].legend(fontsize="small")
    axes[1].plot(t, [r["claim_p99_ms"] for r in rows], label="p99")
    axes[1].plot(t, [r["claim_p50_ms"] for r in rows], label="p50")
    axes[1].set_ylabel("claim (ms)")
    axes[1].legend(fontsize="small")
    # What the machine's load does not change: buffers a claim reads, CPU a run costs.
    axes[2].plot(t, [r.get("claim_buffers") for r in rows], label="buffers a claim")
    axes[2].set_ylabel("buffers a claim")
    cpu = axes[2].twinx()
    cpu.plot(t, [r.get("db_cpu_ms_per_run") for r in rows], color="tab:red",
             label="database CPU a run (ms)")
    cpu.set_ylabel("database CPU a run (ms)", color="tab:red")
    axes[3].plot(t, [r["runs_per_s"] for r in rows])
    axes[3].set_ylabel("runs/s")
    axes[3].set_xlabel("minutes")
    for ax in axes:
        for r0, r1 in itertools.pairwise(rows):
            if r1["xmin_pinned"]:
                ax.axvspan(r0["t_s"] / 60, r1["t_s"] / 60, color="orange", alpha=0.2)
    fig.suptitle("runpool soak: retention, bloat, claim latency (orange: xmin pinned)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"curves written to {path} and {csv_path}", file=out)
