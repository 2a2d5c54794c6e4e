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


def test_status_json__one_document(conn: psycopg.Connection, dsn: str) -> None:
    for tenant in ("acme", "acme", "globex"):
        runpool.enqueue(conn, tenant, "noop")
    out = cli(dsn, "status", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["totals"]["queued"] == 3
    assert report["tenants"]["acme"]["queued"] == 2
    text = cli(dsn, "status").stdout
    assert "acme" in text and "globex" in text


def test_bad_settings__refused_before_anything_starts(dsn: str) -> None:
    out = subprocess.run([sys.executable, "-m", "runpool", "--app", "tests.apps:app"],
                         env=pool_env(dsn, lease_seconds="-1"), cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "lease_seconds must be > 0" in out.stderr
    out = subprocess.run([sys.executable, "-m", "runpool", "--app", "no.such.module:app"],
                         env=pool_env(dsn), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "cannot import app module" in out.stderr
