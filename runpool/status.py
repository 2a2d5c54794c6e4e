"""`python -m runpool status`: what is happening — counts, in-flight and stuck runs, recent
failures, latency percentiles, live workers; `runs RUN_ID`: one run's whole story; and
`schedules`: every schedule with its next plan times."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Final

import psycopg
from psycopg.rows import dict_row

from . import health

__all__ = ["STATUSES", "collect", "history", "render", "render_history", "render_schedules",
           "schedules"]

STATUSES: Final = ("queued", "running", "waiting", "succeeded", "failed", "cancelled")

# Runs by tenant and status (the terminal ones too: they are the history users ask about).
BY_TENANT: Final = """
SELECT tenant, status, count(*) FROM runpool.runs GROUP BY tenant, status ORDER BY tenant, status
"""
# Runs holding a lease: how long they have run, and when the lease runs out (negative: stuck,
# i.e. expired and not yet reclaimed).
IN_FLIGHT: Final = """
SELECT r.id, r.tenant, r.handler, r.attempt, r.worker_id, w.host, w.pid,
       extract(epoch FROM now() - r.started_at)::float8 AS running_s,
       extract(epoch FROM r.lease_expires_at - now())::float8 AS lease_left_s,
       r.cancel_requested_at IS NOT NULL AS cancelling
FROM runpool.runs r LEFT JOIN runpool.workers w ON w.id = r.worker_id
WHERE r.status = 'running'
ORDER BY r.lease_expires_at
LIMIT %(limit)s
"""
STUCK_COUNT: Final = """
SELECT count(*) FROM runpool.runs WHERE status = 'running' AND lease_expires_at < now()
"""
# The dead-letter list, newest first.
FAILURES: Final = """
SELECT id, tenant, handler, attempt, error ->> 'reason' AS reason,
       left(error ->> 'message', 200) AS message, finished_at
FROM runpool.runs WHERE status = 'failed'
ORDER BY finished_at DESC
LIMIT %(limit)s
"""
# Queue wait (creation to the latest start) and run time of the runs finished recently.
LATENCY: Final = """
SELECT count(*) AS runs,
       percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (
           ORDER BY extract(epoch FROM started_at - created_at)) AS wait_s,
       percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (
           ORDER BY extract(epoch FROM finished_at - started_at)) AS run_s
FROM runpool.runs
WHERE finished_at > now() - %(window)s * interval '1 second' AND started_at IS NOT NULL
"""
# Workers seen recently that did not stop cleanly, with what they hold.
WORKERS: Final = """
SELECT w.id, w.host, w.pid, w.concurrency, w.last_seen_at,
       (SELECT count(*) FROM runpool.runs r WHERE r.worker_id = w.id AND r.status = 'running')
       AS running
FROM runpool.workers w
WHERE w.stopped_at IS NULL AND w.last_seen_at > now() - interval '2 minutes'
ORDER BY w.started_at
"""
# runpool's connections to this database per host, as the server sees them (the names come
# from runpool.db.application_name). Behind a pooler the work connections are the pooler's
# server connections, each named after the client that used it last.
CONNECTIONS: Final = """
SELECT split_part(application_name, '@', 2) AS host,
       count(*) FILTER (WHERE application_name LIKE 'runpool-listen@%%') AS listen,
       count(*) FILTER (WHERE application_name LIKE 'runpool-beat-%%') AS heartbeat,
       count(*) FILTER (WHERE application_name NOT LIKE 'runpool-listen@%%'
                          AND application_name NOT LIKE 'runpool-beat-%%') AS work,
       count(*) AS total
FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE 'runpool-%%@%%'
GROUP BY 1 ORDER BY 1
"""
# Whether `status` read a replica (a standby in recovery: NULL lag on a plain server), and how
# old the last transaction it replayed is: its lag while the primary commits; on a primary
# that commits nothing it grows without anything being missed.
REPLICA: Final = """
SELECT pg_is_in_recovery() AS in_recovery,
       extract(epoch FROM clock_timestamp() - pg_last_xact_replay_timestamp())::float8
           AS replayed_s_ago
"""
# Serial keys with the longest line of waiting runs.
SERIAL_BACKLOG: Final = """
SELECT tenant, serial_key, count(*) AS waiting FROM runpool.runs WHERE held
GROUP BY tenant, serial_key ORDER BY waiting DESC, tenant, serial_key LIMIT 10
"""
# What each tenant spent in the hours the window touches (runpool.tenant_usage, 0014: every
# change of a run's usage is added to its tenant's hour as it happens).
USAGE: Final = """
SELECT tenant, runs, input_tokens, output_tokens, cost::float8 AS cost, tool_calls, turns
FROM runpool.tenant_usage_since(now() - %(window)s * interval '1 second')
ORDER BY cost DESC, tenant
LIMIT 100
"""
# One run's story: its events, conversation and tool calls.
EVENTS: Final = """
SELECT at, kind, attempt, worker_id, detail FROM runpool.run_events
WHERE run_id = %(id)s ORDER BY id
"""
MESSAGES: Final = """
SELECT seq, role, attempt, call_id, left(content::text, 160) AS content, created_at
FROM runpool.messages WHERE run_id = %(id)s ORDER BY seq
"""
TOOL_CALLS: Final = """
SELECT call_id, name, status, attempt, executions, left(result::text, 120) AS result,
       started_at, finished_at
FROM runpool.tool_calls WHERE run_id = %(id)s ORDER BY started_at, call_id
"""
EXPLAIN: Final = "SELECT runpool.explain_run(%(id)s)"


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.isoformat() if isinstance(v, datetime) else
                str(v) if isinstance(v, uuid.UUID) else
                round(float(v), 3) if isinstance(v, float | Decimal) else v)
            for k, v in row.items()}


def _rows(conn: psycopg.Connection[Any], query: Any, params: dict[str, Any] | None = None
          ) -> list[dict[str, Any]]:
    cur = conn.cursor(row_factory=dict_row)
    return [_jsonable(r) for r in cur.execute(query, params)]


def collect(conn: psycopg.Connection[Any], *, window_seconds: float = 3600,
            limit: int = 20, xmin_warn_seconds: float = health.XMIN_WARN_SECONDS,
            primary: psycopg.Connection[Any] | None = None) -> dict[str, Any]:
    """Everything `status` shows, as one JSON-ready document. With `primary` (and `conn` a
    read replica's connection), the runs, workers and usage are read on the replica; the
    connections and health (pg_stat_activity, xmin holders, autovacuum: the primary's own
    sessions and tables) on the primary, and `replica` says how far the replica lags."""
    server = primary or conn
    totals = dict.fromkeys(STATUSES, 0)
    tenants: dict[str, dict[str, int]] = {}
    for tenant, status, count in conn.execute(BY_TENANT):
        totals[status] += count
        tenants.setdefault(tenant, dict.fromkeys(STATUSES, 0))[status] = count
    in_flight = _rows(conn, IN_FLIGHT, {"limit": limit})
    stuck_row = conn.execute(STUCK_COUNT).fetchone()
    latency = _rows(conn, LATENCY, {"window": window_seconds})[0]
    percentiles = {}
    for key in ("wait_s", "run_s"):
        values = latency[key] or [None, None, None]
        percentiles[key] = {q: (round(v, 3) if v is not None else None)
                            for q, v in zip(("p50", "p95", "p99"), values, strict=True)}
    return {
        "totals": totals,
        "tenants": tenants,
        "stuck": int(stuck_row[0]) if stuck_row else 0,
        "in_flight": in_flight,
        "failures": _rows(conn, FAILURES, {"limit": limit}),
        "latency": {"window_s": window_seconds, "finished_runs": latency["runs"],
                    **percentiles},
        "workers": _rows(conn, WORKERS),
        "connections": _rows(server, CONNECTIONS),
        "serial_backlog": _rows(conn, SERIAL_BACKLOG),
        "usage": _usage(conn, window_seconds),
        "health": health.collect(server, xmin_warn_seconds=xmin_warn_seconds),
        "replica": _rows(conn, REPLICA)[0] if primary is not None else None,
    }


def _usage(conn: psycopg.Connection[Any], window_seconds: float) -> list[dict[str, Any]]:
    # Not through _rows: a cost is summed exactly and kept to the micro-unit, not rounded
    # to 3 places.
    cur = conn.cursor(row_factory=dict_row)
    rows = cur.execute(USAGE, {"window": window_seconds}).fetchall()
    return [{**r, "cost": round(r["cost"] or 0.0, 6)} for r in rows]


def _fmt(seconds: Any) -> str:
    return "-" if seconds is None else f"{seconds:.2f}s"


def render(report: dict[str, Any]) -> str:
    out = ["runs: " + "  ".join(f"{s} {report['totals'][s]}" for s in STATUSES)
           + f"  (stuck {report['stuck']})"]
    if "health" in report:
        out += health.render(report["health"])
    if (replica := report.get("replica")) is not None:
        lag = replica["replayed_s_ago"]
        out.append("read from a replica (RUNPOOL_READ_DSN): "
                   + ("not in recovery (a primary, no lag)" if not replica["in_recovery"] else
                      f"last replayed transaction {_fmt(lag)} old (its lag while the primary"
                      " commits)"))
    if report["tenants"]:
        out += ["", f"{'tenant':<24}" + "".join(f"{s:>11}" for s in STATUSES)]
        for tenant, counts in report["tenants"].items():
            out.append(f"{tenant[:24]:<24}" + "".join(f"{counts[s]:>11}" for s in STATUSES))
    lat = report["latency"]
    out += ["", f"last {lat['window_s'] / 60:.0f} min, {lat['finished_runs']} finished runs:"
            f"  queue wait p50 {_fmt(lat['wait_s']['p50'])} p95 {_fmt(lat['wait_s']['p95'])}"
            f" p99 {_fmt(lat['wait_s']['p99'])}  |  run time p50 {_fmt(lat['run_s']['p50'])}"
            f" p95 {_fmt(lat['run_s']['p95'])} p99 {_fmt(lat['run_s']['p99'])}"]
    if report["usage"]:
        out += ["", f"usage per tenant (spent in the hours of the last"
                    f" {lat['window_s'] / 60:.0f} min; runs: those that began spending):",
                f"  {'tenant':<24}{'runs':>7}{'input tok':>12}{'output tok':>12}{'cost':>12}"
                f"{'tools':>8}{'turns':>8}"]
        out += [f"  {u['tenant'][:24]:<24}{u['runs']:>7}{u['input_tokens']:>12}"
                f"{u['output_tokens']:>12}{u['cost']:>12.4f}{u['tool_calls']:>8}{u['turns']:>8}"
                for u in report["usage"]]
    if report["in_flight"]:
        out += ["", "in flight (lease left < 0: stuck, reclaimed at the next claim):"]
        for r in report["in_flight"]:
            flag = "  cancelling" if r["cancelling"] else ""
            out.append(f"  {r['id']}  {r['tenant'][:16]:<16} {r['handler'][:16]:<16}"
                       f" attempt {r['attempt']}  running {_fmt(r['running_s'])}"
                       f"  lease left {_fmt(r['lease_left_s'])}"
                       f"  worker {r['host']}:{r['pid']}{flag}")
    if report["failures"]:
        out += ["", "recent failures (retry one with: python -m runpool retry RUN_ID):"]
        for f in report["failures"]:
            out.append(f"  {f['id']}  {f['tenant'][:16]:<16} {f['handler'][:16]:<16}"
                       f" {f['reason']}: {(f['message'] or '')[:80]}")
    if report["serial_backlog"]:
        out += ["", "serial keys with the longest backlog (runs waiting behind a running one):"]
        out += [f"  {k['tenant'][:16]:<16} {k['serial_key'][:40]:<40} {k['waiting']} waiting"
                for k in report["serial_backlog"]]
    out += ["", f"live workers: {len(report['workers'])}"]
    for w in report["workers"]:
        out.append(f"  {w['id']}  {w['host']}:{w['pid']}  running {w['running']}"
                   f"/{w['concurrency']}  last seen {w['last_seen_at']}")
    if report["connections"]:
        out += ["", "runpool connections by host (listen + heartbeat + work = total):"]
        out += [f"  {c['host'][:40]:<40} {c['listen']} + {c['heartbeat']} + {c['work']}"
                f" = {c['total']}" for c in report["connections"]]
    return "\n".join(out)


def history(conn: psycopg.Connection[Any], run_id: uuid.UUID) -> dict[str, Any] | None:
    """One run: explain_run's answer, its events, messages and tool calls."""
    row = conn.execute(EXPLAIN, {"id": run_id}).fetchone()
    if row is None or row[0] is None:
        return None
    params = {"id": run_id}
    return {"explain": row[0], "events": _rows(conn, EVENTS, params),
            "messages": _rows(conn, MESSAGES, params),
            "tool_calls": _rows(conn, TOOL_CALLS, params)}


def render_history(doc: dict[str, Any]) -> str:
    explain = dict(doc["explain"])
    out = [explain.pop("summary")]
    out += [f"  {k}: {v}" for k, v in explain.items()]
    out += ["", "events:"]
    out += [f"  {e['at']}  {e['kind']:<16} attempt {e['attempt']}"
            f"{'  ' + str(e['detail']) if e['detail'] else ''}" for e in doc["events"]]
    if doc["messages"]:
        out += ["", "messages:"]
        out += [f"  {m['seq']:>4} {m['role']:<10} attempt {m['attempt']}  {m['content']}"
                for m in doc["messages"]]
    if doc["tool_calls"]:
        out += ["", "tool calls:"]
        out += [f"  {t['call_id']:<16} {t['name']:<16} {t['status']:<10} attempt {t['attempt']}"
                f"  ran {t['executions']}x  {t['result'] or ''}" for t in doc["tool_calls"]]
    return "\n".join(out)


# Every schedule, with the database's clock (upcoming plan times are counted from it).
SCHEDULES: Final = """
SELECT name, cron, timezone, tenant, handler, catch_up, priority, serial_key, enabled,
       next_fire_at, last_fire_at, error, input, now() AS now
FROM runpool.schedules ORDER BY name
"""


def schedules(conn: psycopg.Connection[Any], *, upcoming: int = 3) -> dict[str, Any]:
    """`schedules`: every schedule, with its next `upcoming` plan times (from next_fire_at,
    or from now for one no pool has planned yet)."""
    from .errors import InvalidInput
    from .schedules import upcoming as plans_after

    out = []
    for row in conn.cursor(row_factory=dict_row).execute(SCHEDULES):
        now = row.pop("now")
        nxt: list[datetime] = []
        if row["enabled"] and not row["error"]:
            try:
                if row["next_fire_at"] is None:
                    nxt = plans_after(row["cron"], row["timezone"], now, upcoming)
                else:
                    first = row["next_fire_at"]
                    nxt = [first, *plans_after(row["cron"], row["timezone"], first,
                                               upcoming - 1)]
            except InvalidInput as exc:  # a pool will say so in `error` too
                row["error"] = str(exc)
        row["next"] = [t.astimezone(UTC).isoformat() for t in nxt]
        out.append(_jsonable(row))
    return {"schedules": out}


def render_schedules(doc: dict[str, Any]) -> str:
    if not doc["schedules"]:
        return "no schedules (set_schedule or @app.schedule creates them)"
    out = []
    for s in doc["schedules"]:
        state = "error" if s["error"] else "enabled" if s["enabled"] else "disabled"
        out.append(f"{s['name']}  [{state}]  {s['cron']} ({s['timezone']})  ->"
                   f" {s['handler']} for {s['tenant']}, catch_up {s['catch_up']}")
        if s["error"]:
            out.append(f"  error: {s['error']}")
        out.append(f"  last fired: {s['last_fire_at'] or '-'}")
        out.append(f"  next: {', '.join(s['next']) or '-'}")
    return "\n".join(out)
