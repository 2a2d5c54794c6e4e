"""Every statement the console and /metrics run reads about as much with thirty times the
finished history as without it: pages touched (EXPLAIN ANALYZE's buffers, not a clock) with
2,000 and then 62,000 finished runs beside the same queue."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from runpool.harness.console_bench import FILL_FINISHED, FILL_QUEUED, FILL_TENANTS, HANDLERS
from runpool.web.sql import SQL

# What each read statement is run with (the heaviest ordinary page of each).
PARAMS: dict[str, dict[str, Any]] = {
    "tenants": {"after": "", "limit": 100, "cap": 10_000, "failed_cap": 1000},
    "in_flight": {"limit": 100},
    "stuck": {"limit": 100},
    "dead_letters": {"before": datetime(9999, 1, 1, tzinfo=UTC),
                     "before_id": uuid.UUID(int=2**128 - 1), "limit": 100},
    "dead_letters_of_tenant": {"tenant": "t07", "before": datetime(9999, 1, 1, tzinfo=UTC),
                               "before_id": uuid.UUID(int=2**128 - 1), "limit": 100},
    "workers": {"limit": 100},
    "schedules": {"limit": 100},
    "live_workers": {},
    "event_mark": {},
}
# Per run: its row, conversation, tool calls and events, and explain_run.
PER_RUN = ("run", "messages", "tool_calls", "run_events", "explain")


def _pages(conn: psycopg.Connection[Any], name: str, params: dict[str, Any]) -> int:
    row = conn.execute(b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + SQL[name].encode(),
                       params).fetchone()
    assert row is not None
    plan = row[0][0]
    top = plan["Plan"]
    return int(top["Shared Hit Blocks"] + top["Shared Read Blocks"])


def _measure(conn: psycopg.Connection[Any], run_id: uuid.UUID, mark: int) -> dict[str, int]:
    conn.execute("VACUUM ANALYZE runpool.runs")
    conn.execute("VACUUM ANALYZE runpool.run_events")
    pages = {name: _pages(conn, name, params) for name, params in PARAMS.items()}
    for name in PER_RUN:
        pages[name] = _pages(conn, name, {"id": run_id, "tenant": None, "limit": 500})
    pages["events_since"] = _pages(conn, "events_since", {"mark": mark, "limit": 50_000,
                                                          "lag": 5.0})
    return pages


def test_console_statements__read_the_same_pages_whatever_the_finished_history(conn) -> None:
    fill = {"tenants": 50, "handlers": list(HANDLERS)}
    conn.execute(FILL_TENANTS, fill)
    conn.execute(FILL_QUEUED, {**fill, "n": 1000})
    conn.execute(FILL_FINISHED, {**fill, "n": 2000})
    # Full pages from the start: one tenant's 150 dead letters (a page shows 100).
    conn.execute("INSERT INTO runpool.runs (tenant, handler, status, attempt, max_attempts,"
                 " error, rank, created_at, started_at, finished_at)"
                 " SELECT 't07', 'plan', 'failed', 1, 3, '{\"reason\": \"boom\"}', 0,"
                 " now() - interval '1 hour', now() - interval '1 hour',"
                 " now() - i * interval '1 second' FROM generate_series(1, 150) i")
    run_id = conn.execute("SELECT id FROM runpool.runs WHERE status = 'queued' LIMIT 1"
                          ).fetchone()[0]
    conn.execute("INSERT INTO runpool.messages (run_id, seq, role, content, attempt)"
                 " SELECT %s, i, 'assistant', %s, 1 FROM generate_series(1, 20) i",
                 (run_id, Jsonb("hello")))
    mark = conn.execute("SELECT max(id) FROM runpool.run_events").fetchone()[0]
    small = _measure(conn, run_id, mark)

    conn.execute(FILL_FINISHED, {**fill, "n": 60_000})
    large = _measure(conn, run_id, conn.execute(
        "SELECT max(id) FROM runpool.run_events").fetchone()[0])
    assert conn.execute("SELECT count(*) FROM runpool.runs WHERE finished_at IS NOT NULL"
                        ).fetchone()[0] == 62_150
    # Room for a page of 100 rows each on a heap page of its own (where the newest rows lie
    # differs between the two histories); a scan of history reads thousands.
    grown = {name: (small[name], large[name]) for name in small
             if large[name] > 1.5 * small[name] + 130}
    assert not grown, f"pages read grew with the finished history: {grown}"
    # The measure sees reads at all (a statement reading nothing would prove nothing).
    assert large["tenants"] > 50 and large["dead_letters"] > 3
