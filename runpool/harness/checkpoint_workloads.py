"""Checkpoint cost: W7 (a tool call's checkpoint overhead in one run) and W8 (resuming a run
with many committed calls, and the bytes a call's checkpoint takes)."""

from __future__ import annotations

from typing import Any, Final

import psycopg

from ..db import connect
from ..enqueue import enqueue
from ..testing.databases import scratch_database
from .measure import bench_pool, percentile, wait_until

__all__ = ["w7_checkpoint_cost", "w8_resume_cost"]

# Runs that ended, and those of them that did not succeed: a run that failed (W8's lease of
# 2 s, lost three times on a saturated machine while the heartbeat skipped the row the run's
# own writes held, see runpool.leases) ends the workload at once with its error, where
# waiting for it to succeed would take the whole timeout.
ENDED: Final = "SELECT count(*) FROM runpool.runs WHERE finished_at IS NOT NULL"
NOT_SUCCEEDED: Final = """
SELECT id, status, attempt, error FROM runpool.runs
WHERE finished_at IS NOT NULL AND status <> 'succeeded'"""


def _until_succeeded(conn: psycopg.Connection[Any], runs: int, *, timeout: float) -> None:
    wait_until(conn, ENDED, runs, timeout=timeout)
    if failed := conn.execute(NOT_SUCCEEDED).fetchall():
        raise RuntimeError(f"the benchmark's runs did not all succeed: {failed}")


def w7_checkpoint_cost(server: str, *, calls: int = 1000) -> dict[str, Any]:
    """W7: one run making `calls` no-op tool calls; checkpoint overhead per call."""
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
        run_id = enqueue(conn, "bench", "tool_loop", {"calls": calls})
        with bench_pool(dsn, workers=1, concurrency=1):
            _until_succeeded(conn, 1, timeout=600)
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
            _until_succeeded(conn, 2, timeout=600)
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
