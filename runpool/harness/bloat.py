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
from ..testing.pools import running_pool
from .measure import percentile

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
        try:
            while time.monotonic() - started < seconds:
                stop.wait(min(every, max(seconds - (time.monotonic() - started), 0.1)))
                now = time.monotonic()
                unfinished = int(conn.execute(UNFINISHED).fetchone()[0])  # type: ignore[index]
                done = max(enqueued[0] - unfinished, 0)
                window, seen = samples[seen:], len(samples)
                warnings = [w for w in health.collect(conn, xmin_warn_seconds=min(every, 60))
                            ["warnings"] if w.startswith("xmin held")]
                row = {"t_s": round(now - started, 1), "runs_done": done,
                       "runs_per_s": round((done - last_done) / max(now - last_at, 1e-6), 1),
                       "claim_p50_ms": round(percentile(window, 50), 2) if window else None,
                       "claim_p99_ms": round(percentile(window, 99), 2) if window else None,
                       "xmin_pinned": pinned[0], "xmin_warning": warnings[0] if warnings else None,
                       "tables": _sample(conn)}
                rows.append(row)
                print(json.dumps(row), file=out, flush=True)
                last_done, last_at = done, now
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
                         "xmin_pinned", "total_mb", *(f"{t}_dead" for t in TABLES)])
        for r in rows:
            writer.writerow([r["t_s"], r["runs_done"], r["runs_per_s"], r["claim_p50_ms"],
                             r["claim_p99_ms"], r["xmin_pinned"], round(_total_mb(r), 2),
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
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for table in TABLES:
        axes[0].plot(t, [r["tables"].get(table, {}).get("table_mb", 0)
                         + r["tables"].get(table, {}).get("index_mb", 0) for r in rows],
                     label=table)
    axes[0].set_ylabel("size with indexes (MB)")
    axes[0].legend(fontsize="small")
    axes[1].plot(t, [r["claim_p99_ms"] for r in rows], label="p99")
    axes[1].plot(t, [r["claim_p50_ms"] for r in rows], label="p50")
    axes[1].set_ylabel("claim (ms)")
    axes[1].legend(fontsize="small")
    axes[2].plot(t, [r["runs_per_s"] for r in rows])
    axes[2].set_ylabel("runs/s")
    axes[2].set_xlabel("minutes")
    for ax in axes:
        for r0, r1 in itertools.pairwise(rows):
            if r1["xmin_pinned"]:
                ax.axvspan(r0["t_s"] / 60, r1["t_s"] / 60, color="orange", alpha=0.2)
    fig.suptitle("runpool soak: retention, bloat, claim latency (orange: xmin pinned)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"curves written to {path} and {csv_path}", file=out)
