"""Status events of the worker's own statements (0017): claim, finish, reap and release number
the status change and store it in their run_events row; 0009's trigger numbers every other
change (and those of pools of the code before 0017). Followers see both, in one order."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import aclosing
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

import runpool
from runpool.claiming import claim
from runpool.db import aconnect, connect
from runpool.enqueue import enqueue
from runpool.live import channel
from runpool.queries import QUERIES

from .helpers import finish_params, running_pool, scalar

# A status change as the statements of the code before 0017 made it: event_seq untouched.
OLD_CLAIM = ("UPDATE runpool.runs SET status = 'running', attempt = attempt + 1,"
             " worker_id = %s, lease_expires_at = now() + interval '1 minute' WHERE id = %s")
STATUS_ROWS = sql.SQL("SELECT seq, status, reason FROM {} WHERE run_id = %s AND seq IS NOT NULL"
                      " ORDER BY seq")


def _follow(dsn: str, run_id: uuid.UUID, after: int = 0) -> list[tuple[int, str, str | None]]:
    """A follower's status events, to the end (bounded: a follower waiting for a seq that
    never comes fails the test instead of hanging it)."""

    async def main() -> list[tuple[int, str, str | None]]:
        async with await aconnect(dsn, autocommit=True) as aconn:
            async with aclosing(runpool.follow(aconn, run_id, after, poll=0.2)) as stream:
                return [(e.seq, e.data["status"], e.data.get("reason"))
                        async for e in stream if e.kind == "status"]

    return asyncio.run(asyncio.wait_for(main(), 20))


def _rows(conn: psycopg.Connection[Any], table: str, run_id: uuid.UUID) -> list[Any]:
    return list(conn.execute(STATUS_ROWS.format(sql.Identifier("runpool", table)), (run_id,)))


def _finish(conn: psycopg.Connection[Any], run_id: uuid.UUID, attempt: int, outcome: str,
            error: Any = None) -> list[Any]:
    params = finish_params([(run_id, attempt)])
    params["outcomes"], params["errors"] = [outcome], [None if error is None else Jsonb(error)]
    return list(conn.execute(QUERIES["finish_runs"], params))


def test_a_pool_stores_its_status_changes_in_run_events_and_rings_at_the_end(dsn: str) -> None:
    with connect(dsn, autocommit=True) as conn, connect(dsn, autocommit=True) as ear, \
            running_pool(dsn):
        quick = enqueue(conn, "acme", "noop")
        slow = enqueue(conn, "acme", "sleep", {"seconds": 1})
        ear.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel(slow))))
        assert runpool.wait(conn, slow, timeout=15).status == "succeeded"
        assert runpool.wait(conn, quick, timeout=15).status == "succeeded"
        # Its end rang the run's doorbell (its claim does not: the only notification).
        assert [n.channel for n in ear.notifies(timeout=10, stop_after=1)] == [
            channel(slow)]
        for run_id in (quick, slow):
            assert _rows(conn, "status_events", run_id) == []
            assert _rows(conn, "run_events", run_id) == [
                (2, "running", None), (3, "succeeded", None)]
            assert scalar(conn, "SELECT event_seq FROM runpool.runs WHERE id = %s", run_id) == 3
            assert _follow(dsn, run_id) == [
                (1, "queued", None), (2, "running", None), (3, "succeeded", None)]


def test_old_and_new_statements_number_one_run_in_one_order(dsn: str) -> None:
    """A rolling deploy: a pool of the code before 0017 claims (the trigger numbers it), one
    of this code finishes; a checkpoint write between them takes its seq from the counter."""
    worker = uuid.uuid4()
    with connect(dsn, autocommit=True) as conn:
        run_id = enqueue(conn, "acme", "noop", max_attempts=3)
        conn.execute(OLD_CLAIM, (worker, run_id))
        assert _finish(conn, run_id, 1, "retry", {"reason": "boom", "message": "x"}) == [
            (run_id, 1, "queued")]
        conn.execute(OLD_CLAIM, (worker, run_id))
        # A checkpoint's seq (the run's counter row from now on).
        assert scalar(conn, "SELECT runpool._next_event_seq(%s)", run_id) == 5
        # Fenced out (an older attempt, and a run not running): no seq is taken.
        assert _finish(conn, run_id, 1, "succeeded") == []
        assert scalar(conn, "SELECT seq FROM runpool.event_seqs WHERE run_id = %s", run_id) == 5
        assert _finish(conn, run_id, 2, "failed", {"reason": "bad", "message": "y"}) == [
            (run_id, 2, "failed")]
        assert _finish(conn, run_id, 2, "succeeded") == []
        assert _rows(conn, "status_events", run_id) == [(2, "running", None), (4, "running", None)]
        assert _rows(conn, "run_events", run_id) == [(3, "queued", "boom"), (6, "failed", "bad")]
        assert scalar(conn, "SELECT seq FROM runpool.event_seqs WHERE run_id = %s", run_id) == 6
        assert scalar(conn, "SELECT event_seq FROM runpool.runs WHERE id = %s", run_id) == 6
    assert _follow(dsn, run_id) == [
        (1, "queued", None), (2, "running", None), (3, "queued", "boom"), (4, "running", None),
        (6, "failed", "bad")]
    assert _follow(dsn, run_id, after=3) == [(4, "running", None), (6, "failed", "bad")]


def test_claim_reap_and_release_number_from_the_counter_of_a_checkpointed_run(dsn: str) -> None:
    worker = uuid.uuid4()

    async def claim_one() -> int:
        async with await aconnect(dsn, autocommit=True) as aconn:
            [got] = await claim(aconn, limit=1, worker_id=worker, lease_seconds=30)
            return got.attempt

    with connect(dsn, autocommit=True) as conn:
        run_id = enqueue(conn, "acme", "noop", max_attempts=5)
        assert asyncio.run(claim_one()) == 1
        assert scalar(conn, "SELECT runpool._next_event_seq(%s)", run_id) == 3
        # The lease runs out: the reaper queues the run again.
        conn.execute("UPDATE runpool.runs SET lease_expires_at = now() - interval '1 s'"
                     " WHERE id = %s", (run_id,))
        assert scalar(conn, QUERIES["reap_expired"]) == 1
        assert asyncio.run(claim_one()) == 2
        # A draining worker gives it back (a wrong attempt first: nothing, no seq).
        release = QUERIES["release_runs"]
        assert scalar(conn, release, {"ids": [run_id], "attempts": [1], "worker_id": worker}) == 0
        assert scalar(conn, release, {"ids": [run_id], "attempts": [2], "worker_id": worker}) == 1
        conn.execute("SELECT runpool.cancel_run(%s)", (run_id,))
        assert _rows(conn, "run_events", run_id) == [
            (2, "running", None), (4, "queued", "lease_expired"), (5, "running", None),
            (6, "queued", "released")]
        # cancel_run is not the worker's: the trigger numbers it, from the counter.
        assert _rows(conn, "status_events", run_id) == [(7, "cancelled", None)]
        assert scalar(conn, "SELECT seq FROM runpool.event_seqs WHERE run_id = %s", run_id) == 7
    assert [s for s, _, _ in _follow(dsn, run_id)] == [1, 2, 4, 5, 6, 7]
