"""Bulk enqueue, runpool against pgqueuer, split into client CPU, backend CPU and WAL per job.

    .venv-pgqueuer/bin/python docs/enqueue_cpu.py HOST PORT RUNPOOL_DB PGQUEUER_DB [ROUNDS]

RUNPOOL_DB must be migrated (`python -m runpool migrate`), PGQUEUER_DB gets pgqueuer's schema.
Each round enqueues 20,000 jobs in 20 calls of 1,000, one transaction each, as the peer
harness's adapters do (runpool: one `enqueue_many` jsonb through psycopg; pgqueuer:
`Queries.enqueue` through asyncpg), first runpool then pgqueuer, and empties both queues after.
Wall time moves with the machine's load; the CPU of the client and of its backend much less.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import time
from typing import Any

import asyncpg
import psycopg
from pgqueuer import AsyncpgDriver, Queries
from psycopg.types.json import Jsonb

HOST, PORT, RUNPOOL_DB, PGQ_DB = sys.argv[1:5]
JOBS, CHUNK = 20_000, 1_000
ENQUEUE_MANY = "SELECT count(*) FROM runpool.enqueue_many(%s::jsonb)"
WAL = "SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn"


def _backend_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _wal(db: str) -> float:
    with psycopg.connect(host=HOST, port=PORT, dbname=db, autocommit=True) as conn:
        row = conn.execute(WAL).fetchone()
        assert row is not None
        return float(row[0])


async def _runpool() -> tuple[float, float, float, float]:
    conn = await psycopg.AsyncConnection.connect(host=HOST, port=PORT, dbname=RUNPOOL_DB)
    pid, wal = conn.info.backend_pid, _wal(RUNPOOL_DB)
    backend, own, began = _backend_cpu(pid), _own_cpu(), time.perf_counter()
    for i in range(0, JOBS, CHUNK):
        runs = [{"tenant": "0", "handler": "bench", "input": {"s": i + j}} for j in range(CHUNK)]
        await conn.execute(ENQUEUE_MANY, [Jsonb(runs)])
        await conn.commit()
    wall, own, backend = time.perf_counter() - began, _own_cpu() - own, _backend_cpu(pid) - backend
    wal = _wal(RUNPOOL_DB) - wal
    await conn.execute("TRUNCATE runpool.runs, runpool.run_events CASCADE")
    await conn.commit()
    await conn.close()
    return wall, own, backend, wal


async def _pgqueuer() -> tuple[float, float, float, float]:
    conn = await asyncpg.connect(host=HOST, port=int(PORT), database=PGQ_DB)
    pid, queries, wal = conn.get_server_pid(), Queries(AsyncpgDriver(conn)), _wal(PGQ_DB)
    backend, own, began = _backend_cpu(pid), _own_cpu(), time.perf_counter()
    for i in range(0, JOBS, CHUNK):
        payloads = [json.dumps({"s": i + j}).encode() for j in range(CHUNK)]
        await queries.enqueue(["bench"] * CHUNK, payloads, [0] * CHUNK)
    wall, own, backend = time.perf_counter() - began, _own_cpu() - own, _backend_cpu(pid) - backend
    wal = _wal(PGQ_DB) - wal
    await conn.execute("TRUNCATE pgqueuer")
    await conn.close()
    return wall, own, backend, wal


async def main() -> None:
    conn = await asyncpg.connect(host=HOST, port=int(PORT), database=PGQ_DB)
    try:
        await Queries(AsyncpgDriver(conn)).install()
    except asyncpg.DuplicateObjectError:
        pass  # installed by an earlier run
    await conn.close()
    for _ in range(int(sys.argv[5]) if len(sys.argv) > 5 else 3):
        for name, run in (("runpool", _runpool), ("pgqueuer", _pgqueuer)):
            wall, own, backend, wal = await run()
            row: dict[str, Any] = {
                "system": name, "jobs_per_s": round(JOBS / wall),
                "client_cpu_us": round(own * 1e6 / JOBS, 1),
                "backend_cpu_us": round(backend * 1e6 / JOBS, 1), "wal_bytes": round(wal / JOBS)}
            print(json.dumps(row), flush=True)


asyncio.run(main())
