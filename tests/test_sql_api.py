from __future__ import annotations

import uuid

import psycopg
import pytest
from psycopg import sql

import runpool
from tests.helpers import events, run_row, status_of

CANCEL = "SELECT runpool.cancel_run(%s, %s, %s)"


def _claim_one(conn: psycopg.Connection, lease: float = 30) -> None:
    # Make the run 'running' as a worker's claim would.
    conn.execute(
        "UPDATE runpool.runs SET status = 'running', attempt = attempt + 1,"
        " lease_expires_at = now() + %s * interval '1 second'", (lease,))


def test_cancel_queued__cancelled_at_once(conn: psycopg.Connection) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    assert conn.execute(CANCEL, (run_id, "user pressed stop", None)).fetchone() == ("cancelled",)
    row = run_row(conn, run_id)
    assert (row["status"], row["cancel_reason"]) == ("cancelled", "user pressed stop")
    assert row["finished_at"] is not None
    # Repeating it is idempotent and says what is true.
    assert conn.execute(CANCEL, (run_id, "again", None)).fetchone() == ("cancelled",)
    assert events(conn, run_id) == ["enqueued", "cancelled"]


def test_cancel_running__flags_and_notifies_with_the_id_only(conn: psycopg.Connection,
                                                           dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    _claim_one(conn)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN runpool_cancel")
        assert conn.execute(CANCEL, (run_id, "stop", None)).fetchone() == ("cancelling",)
        assert conn.execute(CANCEL, (run_id, "stop again", None)).fetchone() == ("cancelling",)
        notes = list(listener.notifies(timeout=2, stop_after=2))
    assert [n.payload for n in notes] == [str(run_id), str(run_id)]
    row = run_row(conn, run_id)
    assert (row["status"], row["cancel_reason"]) == ("running", "stop")
    assert events(conn, run_id).count("cancel_requested") == 1


def test_cancel_finished__unchanged_status_returned(conn: psycopg.Connection) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    conn.execute("UPDATE runpool.runs SET status = 'succeeded', finished_at = now()")
    assert conn.execute(CANCEL, (run_id, None, None)).fetchone() == ("succeeded",)
    assert status_of(conn, run_id) == "succeeded"


def test_cancel_unknown_or_other_tenant__null_alike(conn: psycopg.Connection) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    assert conn.execute(CANCEL, (uuid.uuid4(), None, None)).fetchone() == (None,)
    assert conn.execute(CANCEL, (run_id, None, "evil")).fetchone() == (None,)
    assert status_of(conn, run_id) == "queued"
    assert conn.execute(CANCEL, (run_id, None, "acme")).fetchone() == ("cancelled",)


def test_cancel_bad_input__clear_errors(conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.errors.InvalidTextRepresentation, match="uuid"):
        conn.execute("SELECT runpool.cancel_run('not-a-uuid')")
    run_id = runpool.enqueue(conn, "acme", "noop")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="reason is longer"):
        conn.execute(CANCEL, (run_id, "r" * 2001, None))
    assert status_of(conn, run_id) == "queued"


def test_cancel_reason_injection__stored_as_data(conn: psycopg.Connection) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    reason = "x'); DROP TABLE runpool.runs; --"
    assert conn.execute(CANCEL, (run_id, reason, "acme'; --")).fetchone() == (None,)
    assert conn.execute(CANCEL, (run_id, reason, None)).fetchone() == ("cancelled",)
    row = conn.execute("SELECT cancel_reason FROM runpool.runs WHERE id = %s",
                       (run_id,)).fetchone()
    assert row == (reason,)


def test_retry_run__revives_failed_with_a_fresh_budget(conn: psycopg.Connection) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop", max_attempts=2)
    conn.execute("UPDATE runpool.runs SET status = 'failed', attempt = 2, finished_at = now(),"
                 " error = '{\"reason\": \"exception\"}'")
    assert conn.execute("SELECT runpool.retry_run(%s)", (run_id,)).fetchone() == ("queued",)
    row = run_row(conn, run_id)
    assert (row["status"], row["attempt"], row["attempt_offset"]) == ("queued", 2, 2)
    assert row["finished_at"] is None
    assert conn.execute("SELECT runpool.retry_run(%s)", (run_id,)).fetchone() == ("queued",)
    assert conn.execute("SELECT runpool.retry_run(%s)", (uuid.uuid4(),)).fetchone() == (None,)
    assert events(conn, run_id)[-1] == "retried"


def test_set_tenant_quota__validates(conn: psycopg.Connection) -> None:
    conn.execute("SELECT runpool.set_tenant_quota('acme', 3)")
    assert conn.execute("SELECT max_running FROM runpool.tenants").fetchone() == (3,)
    conn.execute("SELECT runpool.set_tenant_quota('acme', NULL)")
    assert conn.execute("SELECT max_running FROM runpool.tenants").fetchone() == (None,)
    for bad in (-1, 1_000_001):
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="max_running must be"):
            conn.execute("SELECT runpool.set_tenant_quota('acme', %s)", (bad,))
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="tenant must be"):
        conn.execute("SELECT runpool.set_tenant_quota('', 1)")


def test_schema_constraints__reject_impossible_rows(conn: psycopg.Connection) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    for change in ("status = 'bogus'", "priority = 1000", "attempt = -1",
                   "status = 'running'",  # a running run must hold a lease
                   "status = 'succeeded'"):  # a terminal run must have finished_at
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(sql.SQL("UPDATE runpool.runs SET {} WHERE id = %s").format(
                sql.SQL(change)), (run_id,))
