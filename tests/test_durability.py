"""Issue 22: a finished tool's result is never thrown away, whatever the database does
around the commit (closed idle sessions, repeatable read by default, reused call ids, ...)."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from typing import Any

import psycopg
from psycopg import sql

import runpool
from runpool.db import aconnect, connect
from runpool.pools import open_pool
from tests.helpers import (
    assert_invariants,
    live_workers,
    run_row,
    running_pool,
    scalar,
    wait_for,
)

APP = "tests.durability_apps:app"


def _done(conn: psycopg.Connection, run_id: uuid.UUID) -> bool:
    return run_row(conn, run_id)["status"] in ("succeeded", "failed", "cancelled")


def _executions(conn: psycopg.Connection, run_id: uuid.UUID) -> dict[str, int]:
    return dict(conn.execute("SELECT call_id, count(*) FROM tool_log WHERE run_id = %s"
                             " GROUP BY call_id", (run_id,)).fetchall())


def _alter_database(conn: psycopg.Connection, setting: str, value: str) -> None:
    """A database-level default, as an operator sets it (applies to new sessions)."""
    conn.execute(sql.SQL("ALTER DATABASE {} SET {} = {}").format(
        sql.Identifier(conn.info.dbname), sql.Identifier(setting), sql.Literal(value)))


# The workers' idle pooled connections (the heartbeat's too), as a reaper sees them.
IDLE_POOLED = """
SELECT pid FROM pg_stat_activity WHERE datname = current_database()
  AND application_name LIKE 'runpool-%%' AND application_name NOT LIKE 'runpool-listen@%%'
  AND state = 'idle'
"""


def _tools_started(conn: psycopg.Connection, n: int) -> bool:
    return bool(scalar(conn, "SELECT count(*) FROM tool_log") >= n)


def test_idle_connections_closed__a_finished_tool_result_survives(
        conn: psycopg.Connection, dsn: str) -> None:
    safe = runpool.enqueue(conn, "acme", "slow_tools", {"steps": 2, "tool_seconds": 4})
    unsafe = runpool.enqueue(conn, "acme", "slow_tools",
                             {"steps": 2, "tool_seconds": 4, "unsafe": True})
    # Nothing else touches the pool during a tool (no poll, no heartbeat), as in production
    # where a quiet pool's idle connections are the ones a restart or a reaper closes.
    closed = 0
    with running_pool(dsn, app=APP, lease_seconds=30, poll_seconds=30, pool_size=4):
        for started in range(1, 5):
            wait_for(functools.partial(_tools_started, conn, started), timeout=30,
                     what=f"tool {started} started")
            # Every idle pooled connection is closed under the running tools.
            closed += sum(scalar(conn, "SELECT pg_terminate_backend(%s)", pid)
                          for (pid,) in conn.execute(IDLE_POOLED).fetchall())
        wait_for(lambda: _done(conn, safe) and _done(conn, unsafe), timeout=60, what="runs")
        # (Found closed at their checkout, pools._still_open, and replaced, or met by a write
        # that then went again on another connection: the results survive either way.)
    assert closed > 0
    for run_id in (safe, unsafe):
        row = run_row(conn, run_id)
        # Each result was committed on another connection, in the first attempt, each tool
        # run once.
        assert (row["status"], row["attempt"]) == ("succeeded", 1), row["error"]
        assert _executions(conn, run_id) == {"c0": 1, "c1": 1}
    assert_invariants(conn)


def test_idle_session_timeout__a_quiet_pool_keeps_claiming(conn: psycopg.Connection,
                                                         dsn: str) -> None:
    # A quiet pool (polling, no LISTEN) on a database whose operator reaps idle sessions: the
    # pooled connections all go idle together. They must still be there, not closed by the
    # server (every checkout would then fail its check, back off and time out the claim).
    _alter_database(conn, "idle_session_timeout", "2s")
    with running_pool(dsn, listen=0, poll_seconds=1) as pool:
        wait_for(lambda: live_workers(conn), what="worker up")
        # Quiet for three times the server's timeout: this is the scenario, not a wait.
        time.sleep(6)
        runs = [runpool.enqueue(conn, "acme", "noop") for _ in range(3)]
        wait_for(lambda: all(run_row(conn, r)["status"] == "succeeded" for r in runs),
                 timeout=5, what="runs started by a quiet pool")
        assert "action=claim_failed" not in pool.log()
    assert_invariants(conn)


def test_repeatable_read_default__every_runpool_connection_reads_committed(
        conn: psycopg.Connection, dsn: str) -> None:
    _alter_database(conn, "default_transaction_isolation", "repeatable read")
    isolation = "SELECT current_setting('transaction_isolation')"

    async def pooled() -> list[str]:
        pool = await open_pool(dsn, size=2, name="test")
        try:
            async with pool.connection() as c, pool.connection() as d:
                return [str((await (await x.execute(isolation)).fetchone() or [""])[0])
                        for x in (c, d)]
        finally:
            await pool.close()

    async def direct() -> str:
        async with await aconnect(dsn) as c:
            return str((await (await c.execute(isolation)).fetchone() or [""])[0])

    with psycopg.connect(dsn) as plain:  # not runpool's: the database default applies
        assert scalar(plain, isolation) == "repeatable read"
    assert asyncio.run(pooled()) == ["read committed"] * 2
    assert asyncio.run(direct()) == "read committed"
    with connect(dsn) as c:
        assert scalar(c, isolation) == "read committed"


def test_repeatable_read_default__checkpoints_under_heartbeats_run_each_tool_once(
        conn: psycopg.Connection, dsn: str) -> None:
    _alter_database(conn, "default_transaction_isolation", "repeatable read")
    runs = [runpool.enqueue(conn, "acme", "slow_tools", {"steps": 40, "tool_seconds": 0.01})
            for _ in range(4)]
    with running_pool(dsn, app=APP, heartbeat_seconds=0.05, lease_seconds=5):
        wait_for(lambda: all(_done(conn, r) for r in runs), timeout=90, what="runs")
    for run_id in runs:
        assert run_row(conn, run_id)["status"] == "succeeded"
        assert set(_executions(conn, run_id).values()) == {1}
    assert_invariants(conn)


def test_reused_call_id__another_tool_is_refused_never_answered_with_the_first_result(
        conn: psycopg.Connection, dsn: str) -> None:
    same = runpool.enqueue(conn, "acme", "reuse_call_id")
    across = runpool.enqueue(conn, "acme", "reuse_call_id", {"crash": True})
    # One run at a time: a run's crash must not take another's attempt with it.
    with running_pool(dsn, app=APP, lease_seconds=1.5, concurrency=1):
        wait_for(lambda: _done(conn, same) and _done(conn, across), timeout=30, what="runs")
    result = run_row(conn, same)["result"]
    assert result["ran"] == ["search"]
    assert result["second"].startswith("InvalidInput: tool call id 'call_0'")
    # Attempt 1 started `search` and died in it; attempt 2 may not take the call over with
    # another tool: the row still names the tool that ran, and delete_file never ran.
    row = run_row(conn, across)
    assert (row["status"], row["attempt"]) == ("succeeded", 2)
    assert row["result"]["ran"] == [] and "call_0" in row["result"]["second"]
    assert conn.execute("SELECT name, status FROM runpool.tool_calls WHERE run_id = %s",
                        (across,)).fetchall() == [("search", "started")]


def test_same_call_id_awaited_twice_at_once__runs_once_both_get_the_result(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "same_call_twice")
    with running_pool(dsn, app=APP):
        wait_for(lambda: _done(conn, run_id), what="run")
    assert run_row(conn, run_id)["result"] == [{"done": True}, {"done": True}]
    assert _executions(conn, run_id) == {"c0": 1}
    assert scalar(conn, "SELECT executions FROM runpool.tool_calls WHERE run_id = %s",
                  run_id) == 1


def test_tool_values__the_committed_json_value_in_every_attempt(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "json_values", {"crash": True})
    with running_pool(dsn, app=APP, lease_seconds=1.5):
        wait_for(lambda: _done(conn, run_id), timeout=30, what="run")
    row = run_row(conn, run_id)
    assert (row["status"], row["attempt"]) == ("succeeded", 2)
    expected: dict[str, Any] = {"tuple": ["list", [1, 2]],
                                "datetime": ["str", "2026-01-02T03:04:05+00:00"],
                                "nan": ["NoneType", None], "messages": ["list", "str", "NoneType"]}
    first = scalar(conn, "SELECT content FROM runpool.messages WHERE run_id = %s"
                   " AND role = 'user'", run_id)
    assert first == {"seen": expected}  # what attempt 1 saw
    assert row["result"] == expected  # what attempt 2 saw after resuming


# -- the outcome writer: one refused outcome never drops its batch or kills the writer -------

REFUSE = """
CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'refused by an operator''s trigger' USING ERRCODE = NEW.result->>'sqlstate';
END $$;
CREATE TRIGGER refuse_poison BEFORE UPDATE ON runpool.runs FOR EACH ROW
WHEN (jsonb_typeof(NEW.result) = 'object' AND NEW.result ? 'poison')
EXECUTE FUNCTION refuse_poison();
"""


def _running(conn: psycopg.Connection, n: int) -> list[uuid.UUID]:
    ids = [runpool.enqueue(conn, "acme", "noop") for _ in range(n)]
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1,"
                 " lease_expires_at = now() + interval '1 minute' WHERE id = ANY(%s)", (ids,))
    return ids


def test_outcome_writer__a_refused_outcome_fails_its_run_and_its_batch_is_recorded(
        conn: psycopg.Connection, dsn: str) -> None:
    from runpool.outcomes import OutcomeWriter, from_result

    conn.execute(REFUSE)
    ids = _running(conn, 10)
    # 54000 (a value over a limit) looks transient to a client that goes by the exception
    # class (psycopg's OperationalError); 23514 (a check) does not.
    poisoned = {ids[3]: "54000", ids[7]: "23514"}

    async def main() -> tuple[list[str | None], bool]:
        pool = await open_pool(dsn, size=2, name="test")
        try:
            writer = OutcomeWriter(pool, worker_id=uuid.uuid4())
            results = [{"poison": True, "sqlstate": poisoned[i]} if i in poisoned else {"ok": 1}
                       for i in ids]
            submitted = [asyncio.create_task(writer.submit(from_result(i, 1, r, max_bytes=1 << 20)))
                         for i, r in zip(ids, results, strict=True)]
            await asyncio.sleep(0)  # all queued: they go as one batch
            writing = asyncio.create_task(writer.run())
            statuses = await asyncio.wait_for(asyncio.gather(*submitted), 60)
            alive = not writing.done()
            writing.cancel()
            return statuses, alive
        finally:
            await pool.close()

    statuses, alive = asyncio.run(main())
    assert alive
    assert statuses == ["failed" if i in poisoned else "succeeded" for i in ids]
    for run_id, sqlstate in poisoned.items():
        row = run_row(conn, run_id)
        assert (row["status"], row["error"]["reason"]) == ("failed", "outcome_rejected")
        assert row["error"]["sqlstate"] == sqlstate
    assert {run_row(conn, i)["result"]["ok"] for i in ids if i not in poisoned} == {1}


def test_outcome_writer__a_refused_outcome_never_kills_the_worker(
        conn: psycopg.Connection, dsn: str) -> None:
    conn.execute(REFUSE)
    poison = runpool.enqueue(conn, "acme", "poison_result", {"sqlstate": "23514"},
                             max_attempts=3)
    healthy = [runpool.enqueue(conn, "acme", "noop") for _ in range(6)]
    with running_pool(dsn, app=APP, lease_seconds=2) as pool:
        wait_for(lambda: all(_done(conn, r) for r in [poison, *healthy]), timeout=30,
                 what="runs")
        assert "side_task_failed" not in pool.log()
    row = run_row(conn, poison)
    assert (row["status"], row["attempt"], row["error"]["reason"]) == (
        "failed", 1, "outcome_rejected")
    assert all(run_row(conn, r)["status"] == "succeeded" for r in healthy)


# -- resolve_tool_call: an operator's way past a call a dead-lettered run cannot pass --------

def test_resolve_tool_call__rescues_an_unknown_outcome_and_a_stored_error(
        conn: psycopg.Connection, dsn: str) -> None:
    sent = runpool.enqueue(conn, "acme", "slow_tools", {"steps": 2, "unsafe": True,
                                                        "crash_in": 1}, max_attempts=2)
    again = runpool.enqueue(conn, "acme", "slow_tools", {"steps": 2, "unsafe": True,
                                                         "crash_in": 1}, max_attempts=2)
    stored = runpool.enqueue(conn, "acme", "tool_error", max_attempts=2)
    # One run at a time: a run's crash must not take another's attempt with it.
    with running_pool(dsn, app=APP, lease_seconds=1.5, concurrency=1):
        wait_for(lambda: all(_done(conn, r) for r in (sent, again, stored)), timeout=60,
                 what="dead-lettered runs")
        for run_id, reason in ((sent, "tool_outcome_unknown"), (again, "tool_outcome_unknown"),
                               (stored, "exception")):
            row = run_row(conn, run_id)
            assert (row["status"], (row["error"] or {}).get("reason")) == ("failed", reason), row
        # retry_run alone meets the same unknown call again.
        assert scalar(conn, "SELECT runpool.retry_run(%s)", sent) == "queued"
        wait_for(lambda: _done(conn, sent), what="retried run")
        assert run_row(conn, sent)["error"]["reason"] == "tool_outcome_unknown"
        # "It was sent": the run goes on with the operator's result, the tool does not rerun.
        assert runpool.resolve_tool_call(conn, sent, "c1", result={"found": "by hand"}) == (
            "succeeded")
        # "Run it again" (the unknown call, and the call that stored a transient error).
        assert runpool.resolve_tool_call(conn, again, "c1", retry=True) == "retry"
        assert runpool.resolve_tool_call(conn, stored, "c0", retry=True) == "retry"
        for run_id in (sent, again, stored):
            assert scalar(conn, "SELECT runpool.retry_run(%s)", run_id) == "queued"
        wait_for(lambda: all(_done(conn, r) for r in (sent, again, stored)), timeout=30,
                 what="rescued runs")
    assert run_row(conn, sent)["result"]["results"] == [{"i": 0}, {"found": "by hand"}]
    assert _executions(conn, sent) == {"c0": 1, "c1": 1}
    assert run_row(conn, again)["result"]["results"] == [{"i": 0}, {"i": 1}]
    assert _executions(conn, again) == {"c0": 1, "c1": 2}
    assert run_row(conn, stored)["result"] == {"fetched": True}
    for run_id in (sent, again, stored):
        assert run_row(conn, run_id)["status"] == "succeeded"
        # One tool message per call, saying what the handler got.
        calls = conn.execute("SELECT call_id, count(*) FROM runpool.messages WHERE run_id = %s"
                             " AND role = 'tool' GROUP BY call_id", (run_id,)).fetchall()
        assert {n for _, n in calls} == {1}


def test_resolve_tool_call__refuses_a_running_run_and_hides_other_tenants(
        conn: psycopg.Connection) -> None:
    import pytest

    run_id = runpool.enqueue(conn, "acme", "noop")
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1,"
                 " lease_expires_at = now() + interval '1 minute' WHERE id = %s", (run_id,))
    conn.execute("INSERT INTO runpool.tool_calls (run_id, call_id, name, arguments, status,"
                 " attempt) VALUES (%s, 'c0', 't', '{}', 'started', 1)", (run_id,))
    with pytest.raises(runpool.InvalidInput, match="is running"):
        runpool.resolve_tool_call(conn, run_id, "c0", retry=True)
    with pytest.raises(runpool.InvalidInput, match="either"):
        runpool.resolve_tool_call(conn, run_id, "c0")
    with pytest.raises(runpool.InvalidInput, match="either"):
        runpool.resolve_tool_call(conn, run_id, "c0", result=1, retry=True)
    conn.execute("UPDATE runpool.runs SET status = 'failed', finished_at = now(),"
                 " lease_expires_at = NULL WHERE id = %s", (run_id,))
    assert runpool.resolve_tool_call(conn, run_id, "c0", retry=True, tenant="other") is None
    assert runpool.resolve_tool_call(conn, run_id, "c9", retry=True) is None
    assert runpool.resolve_tool_call(conn, uuid.uuid4(), "c0", retry=True) is None
    # The SQL function refuses "neither" too, and a caller without the grant.
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        conn.execute("SELECT runpool.resolve_tool_call(%s, 'c0')", (run_id,))
    assert scalar(conn, "SELECT has_function_privilege('public',"
                  " 'runpool.resolve_tool_call(uuid, text, jsonb, boolean, text)', 'EXECUTE')"
                  ) is False
    assert runpool.resolve_tool_call(conn, run_id, "c0", result=None) == "succeeded"
    assert conn.execute("SELECT status, result FROM runpool.tool_calls").fetchall() == [
        ("succeeded", None)]


def test_resolve_tool_call__cli(conn: psycopg.Connection, dsn: str) -> None:
    import subprocess
    import sys

    from tests.helpers import ROOT, pool_env

    run_id = runpool.enqueue(conn, "acme", "noop")
    conn.execute("UPDATE runpool.runs SET status = 'failed', attempt = 1,"
                 " finished_at = now() WHERE id = %s",
                 (run_id,))
    conn.execute("INSERT INTO runpool.tool_calls (run_id, call_id, name, arguments, status,"
                 " attempt, result, finished_at) VALUES (%s, 'c0', 't', '{}', 'unknown', 1,"
                 " '{\"outcome\": \"unknown\"}', now())", (run_id,))
    out = subprocess.run([sys.executable, "-m", "runpool", "resolve", str(run_id), "c0",
                          "--result", '{"sent": true}', "--dsn", dsn],
                         env=pool_env(dsn), cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "succeeded"), out.stderr
    assert scalar(conn, "SELECT result FROM runpool.tool_calls WHERE run_id = %s",
                  run_id) == {"sent": True}
    assert scalar(conn, "SELECT content FROM runpool.messages WHERE run_id = %s AND"
                  " call_id = 'c0'", run_id) == {"sent": True}


# -- a cancellation never aborts the commit of a finished tool's result ------------------------

SLOW_COMMIT = """
CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_sleep(2);
    RETURN NEW;
END $$;
CREATE TRIGGER slow_commit BEFORE UPDATE ON runpool.tool_calls FOR EACH ROW
WHEN (jsonb_typeof(NEW.result) = 'object' AND NEW.result ? 'slow_commit')
EXECUTE FUNCTION slow_commit();
"""


def test_drain_ending_during_the_result_commit__the_result_is_committed_first(
        conn: psycopg.Connection, dsn: str) -> None:
    import signal

    conn.execute(SLOW_COMMIT)
    run_id = runpool.enqueue(conn, "acme", "slow_commit")
    # The cancel API cannot reach a run mid-commit (the commit's fence holds the run row);
    # a drain whose grace ends then, or the lease watchdog, can.
    with running_pool(dsn, app=APP, grace_seconds=0.3) as pool:
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM pg_stat_activity"
                                " WHERE datname = current_database()"
                                " AND wait_event = 'PgSleep'"), what="the commit in flight")
        pool.send_signal(signal.SIGTERM)
        pool.wait(timeout=30)
    # The tool ran once and its result is committed with its message: the next attempt
    # returns it instead of running the tool again.
    assert conn.execute("SELECT status, result, executions FROM runpool.tool_calls"
                        " WHERE run_id = %s", (run_id,)).fetchall() == [
        ("succeeded", {"slow_commit": True}, 1)]
    assert scalar(conn, "SELECT count(*) FROM runpool.messages WHERE run_id = %s"
                  " AND call_id = 'c0'", run_id) == 1
    assert _executions(conn, run_id) == {"c0": 1}


def test_lease_lost_handler_swallowing_its_cancellation__its_slot_is_freed(
        conn: psycopg.Connection, dsn: str) -> None:
    stubborn = runpool.enqueue(conn, "acme", "stubborn")
    with running_pool(dsn, concurrency=1, lease_seconds=1.5, cancel_grace_seconds=0.5) as pool:
        wait_for(lambda: run_row(conn, stubborn)["status"] == "running", what="claimed")
        # The run is taken away (an operator, a reaper): the heartbeat finds its lease gone.
        conn.execute("UPDATE runpool.runs SET status = 'failed', finished_at = now(),"
                     " lease_expires_at = NULL WHERE id = %s", (stubborn,))
        wait_for(lambda: "action=lease_lost" in pool.log(), what="lease loss noticed")
        # The handler swallows its CancelledError and sleeps on: the worker's only slot must
        # not stay taken by it.
        after = runpool.enqueue(conn, "acme", "noop")
        wait_for(lambda: _done(conn, after), what="the next run in the freed slot")
    assert run_row(conn, after)["status"] == "succeeded"
