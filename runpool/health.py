"""What keeps a queue healthy over months, for `status` (and the console): who holds back
vacuum (a pinned xmin), the hot tables' sizes and dead tuples, the retention purge's last turn,
and the dead-letter alert outbox.

A snapshot older than every dead row version keeps vacuum from removing any of them, in every
table of the database: one forgotten transaction (an idle-in-transaction session, a long
report, an abandoned prepared transaction or replication slot) lets the queue's dead tuples
pile up until every claim wades through them. `status` names the holder so it can be ended.
"""

from __future__ import annotations

from typing import Any, Final

import psycopg
from psycopg.rows import dict_row

__all__ = ["XMIN_WARN_SECONDS", "collect", "render", "xmin_warnings"]

# A snapshot held this long is worth a warning: runpool's own transactions last milliseconds.
XMIN_WARN_SECONDS: Final = 60.0

# Sessions of this database holding a snapshot (backend_xmin) for longer than %(min_s)s,
# oldest first. held_s is NULL for another role's session unless the reader may see its
# timings (pg_read_all_stats); xid_age always says how far back it holds.
XMIN_SESSIONS: Final = """
SELECT pid, usename AS role, application_name, state,
       extract(epoch FROM now() - xact_start)::float8 AS held_s,
       age(backend_xmin) AS xid_age
FROM pg_stat_activity
WHERE datname = current_database() AND backend_xmin IS NOT NULL AND pid <> pg_backend_pid()
  AND (xact_start IS NULL OR xact_start < now() - make_interval(secs => %(min_s)s))
ORDER BY age(backend_xmin) DESC
LIMIT 5
"""
# The same for what is not a session: prepared transactions and replication slots.
XMIN_OTHERS: Final = """
SELECT 'prepared transaction ' || gid AS holder,
       extract(epoch FROM now() - prepared)::float8 AS held_s, age(transaction) AS xid_age
FROM pg_prepared_xacts
WHERE database = current_database() AND prepared < now() - make_interval(secs => %(min_s)s)
UNION ALL
SELECT 'replication slot ' || slot_name, NULL, age(coalesce(xmin, catalog_xmin))
FROM pg_replication_slots WHERE xmin IS NOT NULL
"""
# Whether anything vacuums runpool's tables: the server's autovacuum switch, and the tables
# that turned it off for themselves.
AUTOVACUUM: Final = """
SELECT current_setting('autovacuum')::boolean AS server,
       array(SELECT c.relname::text FROM pg_class c
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = 'runpool' AND c.relkind = 'r'
               AND 'autovacuum_enabled=false' = ANY(c.reloptions) ORDER BY 1) AS tables_off
"""
# runpool's tables: size with indexes and TOAST, live and dead tuples, last vacuum.
TABLES: Final = """
SELECT c.relname AS table, pg_total_relation_size(c.oid) AS bytes,
       s.n_live_tup AS live, s.n_dead_tup AS dead,
       greatest(s.last_vacuum, s.last_autovacuum) AS vacuumed_at
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE n.nspname = 'runpool' AND c.relkind = 'r'
ORDER BY pg_total_relation_size(c.oid) DESC
"""
# The background purge's last turn.
RETENTION: Final = """
SELECT last_at AS last_purge_at, last_count AS last_purged, next_at AS next_purge_at
FROM runpool.maintenance WHERE task = 'purge'
"""
# Alerts not delivered yet (waiting for a pool with a webhook, or being retried).
ALERTS: Final = """
SELECT count(*) AS pending, count(*) FILTER (WHERE tries > 0) AS retrying,
       extract(epoch FROM now() - min(created_at))::float8 AS oldest_s,
       (array_agg(last_error ORDER BY next_at DESC) FILTER (WHERE last_error IS NOT NULL))[1]
       AS last_error
FROM runpool.alerts WHERE delivered_at IS NULL
"""


def _rows(conn: psycopg.Connection[Any], query: Any, params: dict[str, Any] | None = None
          ) -> list[dict[str, Any]]:
    return conn.cursor(row_factory=dict_row).execute(query, params).fetchall()


def _warning(holder: str, held_s: float | None, xid_age: int) -> str:
    held = f"{held_s:.0f} s" if held_s is not None else f"{xid_age} transactions"
    return f"xmin held by {holder} for {held} — vacuum cannot clean the queue"


def _xmin_warnings(sessions: list[dict[str, Any]], others: list[dict[str, Any]]) -> list[str]:
    return ([_warning(f"pid {s['pid']}", s["held_s"], s["xid_age"]) for s in sessions]
            + [_warning(o["holder"], o["held_s"], o["xid_age"]) for o in others])


async def xmin_warnings(aconn: psycopg.AsyncConnection[Any],
                        xmin_warn_seconds: float | None = None) -> list[str]:
    """The pinned-xmin warnings alone, for the console (XMIN_WARN_SECONDS by default)."""
    params = {"min_s": XMIN_WARN_SECONDS if xmin_warn_seconds is None else xmin_warn_seconds}
    cur = aconn.cursor(row_factory=dict_row)
    sessions = await (await cur.execute(XMIN_SESSIONS, params)).fetchall()
    others = await (await cur.execute(XMIN_OTHERS, params)).fetchall()
    return _xmin_warnings(sessions, others)


def collect(conn: psycopg.Connection[Any], *,
            xmin_warn_seconds: float = XMIN_WARN_SECONDS) -> dict[str, Any]:
    """The health part of `status --json`."""
    params = {"min_s": xmin_warn_seconds}
    sessions = _rows(conn, XMIN_SESSIONS, params)
    others = _rows(conn, XMIN_OTHERS, params)
    warnings = _xmin_warnings(sessions, others)
    vacuum = _rows(conn, AUTOVACUUM)[0]
    if not vacuum["server"]:
        warnings.append("autovacuum is off on this server: nothing removes the queue's dead"
                        " rows (turn it on, or VACUUM runpool's tables on a schedule)")
    if vacuum["tables_off"]:
        warnings.append(f"autovacuum is off for {', '.join(vacuum['tables_off'])}: their dead"
                        " rows stay until someone runs VACUUM")
    tables = {r.pop("table"): r for r in _rows(conn, TABLES)}
    for row in tables.values():
        if row["vacuumed_at"] is not None:
            row["vacuumed_at"] = row["vacuumed_at"].isoformat()
    retention = _rows(conn, RETENTION)
    alerts = _rows(conn, ALERTS)[0]
    if alerts["pending"] and alerts["retrying"]:
        warnings.append(f"{alerts['pending']} dead-letter alerts not delivered"
                        f" (last error: {alerts['last_error']})")
    return {
        "warnings": warnings,
        "xmin_holders": [*({"holder": f"pid {s['pid']}", **s} for s in sessions),
                         *others],
        "autovacuum": vacuum,
        "tables": tables,
        "retention": {k: (v.isoformat() if hasattr(v, "isoformat") else v)
                      for k, v in (retention[0] if retention else {}).items()},
        "alerts": alerts,
    }


def render(health: dict[str, Any]) -> list[str]:
    """The health lines of `status`' text view: warnings first, then the big tables."""
    out = [f"WARNING: {w}" for w in health["warnings"]]
    sizes = [f"{name} {row['bytes'] / 1e6:.1f} MB ({row['dead'] or 0} dead)"
             for name, row in list(health["tables"].items())[:5]]
    out.append("tables: " + ", ".join(sizes))
    retention = health["retention"]
    if retention.get("last_purge_at"):
        out.append(f"last purge: {retention['last_purge_at']} ({retention['last_purged']} runs)")
    return out
