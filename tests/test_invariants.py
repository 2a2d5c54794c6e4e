"""The invariant checker itself: each invariant, broken on purpose, is reported."""

from __future__ import annotations

import os
import time
import uuid

import psycopg
import pytest

import runpool
from runpool import faults
from runpool.testing import Watch, invariants, pools
from tests.helpers import wait_for

_HISTORY = [
    "UPDATE runpool.runs SET status = 'succeeded', attempt = 2, started_at = now(),"
    " finished_at = now() WHERE id = %(id)s",
    "INSERT INTO runpool.run_events (run_id, kind, attempt) VALUES (%(id)s, 'claimed', 1),"
    " (%(id)s, 'reclaimed', 1), (%(id)s, 'claimed', 2), (%(id)s, 'succeeded', 2)",
    "INSERT INTO runpool.messages (run_id, seq, role, content, attempt)"
    " VALUES (%(id)s, 1, 'assistant', '{}', 1), (%(id)s, 2, 'tool', '{}', 2)",
    "INSERT INTO runpool.tool_calls (run_id, call_id, name, arguments, status, attempt,"
    " finished_at) VALUES (%(id)s, 'c0', 'lookup', '{}', 'succeeded', 2, now())",
    # Executed by attempt 1 (interrupted before its commit), then by attempt 2, which committed.
    "INSERT INTO tool_log VALUES (%(id)s, 'c0', 1, 'k', now() - interval '2 seconds'),"
    " (%(id)s, 'c0', 2, 'k', now() - interval '1 second')",
]


def _finished_run(conn: psycopg.Connection, **changes: str) -> uuid.UUID:
    """A run that succeeded with attempt 2, having committed tool call c0 and two messages."""
    run_id = runpool.enqueue(conn, "acme", "noop")
    for statement in _HISTORY:
        conn.execute(statement, {"id": run_id})
    return run_id


def _violations(conn: psycopg.Connection, **options: object) -> list[str]:
    return list(invariants.check(conn, **options).violations)  # type: ignore[arg-type]


def test_a_clean_history__no_violation(conn: psycopg.Connection) -> None:
    _finished_run(conn)
    report = invariants.check(conn, cancel_bound=5)
    assert report.ok and report.statuses == {"succeeded": 1}


def test_each_broken_invariant__is_reported(conn: psycopg.Connection) -> None:
    run_id = _finished_run(conn)
    queued = runpool.enqueue(conn, "acme", "noop")
    assert [v for v in _violations(conn) if "did not end" in v] == [
        f"run {queued} did not end: still queued"]
    assert _violations(conn, all_terminal=False) == []

    conn.execute("INSERT INTO tool_log VALUES (%s, 'c0', 3, 'k')", (run_id,))
    assert any("tool call" in v and "executed 2 time(s)" in v
               for v in _violations(conn, all_terminal=False))
    conn.execute("DELETE FROM tool_log WHERE attempt = 3")
    # A zombie (attempt 1) starting the call again after attempt 2 had committed it.
    conn.execute("INSERT INTO tool_log VALUES (%s, 'c0', 1, 'k')", (run_id,))
    assert any("tool call" in v and "executed 2 time(s)" in v
               for v in _violations(conn, all_terminal=False))
    conn.execute("DELETE FROM tool_log WHERE at > now() - interval '1 second'")

    # A zombie's message: attempt 1 writing after attempt 2 did.
    conn.execute("INSERT INTO runpool.messages (run_id, seq, role, content, attempt)"
                 " VALUES (%s, 3, 'tool', '{}', 1)", (run_id,))
    assert any("fenced attempt 1" in v for v in _violations(conn, all_terminal=False))
    conn.execute("DELETE FROM runpool.messages WHERE seq = 3")

    conn.execute("INSERT INTO runpool.run_events (run_id, kind, attempt)"
                 " VALUES (%s, 'succeeded', 2)", (run_id,))
    assert any("2 terminal events" in v for v in _violations(conn, all_terminal=False))
    conn.execute("DELETE FROM runpool.run_events WHERE id = (SELECT max(id)"
                 " FROM runpool.run_events)")

    conn.execute("UPDATE runpool.runs SET status = 'cancelled', cancel_requested_at ="
                 " finished_at - interval '20 seconds' WHERE id = %s", (run_id,))
    conn.execute("UPDATE runpool.run_events SET kind = 'cancelled' WHERE run_id = %s"
                 " AND kind = 'succeeded'", (run_id,))
    assert any("took 20.0s to end after its cancel" in v
               for v in _violations(conn, all_terminal=False, cancel_bound=15))
    assert _violations(conn, all_terminal=False, cancel_bound=30) == []


def test_watch__sees_a_tenant_over_its_quota_and_a_key_with_two_leases(
        conn: psycopg.Connection, dsn: str) -> None:
    conn.execute("SELECT runpool.set_tenant_quota('acme', 1)")
    ids = [runpool.enqueue(conn, "acme", "noop", serial_key="k") for _ in range(2)]
    with Watch(dsn, interval=0.01) as watch:
        # Forced past the guards by hand: what a broken claim would do.
        conn.execute("UPDATE runpool.runs SET status = 'running', held = false, attempt = 1,"
                     " lease_expires_at = now() + interval '1 minute' WHERE id = ANY(%s)",
                     (ids,))
        wait_for(lambda: len(watch.violations) >= 2, what="both overshoots seen")
    assert sorted(watch.violations) == [
        "serial key acme/k had 2 heads for 2 unfinished runs",
        "serial key acme/k had 2 live leases",
        "tenant acme had 2 live leases, over its quota of 1"]


def test_watch__sees_a_stuck_serial_key_and_its_own_failure(
        conn: psycopg.Connection, dsn: str) -> None:
    ids = [runpool.enqueue(conn, "acme", "noop", serial_key="k") for _ in range(2)]
    # Forced past the triggers (a key that makes a run wait heals itself at commit).
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")
        conn.execute("UPDATE runpool.runs SET held = true WHERE id = %s", (ids[0],))
    with Watch(dsn, interval=0.01) as watch:
        wait_for(lambda: watch.violations, what="the stuck key seen")
    assert watch.violations == ["serial key acme/k had 0 heads for 2 unfinished runs"]
    with Watch(dsn.replace("dbname=", "dbname=no_such_db_"), interval=0.01) as broken:
        wait_for(lambda: broken.violations, what="the watch reporting its own failure")
    assert broken.violations[0].startswith("the watch stopped after 0 samples")


def test_fault_spec__malformed_ones_are_refused() -> None:
    assert faults.parse("claim.locked=sever@2, checkpoint.committed=kill") == {
        "claim.locked": faults.Fault("claim.locked", "sever", 2),
        "checkpoint.committed": faults.Fault("checkpoint.committed", "kill", 1)}
    for spec, why in (("nowhere=kill", "unknown fault point"),
                      ("claim.locked=explode", "unknown action"),
                      ("tool.returned=sever", "sever is not possible"),
                      ("claim.locked=kill@0", "must be >= 1"),
                      ("claim.locked=kill,claim.locked=stop", "armed twice")):
        with pytest.raises(runpool.InvalidInput, match=why):
            faults.parse(spec)


def test_a_finished_result_thrown_away__is_reported(conn: psycopg.Connection) -> None:
    """Attempt 1 executed c0 and ended alive (its handler raised: the commit failed) instead
    of by a crash: attempt 2 running the tool again is a thrown-away result."""
    run_id = _finished_run(conn)
    assert _violations(conn) == []  # attempt 1 was reclaimed: interrupted, a legitimate rerun
    conn.execute("UPDATE runpool.run_events SET kind = 'retry_scheduled'"
                 " WHERE run_id = %s AND kind = 'reclaimed'", (run_id,))
    assert _violations(conn) == [
        f"tool call {run_id}/c0 (succeeded by attempt 2) was executed by attempt 1, which ended"
        " alive without committing it (its result thrown away, the tool run again)"]


def test_wait_for__its_seconds_stretch_with_the_load_and_stay_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine loaded to 4 times its CPUs a 0.2 s wait lasts 0.8 s; at any load, at
    most LOAD_STRETCH_MAX times its timeout; idle, its timeout."""
    cpus = os.cpu_count() or 1
    for load, stretch in ((0.0, 1.0), (4.0 * cpus, 4.0), (1000.0 * cpus, pools.LOAD_STRETCH_MAX)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert pools.load_stretch() == stretch
        started = time.monotonic()
        with pytest.raises(AssertionError, match=r"timed out after 0\.2s"):
            pools.wait_for(lambda: False, timeout=0.2, interval=0.01)
        assert time.monotonic() - started >= 0.2 * stretch
