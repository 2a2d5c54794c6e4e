"""`python -m runpool bench`: the benchmarks, one JSON line per workload.

Each workload runs in a scratch database created on the configured server (or the embedded
one) and dropped afterwards. Nothing here asserts a time: the numbers are reported, and the
README records them with the machine they came from.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .app import App
from .context import Run
from .db import connect
from .embedded import resolve_dsn
from .migrate import migrate
from .settings import Settings

__all__ = ["app", "run_bench"]

app = App()


@app.handler("noop")
async def noop(run: Run) -> Any:
    return None


@app.handler("stamp")
async def stamp(run: Run) -> Any:
    """Returns when the handler started, for wake-up latency."""
    return time.time()


@app.handler("sleep")
async def sleep(run: Run) -> Any:
    await asyncio.sleep(float(run.input["seconds"]))
    return None


async def _noop_tool(arguments: Any, key: str) -> Any:
    return {"ok": arguments["i"]}


@app.handler("tool_loop")
async def tool_loop(run: Run) -> Any:
    """W7/W8: `calls` no-op tool calls. Returns each call's overhead (ms); with `crash`, the
    first attempt dies after its calls, and the second reports how long resume took."""
    calls = int(run.input["calls"])
    began = time.time()
    overheads = []
    for i in range(calls):
        t0 = time.perf_counter()
        await run.tool(f"c{i}", "noop", {"i": i}, _noop_tool)
        overheads.append((time.perf_counter() - t0) * 1000)
    if run.input.get("crash") and run.attempt == 1:
        os._exit(1)
    if run.attempt > 1:
        # Every call above was a checkpoint hit; this is the first new one.
        await run.tool("new", "noop", {"i": -1}, _noop_tool)
        return {"handler_started": began, "first_new_call": time.time()}
    return {"overheads_ms": overheads}


@app.handler("await_cancel")
async def await_cancel(run: Run) -> Any:
    """W9: waits to be cancelled and records when it saw the cancellation."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await run.add_message("system", {"seen": time.time()})
        raise
    return None


# Server-wide transaction counter of one database (read from another database, so the
# reading itself is not counted).
XACTS: Final = "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s"
CLEAR_SNAPSHOT: Final = "SELECT pg_stat_clear_snapshot()"
# Drain rate measured by the database's own clock, from first claim to last finish.
DRAIN_RATE: Final = """
SELECT count(*) / greatest(extract(epoch FROM max(finished_at) - min(started_at)), 1e-6)
FROM runpool.runs WHERE status = 'succeeded'
"""
COUNT_DONE: Final = "SELECT count(*) FROM runpool.runs WHERE status = 'succeeded'"
LIVE_WORKERS: Final = "SELECT count(*) FROM runpool.workers WHERE stopped_at IS NULL"


@contextmanager
def scratch_database(server_dsn: str) -> Iterator[str]:
    name = f"runpool_bench_{uuid.uuid4().hex[:10]}"
    create = psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name))
    drop = psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
        psycopg.sql.Identifier(name))
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(create)
    params = conninfo_to_dict(server_dsn)
    params["dbname"] = name
    dsn = make_conninfo(**params)  # type: ignore[arg-type]
    try:
        with connect(dsn, autocommit=True) as conn:
            migrate(conn)
        yield dsn
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(drop)


def wait_until(conn: psycopg.Connection[Any], query: Any, target: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        row = conn.execute(query).fetchone()
        if row and row[0] >= target:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"benchmark did not reach {target} within {timeout}s")
        time.sleep(0.05)


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _median(results: list[dict[str, Any]]) -> dict[str, Any]:
    merged = dict(results[0])
    for key, value in merged.items():
        if isinstance(value, float):
            merged[key] = round(statistics.median(r[key] for r in results), 3)
    if len(results) > 1:
        merged["repeats"] = len(results)
    return merged


def run_bench(settings: Settings, workloads: list[str] | None, *, repeat: int = 1) -> int:
    server = resolve_dsn(settings)
    from .workloads import WORKLOADS

    names = workloads or list(WORKLOADS)
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}")
    for name in names:
        results = [WORKLOADS[name](server) for _ in range(max(repeat, 1))]
        print(json.dumps(_median(results)), flush=True)
    return 0
