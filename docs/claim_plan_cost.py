"""One claim's cost as a worker plans it (generic plan), against a runs table of TOTAL runs of
which QUEUED are queued (the rest succeeded), for the runpool tree at SRC.

    python docs/claim_plan_cost.py SRC TOTAL QUEUED [DSN]

Creates a scratch database on DSN's server (postgresql://postgres@127.0.0.1:5432/postgres by
default), migrates it with SRC's migrations, fills it, VACUUM ANALYZEs runs, then prepares
lock_tenants and claim_runs under plan_cache_mode=force_generic_plan (as db.WORKER_SESSION
does) and runs EXPLAIN (ANALYZE, BUFFERS) of each seven times, rolled back. Prints one JSON
line: the median buffers and milliseconds, and whether the plan read runs sequentially.
Buffers do not depend on the machine's load; milliseconds do.
"""

import json
import statistics
import sys
import uuid

src, total, queued = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
server = sys.argv[4] if len(sys.argv) > 4 else "postgresql://postgres@127.0.0.1:5432/postgres"
sys.path.insert(0, src)

import psycopg  # noqa: E402
from psycopg.conninfo import make_conninfo  # noqa: E402

from runpool.migrate import migrate  # noqa: E402
from runpool.queries import QUERIES  # noqa: E402

# (`limited`: the claim since a4dc9f3; a tree without it simply does not use it.)
TYPES = {"handlers": "text[]", "limit": "integer", "tenants": "text[]", "limited": "text[]",
         "worker_id": "uuid", "lease_seconds": "float8", "roomy": "boolean"}
ARGS = {"handlers": "'{h}'", "limit": "10", "tenants": "'{t0,t1}'", "limited": "'{}'",
        "worker_id": "gen_random_uuid()", "lease_seconds": "30", "roomy": "true"}
FILL = """SELECT count(*) FROM runpool.enqueue_many((SELECT jsonb_agg(jsonb_build_object(
    'tenant', 't' || i %% 3, 'handler', 'h')) FROM generate_series(%s::int, %s::int) i))"""
FINISH = """UPDATE runpool.runs SET status = 'succeeded', attempt = 1, started_at = now(),
    finished_at = now() WHERE id IN (SELECT id FROM runpool.runs ORDER BY created_at LIMIT %s)"""


def nodes(plan):
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


name = f"claim_plan_cost_{uuid.uuid4().hex[:8]}"
with psycopg.connect(server, autocommit=True) as admin:
    admin.execute(f"CREATE DATABASE {name}")
try:
    dsn = make_conninfo(server, dbname=name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        for low in range(0, total, 50000):
            conn.execute(FILL, (low, min(low + 50000, total) - 1))
        conn.execute(FINISH, (total - queued,))
        conn.execute("VACUUM ANALYZE runpool.runs")
    report = {"total": total, "queued": queued}
    with psycopg.connect(dsn) as conn:
        for statement in ("lock_tenants", "claim_runs"):
            query = QUERIES[statement]
            used = sorted((n for n in TYPES if f"%({n})s" in query),
                          key=lambda n: query.index(f"%({n})s"))
            for i, n in enumerate(used, 1):
                query = query.replace(f"%({n})s", f"${i}")
            buffers, ms, seq = [], [], False
            for _ in range(7):
                conn.execute("SET plan_cache_mode = force_generic_plan")
                conn.execute("SET jit = off")
                conn.execute(f"PREPARE s ({', '.join(TYPES[n] for n in used)}) AS {query}")
                plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE s ("
                                    + ", ".join(ARGS[n] for n in used) + ")").fetchone()[0][0]
                top = plan["Plan"]
                buffers.append(top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0))
                ms.append(plan["Execution Time"])
                seq = seq or any(n["Node Type"] == "Seq Scan" and n.get("Relation Name") == "runs"
                                 for n in nodes(top))
                conn.rollback()
                conn.execute("DEALLOCATE ALL")
            report[statement] = {"buffers": statistics.median(buffers),
                                 "ms": round(statistics.median(ms), 2), "seq_scan_runs": seq}
    print(json.dumps(report))
finally:
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
