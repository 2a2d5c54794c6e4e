from __future__ import annotations

import json
import subprocess
import sys
import uuid

import psycopg

import runpool
from tests.helpers import ROOT, pool_env, run_row


def cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runpool", *args], env=pool_env(dsn), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_enqueue_cancel_retry__round_trip(conn: psycopg.Connection, dsn: str) -> None:
    out = cli(dsn, "enqueue", "acme", "noop", "--input", '{"q": 1}', "--priority", "3")
    assert out.returncode == 0, out.stderr
    run_id = uuid.UUID(out.stdout.strip())
    assert (run_row(conn, run_id)["input"], run_row(conn, run_id)["priority"]) == ({"q": 1}, 3)
    out = cli(dsn, "cancel", str(run_id), "--reason", "changed my mind")
    assert (out.returncode, out.stdout.strip()) == (0, "cancelled")
    assert run_row(conn, run_id)["cancel_reason"] == "changed my mind"
    out = cli(dsn, "retry", str(run_id))
    assert (out.returncode, out.stdout.strip()) == (0, "queued")


def test_bad_ids_and_input__clear_errors_and_exit_codes(conn: psycopg.Connection,
                                                       dsn: str) -> None:
    for command in ("cancel", "retry"):
        out = cli(dsn, command, "not-a-uuid")
        assert out.returncode == 2 and "not a run id" in out.stderr, out.stderr
        out = cli(dsn, command, str(uuid.uuid4()))
        assert out.returncode == 1 and "no such run" in out.stderr, out.stderr
    out = cli(dsn, "enqueue", "acme", "noop", "--input", "{not json")
    assert out.returncode == 2 and "--input is not valid JSON" in out.stderr
    out = cli(dsn, "enqueue", "acme", "noop", "--priority", "500")
    assert out.returncode == 2 and "priority must be between -100 and 100" in out.stderr
    assert conn.execute("SELECT count(*) FROM runpool.runs").fetchone() == (0,)


def test_status_json__counts_stuck_failures_and_latency(conn: psycopg.Connection,
                                                        dsn: str) -> None:
    ids = {name: runpool.enqueue(conn, tenant, "noop") for name, tenant in (
        ("q1", "acme"), ("q2", "acme"), ("live", "acme"), ("stuck", "globex"),
        ("failed", "globex"), ("done", "globex"))}
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1, started_at = now(),"
                 " lease_expires_at = now() + interval '1 minute' WHERE id = %s", (ids["live"],))
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1, started_at = now(),"
                 " lease_expires_at = now() - interval '5 seconds' WHERE id = %s",
                 (ids["stuck"],))
    conn.execute("UPDATE runpool.runs SET status = 'failed', attempt = 3, started_at = now(),"
                 " finished_at = now(), error = '{\"reason\": \"exception\","
                 " \"message\": \"boom\"}' WHERE id = %s", (ids["failed"],))
    conn.execute("UPDATE runpool.runs SET status = 'succeeded', attempt = 1,"
                 " started_at = created_at + interval '2 seconds',"
                 " finished_at = created_at + interval '5 seconds' WHERE id = %s", (ids["done"],))
    out = cli(dsn, "status", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)  # exactly one JSON document
    assert report["tenants"] == {
        "acme": {"queued": 2, "running": 1, "succeeded": 0, "failed": 0, "cancelled": 0},
        "globex": {"queued": 0, "running": 1, "succeeded": 1, "failed": 1, "cancelled": 0}}
    assert report["stuck"] == 1
    in_flight = {r["id"]: r for r in report["in_flight"]}
    assert in_flight[str(ids["stuck"])]["lease_left_s"] < 0 < in_flight[str(ids["live"])][
        "lease_left_s"]
    assert [(f["id"], f["reason"], f["message"]) for f in report["failures"]] == [
        (str(ids["failed"]), "exception", "boom")]
    assert report["latency"]["finished_runs"] == 2
    text = cli(dsn, "status").stdout
    assert "stuck 1" in text and "python -m runpool retry RUN_ID" in text


def test_runs__shows_one_runs_history(conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    conn.execute("SELECT runpool.cancel_run(%s, 'changed my mind')", (run_id,))
    out = cli(dsn, "runs", str(run_id))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("cancelled")
    assert "enqueued" in out.stdout and "cancelled" in out.stdout
    doc = json.loads(cli(dsn, "runs", str(run_id), "--json").stdout)
    assert [e["kind"] for e in doc["events"]] == ["enqueued", "cancelled"]
    assert cli(dsn, "runs", str(uuid.uuid4())).returncode == 1


def test_bad_settings__refused_before_anything_starts(dsn: str) -> None:
    out = subprocess.run([sys.executable, "-m", "runpool", "--app", "tests.apps:app"],
                         env=pool_env(dsn, lease_seconds="-1"), cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "lease_seconds must be > 0" in out.stderr
    out = subprocess.run([sys.executable, "-m", "runpool", "--app", "no.such.module:app"],
                         env=pool_env(dsn), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "cannot import app module" in out.stderr


def test_commands_on_an_unmigrated_database__name_the_fix(empty_dsn: str) -> None:
    out = cli(empty_dsn, "enqueue", "acme", "noop")
    assert out.returncode == 1 and "python -m runpool migrate" in out.stderr, out.stderr
