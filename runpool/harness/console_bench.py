"""The console's cost at size: every page of runpool.web and a /metrics scrape, timed through
a real uvicorn server on a database holding a million finished runs and ten thousand queued.

    python -m runpool.harness.console_bench --dsn postgresql://... [--finished 1000000]
        [--queued 10000] [--requests 30] [--keep]

The database (runpool_console_bench on the DSN's server) is filled once with set-based
INSERTs (bench data, written directly as the database owner, not through enqueue) and kept
with --keep, so a second run measures at once. One JSON line per route: p50 and p95 in
milliseconds, as seen by an HTTP client on the same host (loopback: within a millisecond of
the server's own time). Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import threading
import time
from typing import Any, Final

import httpx
import psycopg
import uvicorn
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from runpool.db import connect
from runpool.migrate import migrate
from runpool.web import create_app

__all__ = ["fill", "main", "measure"]

DATABASE: Final = "runpool_console_bench"
TENANTS: Final = 50
HANDLERS: Final = ("research", "summarize", "translate", "triage", "plan")

# Finished history: 90 % succeeded, 7 % failed, 3 % cancelled, over the last 30 days, with one
# 'enqueued' event each (the event log grows with history too).
FILL_FINISHED: Final = """
WITH made AS (
    INSERT INTO runpool.runs (tenant, handler, status, attempt, max_attempts, input, result,
                              error, rank, created_at, started_at, finished_at, available_at)
    SELECT 't' || lpad((i %% %(tenants)s)::text, 2, '0'),
           (%(handlers)s::text[])[1 + i %% 5],
           s.status, 1, 3, jsonb_build_object('n', i),
           CASE WHEN s.status = 'succeeded' THEN '{"ok": true}'::jsonb END,
           CASE WHEN s.status = 'failed' THEN jsonb_build_object(
               'reason', 'handler_error', 'message', 'RuntimeError: bench failure ' || i) END,
           extract(epoch FROM f.at), f.at - interval '40 s', f.at - interval '30 s', f.at,
           f.at - interval '40 s'
    FROM generate_series(1, %(n)s) AS i
    CROSS JOIN LATERAL (SELECT now() - (i::float8 / %(n)s) * interval '30 days' AS at) f
    CROSS JOIN LATERAL (SELECT CASE WHEN i / %(tenants)s %% 100 < 90 THEN 'succeeded'
                                    WHEN i / %(tenants)s %% 100 < 97 THEN 'failed'
                                    ELSE 'cancelled' END AS status) s
    RETURNING id, created_at
)
INSERT INTO runpool.run_events (run_id, kind, attempt, at)
SELECT id, 'enqueued', 0, created_at FROM made
"""
# The queue: ready runs, and a tenth scheduled for tomorrow (waiting).
FILL_QUEUED: Final = """
INSERT INTO runpool.runs (tenant, handler, input, max_attempts, rank, available_at, deferred)
SELECT 't' || lpad((i %% %(tenants)s)::text, 2, '0'), (%(handlers)s::text[])[1 + i %% 5],
       jsonb_build_object('n', i), 3, extract(epoch FROM a.at), a.at, i %% 10 = 0
FROM generate_series(1, %(n)s) AS i
CROSS JOIN LATERAL (SELECT CASE WHEN i %% 10 = 0 THEN now() + interval '1 day'
                                ELSE now() - (i::float8 / %(n)s) * interval '1 hour' END AS at) a
"""
FILL_TENANTS: Final = """
INSERT INTO runpool.tenants (tenant, max_running)
SELECT 't' || lpad(i::text, 2, '0'), CASE WHEN i %% 3 = 0 THEN 20 END
FROM generate_series(0, %(tenants)s - 1) AS i
ON CONFLICT DO NOTHING
"""
# A long conversation on one finished run, for its page.
FILL_MESSAGES: Final = """
INSERT INTO runpool.messages (run_id, seq, role, content, attempt)
SELECT %(run)s, i, CASE WHEN i %% 2 = 0 THEN 'assistant' ELSE 'user' END,
       to_jsonb('message ' || i || ' ' || repeat('lorem ipsum ', 20)), 1
FROM generate_series(1, 2000) AS i
"""


def _with_db(dsn: str, dbname: str) -> str:
    params = conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return make_conninfo(**params)  # type: ignore[arg-type]


def fill(dsn: str, finished: int, queued: int) -> str:
    """The bench database, created and filled unless it already holds `finished` runs."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        exists = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                               (DATABASE,)).fetchone()
        if not exists:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))
    target = _with_db(dsn, DATABASE)
    with connect(target, autocommit=True) as conn:
        migrate(conn)
        row = conn.execute("SELECT count(*) FROM runpool.runs WHERE finished_at IS NOT NULL"
                           ).fetchone()
        if row and row[0] >= finished:
            return target
        # Filled in one transaction: a fill cut short leaves nothing behind.
        conn.autocommit = False
        started = time.monotonic()
        params = {"tenants": TENANTS, "handlers": list(HANDLERS)}
        conn.execute(FILL_TENANTS, params)
        conn.execute(FILL_FINISHED, {**params, "n": finished})
        conn.execute(FILL_QUEUED, {**params, "n": queued})
        some = conn.execute("SELECT id FROM runpool.runs WHERE status = 'succeeded' LIMIT 1"
                            ).fetchone()
        assert some is not None
        conn.execute(FILL_MESSAGES, {"run": some[0]})
        conn.commit()
        conn.autocommit = True
        conn.execute("VACUUM ANALYZE runpool.runs")
        conn.execute("VACUUM ANALYZE runpool.run_events")
        conn.execute("VACUUM ANALYZE runpool.messages")
        print(f"filled {finished} finished and {queued} queued runs in"
              f" {time.monotonic() - started:.0f} s", file=sys.stderr)
    return target


def _routes(conn: psycopg.Connection[Any]) -> dict[str, str]:
    def one(query: Any) -> str:
        row = conn.execute(query).fetchone()
        assert row is not None
        return str(row[0])

    queued = one("SELECT id FROM runpool.runs WHERE status = 'queued' AND NOT deferred LIMIT 1")
    talked = one("SELECT run_id FROM runpool.messages LIMIT 1")
    return {
        "tenants": "/", "in_flight": "/runs", "stuck": "/stuck", "dead_letters": "/dead",
        "dead_letters_of_tenant": "/dead?tenant=t07", "workers": "/workers",
        "schedules": "/schedules",
        "run_queued_explained": f"/runs/{queued}", "run_2000_messages": f"/runs/{talked}",
        "api_read_run": f"/api/runs/{queued}", "metrics": "/metrics", "healthz": "/healthz",
    }


def measure(dsn: str, requests: int) -> list[dict[str, Any]]:
    with connect(dsn, autocommit=True) as conn:
        routes = _routes(conn)
    server = uvicorn.Server(uvicorn.Config(create_app(dsn), host="127.0.0.1", port=0,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    out = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            for name, path in routes.items():
                for _ in range(3):  # warm: plans cached, pages in the buffer cache
                    client.get(path).raise_for_status()
                times = []
                for _ in range(requests):
                    start = time.perf_counter()
                    client.get(path).raise_for_status()
                    times.append((time.perf_counter() - start) * 1000)
                times.sort()
                out.append({"route": name, "path": re.sub(r"[0-9a-f-]{36}", "{id}", path),
                            "p50_ms": round(statistics.median(times), 1),
                            "p95_ms": round(times[int(0.95 * (len(times) - 1))], 1),
                            "max_ms": round(times[-1], 1)})
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runpool.harness.console_bench",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", required=True, help="a server where it may create a database")
    parser.add_argument("--finished", type=int, default=1_000_000)
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--keep", action="store_true", help="keep the filled database")
    args = parser.parse_args(argv)
    target = fill(args.dsn, args.finished, args.queued)
    try:
        for line in measure(target, args.requests):
            print(json.dumps({"workload": "console", "finished": args.finished,
                              "queued": args.queued, **line}), flush=True)
    finally:
        if not args.keep:
            with psycopg.connect(args.dsn, autocommit=True) as admin:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(DATABASE)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
