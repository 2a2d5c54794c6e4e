from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

import runpool
from tests.helpers import scalar
from tests.test_cli import cli


def explain(conn: psycopg.Connection, run_id: uuid.UUID) -> Any:
    return scalar(conn, "SELECT runpool.explain_run(%s)", run_id)


def test_explain_queued__names_what_holds_it(conn: psycopg.Connection) -> None:
    conn.execute("SELECT runpool.set_tenant_quota('acme', 1)")
    first = runpool.enqueue(conn, "acme", "noop")
    waiting = runpool.enqueue(conn, "acme", "noop")
    doc = explain(conn, waiting)
    assert (doc["status"], doc["held_by"], doc["runs_ahead"]) == ("queued", [], 1)
    assert doc["summary"] == "waiting for a free slot; 1 runs ahead of it"
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1,"
                 " lease_expires_at = now() + interval '1 minute' WHERE id = %s", (first,))
    doc = explain(conn, waiting)
    assert doc["held_by"] == ["tenant acme at quota 1/1"]
    assert (doc["tenant_running"], doc["tenant_quota"]) == (1, 1)
    conn.execute("SELECT runpool.set_tenant_quota('acme', 0)")
    assert explain(conn, waiting)["summary"] == "tenant acme is paused (quota 0)"


def test_explain_scheduled__says_until_when(conn: psycopg.Connection) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    run_id = runpool.enqueue(conn, "acme", "noop", run_at=later)
    doc = explain(conn, run_id)
    assert doc["summary"].startswith("not available until ")


def test_explain_other_states(conn: psycopg.Connection) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1,"
                 " lease_expires_at = now() - interval '1 second'")
    assert explain(conn, run_id)["summary"] == "lease expired: the next claim reclaims it"
    conn.execute("UPDATE runpool.runs SET status = 'failed', lease_expires_at = NULL,"
                 " finished_at = now(), error = '{\"reason\": \"exception\"}'")
    doc = explain(conn, run_id)
    assert doc["summary"].startswith("failed (dead letter")
    assert doc["error"] == {"reason": "exception"}
    assert explain(conn, uuid.uuid4()) is None


def test_explain_cli(conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    out = cli(dsn, "explain", str(run_id))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("waiting for a free slot")
    assert cli(dsn, "explain", "nope").returncode == 2
    assert cli(dsn, "explain", str(uuid.uuid4())).returncode == 1
