"""Retention: runpool.purge_finished and the pools' background purger."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import psycopg
import pytest

import runpool
from runpool.claiming import claim
from runpool.db import aconnect, connect
from tests.helpers import assert_invariants, run_row, running_pool, scalar, wait_for

TERMINAL = ("succeeded", "failed", "cancelled")


def _run_tables(conn: psycopg.Connection) -> list[str]:
    """Every table of runpool's schema that holds rows of runs (a run_id column): whatever a
    later migration adds is checked too."""
    return [t for (t,) in conn.execute("""
        SELECT c.table_name FROM information_schema.columns c
        JOIN information_schema.tables t USING (table_schema, table_name)
        WHERE c.table_schema = 'runpool' AND c.column_name = 'run_id'
          AND t.table_type = 'BASE TABLE' AND c.table_name <> 'alerts'
        ORDER BY 1""")]


def _rows_of(conn: psycopg.Connection, ids: list[uuid.UUID]) -> dict[str, int]:
    counts = {"runs": scalar(conn, "SELECT count(*) FROM runpool.runs WHERE id = ANY(%s)", ids)}
    for table in _run_tables(conn):
        counts[table] = scalar(conn, psycopg.sql.SQL(
            "SELECT count(*) FROM runpool.{} WHERE run_id = ANY(%s)").format(
                psycopg.sql.Identifier(table)), ids)
    return counts


def _age(conn: psycopg.Connection, ids: list[uuid.UUID], days: int = 8) -> None:
    conn.execute("UPDATE runpool.runs SET finished_at = now() - make_interval(days => %s)"
                 " WHERE id = ANY(%s)", (days, ids))


def _finished_runs(conn: psycopg.Connection, n: int, days: int = 8) -> list[uuid.UUID]:
    """n runs that ended `days` ago (written directly: what a pool leaves behind)."""
    ids = [r for (r,) in conn.execute(
        "SELECT runpool.enqueue('bulk', 'noop') FROM generate_series(1, %s)", (n,))]
    conn.execute("UPDATE runpool.runs SET status = 'succeeded', attempt = 1,"
                 " started_at = now() - make_interval(days => %s),"
                 " finished_at = now() - make_interval(days => %s) WHERE id = ANY(%s)",
                 (days, days, ids))
    return ids


def test_purge_finished__old_finished_runs_go_with_every_row_of_theirs(
        conn: psycopg.Connection, dsn: str) -> None:
    old = [runpool.enqueue(conn, "acme", "agent", {"steps": 2}),
           runpool.enqueue(conn, "acme", "fails")]
    recent = runpool.enqueue(conn, "acme", "agent", {"steps": 1})
    with running_pool(dsn):
        wait_for(lambda: all(run_row(conn, r)["status"] in TERMINAL for r in [*old, recent]),
                 what="runs done")
    cancelled = runpool.enqueue(conn, "acme", "noop")
    assert scalar(conn, "SELECT runpool.cancel_run(%s)", cancelled) == "cancelled"
    old.append(cancelled)
    # A queued run and a running one (its lease long expired), both created long ago.
    queued = runpool.enqueue(conn, "acme", "noop")
    running = runpool.enqueue(conn, "acme", "sleep")

    async def take() -> None:
        async with await aconnect(dsn, autocommit=True) as c:
            assert [r.id for r in await claim(c, worker_id=uuid.uuid4(), limit=5,
                                              lease_seconds=30, handlers=["sleep"])] == [running]
    asyncio.run(take())
    conn.execute("UPDATE runpool.runs SET created_at = now() - interval '30 days'"
                 " WHERE id = ANY(%s)", ([queued, running],))
    conn.execute("UPDATE runpool.runs SET lease_expires_at = now() - interval '9 days'"
                 " WHERE id = %s", (running,))
    conn.execute("INSERT INTO runpool.progress (run_id, attempt, data) VALUES (%s, 1, '{}')",
                 (old[0],))
    _age(conn, old)
    before = _rows_of(conn, old)
    assert before["messages"] and before["tool_calls"] and before["run_events"]
    assert before["status_events"] and before["progress"] == 1 and before["event_seqs"]
    kept = [recent, queued, running]
    kept_rows = _rows_of(conn, kept)

    assert scalar(conn, "SELECT runpool.purge_finished(interval '7 days')") == 3
    assert set(_rows_of(conn, old).values()) == {0}
    assert _rows_of(conn, kept) == kept_rows
    assert [run_row(conn, r)["status"] for r in kept] == ["succeeded", "queued", "running"]
    # Nothing left to do: a second purge removes nothing.
    assert scalar(conn, "SELECT runpool.purge_finished(interval '7 days', 1)") == 0
    assert_invariants(conn, all_terminal=False)


@pytest.mark.parametrize(("older_than", "batch_size", "field"), [
    ("-1 day", 10, "older_than"), (None, 10, "older_than"), ("1 day", 0, "batch_size"),
    ("1 day", 2_000_000, "batch_size"), ("1 day", None, "batch_size")])
def test_purge_finished__bad_arguments_are_refused_naming_them_and_delete_nothing(
        conn: psycopg.Connection, older_than: str | None, batch_size: int | None,
        field: str) -> None:
    ids = _finished_runs(conn, 3)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=field):
        conn.execute("SELECT runpool.purge_finished(%s::interval, %s)", (older_than, batch_size))
    assert scalar(conn, "SELECT count(*) FROM runpool.runs WHERE id = ANY(%s)", ids) == 3


def test_purge_finished__the_api_role_may_not_purge(conn: psycopg.Connection) -> None:
    _finished_runs(conn, 1)
    conn.execute("SET ROLE runpool_api")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute("SELECT runpool.purge_finished(interval '1 day')")
    conn.rollback()
    assert scalar(conn, "SELECT count(*) FROM runpool.runs") == 1


def test_purge_finished__concurrent_purgers_remove_each_run_once(
        conn: psycopg.Connection, dsn: str) -> None:
    ids = _finished_runs(conn, 2000)
    results: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def purger() -> None:
        try:
            with connect(dsn, autocommit=True) as c:
                start.wait()
                c.execute("SET statement_timeout = '20s'")
                results.append(c.execute(
                    "SELECT runpool.purge_finished(interval '1 day', 50)").fetchone()[0])  # type: ignore[index]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=purger) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and len(results) == 4
    assert sum(results) == len(ids)
    assert scalar(conn, "SELECT count(*) FROM runpool.runs") == 0


def test_purge__skips_a_run_a_session_holds_and_never_waits_for_it(
        conn: psycopg.Connection, dsn: str) -> None:
    held, free = _finished_runs(conn, 2)
    conn.execute("UPDATE runpool.runs SET status = 'failed', error = '{\"reason\": \"x\"}'"
                 " WHERE id = %s", (held,))
    with connect(dsn) as holder:
        # retry_run in an open transaction: the failed run's row is locked, and about to be
        # queued again.
        assert scalar(holder, "SELECT runpool.retry_run(%s)", held) == "queued"
        conn.execute("SET statement_timeout = '5s'")
        assert scalar(conn, "SELECT runpool.purge_finished(interval '1 day')") == 1
        holder.commit()
    assert run_row(conn, held)["status"] == "queued"
    assert scalar(conn, "SELECT count(*) FROM runpool.runs WHERE id = %s", free) == 0
    # Queued again, it is no longer finished: a later purge leaves it.
    assert scalar(conn, "SELECT runpool.purge_finished(interval '0')") == 0


def test_purge__a_follower_of_a_purged_run_gets_not_found(
        conn: psycopg.Connection, dsn: str) -> None:
    (run_id,) = _finished_runs(conn, 1)
    scalar(conn, "SELECT runpool.purge_finished(interval '1 day')")

    async def follow() -> list[Any]:
        async with await aconnect(dsn, autocommit=True) as c:
            return [e async for e in runpool.follow(c, run_id, poll=0.1)]
    with pytest.raises(runpool.NotFound):
        asyncio.run(asyncio.wait_for(follow(), 10))


def test_background_purge__pools_take_turns_through_the_backlog_then_purge_what_ages(
        conn: psycopg.Connection, dsn: str) -> None:
    old = _finished_runs(conn, 2500)
    # Two worker processes, both purgers, one second apart at most.
    with running_pool(dsn, workers=2, retention_seconds=1) as pool:
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM runpool.runs WHERE id = ANY(%s)",
                                old) == 0, timeout=30, what="the backlog purged")
        fresh = runpool.enqueue(conn, "acme", "noop")
        wait_for(lambda: run_row(conn, fresh)["status"] == "succeeded", what="a new run")
        # ... and a run that ended is purged once it is older than the retention.
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM runpool.runs WHERE id = %s",
                                fresh) == 0, timeout=20, what="the new run purged")
        log = pool.log()
    turn = conn.execute("SELECT last_at, next_at FROM runpool.maintenance"
                        " WHERE task = 'purge'").fetchone()
    assert turn is not None and turn[0] is not None
    assert "purged" in log
    assert "purge_failed" not in log
    # The pool's own worker rows outlived the one-second retention: a live worker is kept.
    assert scalar(conn, "SELECT count(*) FROM runpool.workers") == 2


def test_purge_turn__stopped_workers_go_after_an_hour_at_least(conn: psycopg.Connection) -> None:
    conn.execute("INSERT INTO runpool.workers (id, host, pid, concurrency, last_seen_at,"
                 " stopped_at) VALUES (gen_random_uuid(), 'h', 1, 1, now() - %s::interval, %s)",
                 ("2 hours", None))
    conn.execute("INSERT INTO runpool.workers (id, host, pid, concurrency, last_seen_at)"
                 " VALUES (gen_random_uuid(), 'h', 2, 1, now() - interval '10 minutes')")
    assert scalar(conn, "SELECT runpool._purge_turn('1 second', 100, '1 minute')") == 0
    assert [p for (p,) in conn.execute("SELECT pid FROM runpool.workers")] == [2]


def test_purge_turn__another_pools_turn_is_skipped_not_waited_for(
        conn: psycopg.Connection, dsn: str) -> None:
    _finished_runs(conn, 5)
    with connect(dsn) as other:
        other.execute("SELECT 1 FROM runpool.maintenance WHERE task = 'purge' FOR UPDATE")
        conn.execute("SET statement_timeout = '5s'")
        assert scalar(conn, "SELECT runpool._purge_turn('1 day', 100, '1 minute')") is None
    assert scalar(conn, "SELECT runpool._purge_turn('1 day', 100, '1 minute')") == 5
    # Not due again for a minute: the next pool to look does nothing.
    _finished_runs(conn, 1)
    assert scalar(conn, "SELECT runpool._purge_turn('1 day', 100, '1 minute')") is None


def test_purge__a_family_goes_once_all_of_it_has_ended(
        conn: psycopg.Connection, dsn: str) -> None:
    parent = runpool.enqueue(conn, "acme", "parent", {"children": 2})
    approval = runpool.enqueue(conn, "acme", "approval")
    with running_pool(dsn, app="tests.wait_apps:app"):
        wait_for(lambda: run_row(conn, approval)["status"] == "waiting", what="a wait")
        assert scalar(conn, "SELECT runpool.signal_run(%s, 'approval', '{\"approved\": true}')",
                      approval) == "delivered"
        wait_for(lambda: run_row(conn, parent)["status"] == "succeeded"
                 and run_row(conn, approval)["status"] == "succeeded", what="runs done")
    children = [c for (c,) in conn.execute(
        "SELECT id FROM runpool.runs WHERE parent_id = %s ORDER BY spawn_call_id", (parent,))]
    family = [parent, approval, *children]
    before = _rows_of(conn, family)
    assert before["waits"] and before["signals"] and len(children) == 2
    _age(conn, family)
    # A child not finished (say, spawned and not joined): its parent stays, and so does it.
    conn.execute("UPDATE runpool.runs SET status = 'queued', finished_at = NULL"
                 " WHERE id = %s", (children[1],))
    assert scalar(conn, "SELECT runpool.purge_finished(interval '7 days')") == 2
    assert scalar(conn, "SELECT array_agg(id ORDER BY id) FROM runpool.runs") == sorted(
        [parent, children[1]])
    # The parent waiting again (its finished child stays for its join), then everything ends.
    conn.execute("UPDATE runpool.runs SET status = 'succeeded', finished_at = now() - "
                 " interval '8 days' WHERE id = %s", (children[1],))
    conn.execute("UPDATE runpool.runs SET status = 'waiting', finished_at = NULL"
                 " WHERE id = %s", (parent,))
    assert scalar(conn, "SELECT runpool.purge_finished(interval '7 days')") == 0
    conn.execute("UPDATE runpool.runs SET status = 'succeeded', finished_at = now() - "
                 " interval '8 days' WHERE id = %s", (parent,))
    assert scalar(conn, "SELECT runpool.purge_finished(interval '7 days')") == 2
    assert set(_rows_of(conn, family).values()) == {0}
