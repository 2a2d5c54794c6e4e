"""Server CPU of the worker's claim and finish statements, per run, in one session.

    PYTHONPATH=<runpool tree> python docs/claim_cpu.py SERVER_DSN [RUNS]

A scratch database gets RUNS (5,000) no-op runs of one tenant; then one connection set up as a
worker's (its session settings: generic plans) claims 10 and finishes them, in turn, until the
queue is empty, as a busy worker does (no reap in the claim). Prints the backend's CPU per run
(user + system, /proc), which the load of other processes on the machine disturbs far less than
wall time; alternate two trees (main against a branch) and repeat.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid

from psycopg.types.json import Jsonb

from runpool.claiming import claim
from runpool.db import WORKER_SESSION, aconnect, connect
from runpool.enqueue import RunSpec, enqueue_many
from runpool.harness.measure import cpu_seconds
from runpool.queries import QUERIES
from runpool.testing.databases import scratch_database


async def _drain(dsn: str) -> tuple[int, float]:
    async with await aconnect(dsn, autocommit=True) as conn:
        await conn.execute(WORKER_SESSION)
        worker = uuid.uuid4()
        await conn.execute(QUERIES["register_worker"], {
            "worker_id": worker, "host": "claim_cpu", "pid": 0, "concurrency": 10,
            "handlers": ["noop"]})
        backend = [conn.info.backend_pid]
        began, done = cpu_seconds(backend), 0
        while got := await claim(conn, limit=10, worker_id=worker, lease_seconds=60,
                                 reap_expired=False, handlers=["noop"]):
            n = len(got)
            await conn.execute(QUERIES["finish_runs"], {
                "ids": [r.id for r in got], "attempts": [r.attempt for r in got],
                "outcomes": ["succeeded"] * n, "results": [Jsonb({"ok": 1})] * n,
                "errors": [None] * n, "delays": [0.0] * n})
            done += n
        return done, cpu_seconds(backend) - began


def main() -> None:
    server, runs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5000
    with scratch_database(server) as dsn:
        with connect(dsn) as conn:
            for chunk in range(0, runs, 2000):
                enqueue_many(conn, [RunSpec("t0", "noop")] * min(2000, runs - chunk))
            conn.commit()
        done, cpu = asyncio.run(_drain(dsn))
    print(json.dumps({"runs": done, "backend_cpu_us_per_run": round(cpu * 1e6 / done, 1)}))


if __name__ == "__main__":
    main()
