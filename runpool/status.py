"""`python -m runpool status`: what the queue holds, by status and tenant."""

from __future__ import annotations

from typing import Any, Final

import psycopg

__all__ = ["collect", "render"]

# Runs by tenant and status (the terminal ones too: they are the history users ask about).
BY_TENANT: Final = """
SELECT tenant, status, count(*) FROM runpool.runs GROUP BY tenant, status ORDER BY tenant, status
"""
# Workers seen recently, i.e. alive unless they stopped cleanly.
WORKERS: Final = """
SELECT id, host, pid, concurrency, last_seen_at,
       (SELECT count(*) FROM runpool.runs r WHERE r.worker_id = w.id AND r.status = 'running')
FROM runpool.workers w
WHERE stopped_at IS NULL AND last_seen_at > now() - interval '2 minutes'
ORDER BY started_at
"""

STATUSES: Final = ("queued", "running", "succeeded", "failed", "cancelled")


def collect(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    totals = dict.fromkeys(STATUSES, 0)
    tenants: dict[str, dict[str, int]] = {}
    for tenant, status, count in conn.execute(BY_TENANT):
        totals[status] += count
        tenants.setdefault(tenant, dict.fromkeys(STATUSES, 0))[status] = count
    workers = [
        {"id": str(wid), "host": host, "pid": pid, "concurrency": conc,
         "last_seen_at": seen.isoformat(), "running": running}
        for wid, host, pid, conc, seen, running in conn.execute(WORKERS)
    ]
    return {"totals": totals, "tenants": tenants, "workers": workers}


def render(report: dict[str, Any]) -> str:
    lines = ["runs: " + "  ".join(f"{s} {report['totals'][s]}" for s in STATUSES)]
    if report["tenants"]:
        lines.append("")
        lines.append(f"{'tenant':<24}" + "".join(f"{s:>11}" for s in STATUSES))
        for tenant, counts in report["tenants"].items():
            lines.append(f"{tenant[:24]:<24}" + "".join(f"{counts[s]:>11}" for s in STATUSES))
    lines.append("")
    lines.append(f"live workers: {len(report['workers'])}")
    for w in report["workers"]:
        lines.append(f"  {w['id']}  {w['host']}:{w['pid']}  running {w['running']}"
                     f"/{w['concurrency']}")
    return "\n".join(lines)
