"""A worker's statements about given runs read `runs` through its primary key only, whatever
statistics the worker's generic plans were made with: never a sequential scan, and never a
partial index of running runs (runs_lease, runs_running_tenant), which keeps an entry for every
run that ran since the last vacuum (see "How a worker's statement says running" in
runpool/queries.sql). Found in W1's drain, 2 x 10: outcome batches ANDed a bitmap of runs_lease
and read 1,500-20,000 entries each (up to 7.6 ms, auto_explain on a private cluster); and in
W11cpu, where every checkpoint write read all 500 running runs' entries of
runs_running_tenant. The worker's PL/pgSQL calls are held to the same: their statements'
plans are not shown by EXPLAIN, so the test counts the scans of each index of `runs` they made
(pg_stat_user_indexes), in a session planning generically as a worker's does."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Final

import psycopg
import pytest
from psycopg.types.json import Jsonb

import runpool
from checkpoints.store import HOLDS, message_write
from runpool.claiming import ClaimedRun, claim
from runpool.codec import dumps
from runpool.costs import RECORD_USAGE, USAGE_WRITTEN
from runpool.db import WORKER_SESSION, aconnect
from runpool.outcomes import Outcome, finish_params
from runpool.queries import QUERIES
from runpool.trips import prepared_sql


def _scans(plan: dict[str, Any]) -> Iterator[tuple[str, str | None]]:
    """(node type, index) of every node of the plan that reads runpool.runs."""
    if plan.get("Relation Name") == "runs" and plan["Node Type"] != "ModifyTable":
        if plan["Node Type"] == "Bitmap Heap Scan":
            yield from _bitmaps(plan)
        else:
            yield plan["Node Type"], plan.get("Index Name")
    for child in plan.get("Plans", []):
        yield from _scans(child)


def _bitmaps(plan: dict[str, Any]) -> Iterator[tuple[str, str | None]]:
    """The indexes a bitmap heap scan reads (under its BitmapAnd or BitmapOr, if any)."""
    for child in plan.get("Plans", []):
        if child["Node Type"] == "Bitmap Index Scan":
            yield "Bitmap Index Scan", child["Index Name"]
        else:
            yield from _bitmaps(child)


def _statements(running: list[ClaimedRun], worker: uuid.UUID) -> dict[str, tuple[str, Any]]:
    """The worker's statements about these running runs, with their parameters."""
    ids, attempts = [r.id for r in running], [r.attempt for r in running]
    one = running[0]
    usage = {"run_id": one.id, "attempt": one.attempt, "input_tokens": 1, "output_tokens": 1,
             "cost": 0, "tool_calls": 0, "turns": 1}
    message = message_write(one.id, one.attempt, "user", Jsonb({"text": "hi"}),
                            encoded=dumps({"text": "hi"}))
    assert message.batch is not None
    return {
        "finish_runs": (QUERIES["finish_runs"], finish_params(
            [Outcome(r.id, r.attempt, "succeeded", result=b"{}") for r in running])),
        "heartbeat": (QUERIES["heartbeat"], {"ids": ids, "attempts": attempts,
                                             "lease_seconds": 60, "worker_id": worker}),
        "read_cancel_flags": (QUERIES["read_cancel_flags"], {"ids": ids,
                                                             "attempts": attempts}),
        "release_runs": (QUERIES["release_runs"], {"ids": ids, "attempts": attempts,
                                                   "worker_id": worker}),
        "renew_busy": (QUERIES["renew_busy"], {"id": one.id, "attempt": one.attempt,
                                               "lease_seconds": 60}),
        "holds": (HOLDS, {"run_id": one.id, "attempt": one.attempt}),
        "record_usage": (RECORD_USAGE, {**usage, "write": 1}),
        "usage_written": (USAGE_WRITTEN, {**usage, "write": 1}),
        "message": (message.query, message.params),
        "batch_message": (message.batch, message.batch_params([message.row])),
    }


# The worker's PL/pgSQL calls about these runs, with their parameters. (_wait: the check every
# resumed run makes of a wait answered in an earlier attempt, the row of which is inserted.)
CALLS: dict[str, str] = {
    "publish_progress": "SELECT runpool.publish_progress(%(ids)s, %(attempts)s, %(payloads)s)",
    "wait_answered": "SELECT * FROM runpool._wait(%(id)s, %(attempt)s, 1, 'signal', 'go',"
                     " NULL, NULL)",
}
ANSWERED: Final = """
INSERT INTO runpool.waits (run_id, seq, kind, name, attempt, state, payload, resolved_at)
VALUES (%(id)s, 1, 'signal', 'go', %(attempt)s, 'signalled', '{}', now())
"""
# How many times each index of runs (and, as NULL, the table itself) has been scanned, as the
# statistics this backend flushed last hold them: pg_stat_force_next_flush makes the statement
# before this one flush its counts once it ends.
SCANS: Final = """
SELECT pg_stat_clear_snapshot(), NULL::name, seq_scan FROM pg_stat_user_tables
WHERE relid = 'runpool.runs'::regclass
UNION ALL
SELECT NULL, indexrelname, idx_scan FROM pg_stat_user_indexes
WHERE relid = 'runpool.runs'::regclass
"""


async def _scans_made(conn: psycopg.AsyncConnection[Any], call: str,
                      params: dict[str, Any]) -> set[tuple[str, str | None]]:
    """What a call read of runs, made in a transaction rolled back: (scan, index) per index
    (or the table) that it scanned."""
    async def counts() -> dict[str | None, int]:
        await conn.execute("SELECT pg_stat_force_next_flush()")
        cur = await conn.execute(SCANS)
        return {name: n for _, name, n in await cur.fetchall()}
    before = await counts()
    async with conn.transaction(force_rollback=True):
        await conn.execute(call, params)
    after = await counts()
    return {("Seq Scan" if name is None else "Index Scan", name)
            for name, n in after.items() if n > before[name]}


async def _explained(conn: psycopg.AsyncConnection[Any], running: list[ClaimedRun],
                     worker: uuid.UUID, grow: Callable[[], None] | None = None
                     ) -> dict[str, dict[str, Any]]:
    """Each statement's generic plan, as a worker's session prepares it (runpool.trips),
    executed (EXPLAIN ANALYZE) in a transaction rolled back. `grow`: called after each
    statement ran once (its generic plan made then, on the table as it was, and kept), before
    it is explained."""
    literal = psycopg.AsyncClientCursor(conn)
    executes = {}
    for name, (query, params) in _statements(running, worker).items():
        sql, names = prepared_sql(query)
        await conn.execute("PREPARE " + name + " AS " + sql)
        args = ", ".join(["%s"] * len(names))
        executes[name] = literal.mogrify(f"EXECUTE {name}({args})", [params[n] for n in names])
        if grow is not None:
            async with conn.transaction(force_rollback=True):
                await conn.execute(executes[name])
    if grow is not None:
        await asyncio.to_thread(grow)
    plans = {}
    for name, execute in executes.items():
        async with conn.transaction(force_rollback=True):
            cur = await conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + execute)
            row = await cur.fetchone()
        assert row is not None
        plans[name] = row[0][0]["Plan"]
        await conn.execute("DEALLOCATE " + name)
    return plans


async def _claimed(conn: psycopg.AsyncConnection[Any], n: int) -> tuple[list[ClaimedRun],
                                                                         uuid.UUID]:
    await conn.execute(WORKER_SESSION)
    worker = uuid.uuid4()
    running: list[ClaimedRun] = []
    while len(running) < n:
        more = await claim(conn, limit=min(n - len(running), 500), worker_id=worker,
                           lease_seconds=60, reap_expired=False, handlers=["noop"],
                           via="prepared")
        assert more, f"only {len(running)} of {n} runs to claim"
        running += more
    return running, worker


async def _plans(dsn: str, grow: Callable[[], None] | None = None
                 ) -> dict[str, set[tuple[str, str | None]]]:
    """What each statement read of runs: the scans of its plan, or of a PL/pgSQL call its
    index scans counted."""
    async with await aconnect(dsn, autocommit=True) as conn:
        running, worker = await _claimed(conn, 10)
        plans = {name: set(_scans(plan))
                 for name, plan in (await _explained(conn, running, worker, grow)).items()}
        one = running[0]
        await conn.execute(ANSWERED, {"id": one.id, "attempt": one.attempt})
        params = {"ids": [r.id for r in running], "attempts": [r.attempt for r in running],
                  "payloads": [Jsonb({"step": 1}) for _ in running],
                  "id": one.id, "attempt": one.attempt}
        for name, call in CALLS.items():
            plans[name] = await _scans_made(conn, call, params)
        return plans


# (A table of a few dozen rows is read whole: its plan is made again once autovacuum's
# ANALYZE sees it grow, which invalidates the session's prepared statements.)
@pytest.mark.parametrize("stats", ["bulk_queued", "none", "planned_small"])
def test_a_worker_reads_given_runs_through_the_primary_key_only(
        conn: psycopg.Connection[Any], dsn: str, stats: str) -> None:
    conn.execute("ALTER TABLE runpool.runs SET (autovacuum_enabled = off)")

    def grow() -> None:
        runpool.enqueue_many(conn, [runpool.RunSpec("acme", "noop") for _ in range(12_000)])

    if stats == "planned_small":
        # A worker started on an empty queue: its plans made on a table of a few runs, kept
        # as it grows (no ANALYZE comes to change them).
        runpool.enqueue_many(conn, [runpool.RunSpec("acme", "noop") for _ in range(10)])
        plans = asyncio.run(_plans(dsn, grow))
    else:
        grow()
        if stats == "bulk_queued":
            # Statistics from when every run was queued, as autovacuum's first pass over a
            # bulk load leaves them: `running` looks empty, so its partial indexes look free
            # to scan.
            conn.execute("ANALYZE runpool.runs")
        plans = asyncio.run(_plans(dsn))
    wrong = {name: scans for name, scans in plans.items()
             if not scans or {index for _, index in scans} != {"runs_pkey"}}
    assert not wrong, wrong


def _work(plan: dict[str, Any]) -> int:
    """The rows a plan's nodes produced and threw away, over all their loops."""
    loops = int(plan.get("Actual Loops", 1))
    rows = int(plan.get("Actual Rows", 0)) + sum(
        int(plan.get(key, 0)) for key in ("Rows Removed by Filter", "Rows Removed by Join Filter",
                                     "Rows Removed by Index Recheck"))
    return rows * loops + sum(_work(child) for child in plan.get("Plans", []))


def test_a_worker_statement_about_many_runs_does_work_linear_in_them(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    """A generic plan cannot tell how many runs a statement is given, and takes them for a
    few: joined to each other as a nested loop, two lists of a worker's 1,000 runs compared
    every pair. The heartbeat did (~500,000 rows thrown away, ~100 ms a beat with every run's
    row locked, every checkpoint write to them waiting: W11's tool call p99)."""
    n = 1000
    runpool.enqueue_many(conn, [runpool.RunSpec("acme", "noop") for _ in range(3 * n)])

    async def explained() -> dict[str, dict[str, Any]]:
        async with await aconnect(dsn, autocommit=True) as c:
            running, worker = await _claimed(c, n)
            return await _explained(c, running, worker)

    work = {name: _work(plan) for name, plan in asyncio.run(explained()).items()}
    assert work["heartbeat"] >= n  # it did renew them
    assert not {name: rows for name, rows in work.items() if rows > 40 * n}, work
