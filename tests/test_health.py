"""`status`' health part: the pinned-xmin warning, table sizes, the purge and the alert outbox."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import psycopg

import runpool
from runpool import health
from runpool.db import connect
from tests.helpers import ROOT, pool_env, scalar, wait_for


def test_status__names_the_session_whose_snapshot_pins_xmin(
        conn: psycopg.Connection, dsn: str) -> None:
    runpool.enqueue(conn, "acme", "noop")
    assert _xmin(health.collect(conn, xmin_warn_seconds=0.2)) == []
    with connect(dsn) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM runpool.runs")  # the snapshot is taken
        pid = holder.info.backend_pid
        doc = wait_for(lambda: _xmin(health.collect(conn, xmin_warn_seconds=0.2)),
                       what="the warning")
        (warning,) = doc
        assert warning.startswith(f"xmin held by pid {pid} for ")
        assert warning.endswith(" s — vacuum cannot clean the queue")
        # The CLI says it too, first thing, and in its JSON document.
        env = pool_env(dsn)
        text = subprocess.run([sys.executable, "-m", "runpool", "status", "--xmin-warn", "0.2"],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert text.returncode == 0, text.stderr
        assert text.stdout.splitlines()[1].startswith("WARNING: ")
        assert f"WARNING: xmin held by pid {pid}" in text.stdout
        out = subprocess.run([sys.executable, "-m", "runpool", "status", "--json",
                              "--xmin-warn", "0.2"], env=env, cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        doc_json = json.loads(out.stdout)["health"]
        assert [h["pid"] for h in doc_json["xmin_holders"]] == [pid]
        holder.rollback()
    # Its transaction over, the warning is gone.
    assert _xmin(health.collect(conn, xmin_warn_seconds=0.2)) == []


def test_status__an_idle_session_without_a_transaction_pins_nothing(
        conn: psycopg.Connection, dsn: str) -> None:
    with connect(dsn, autocommit=True) as idle:
        idle.execute("SELECT 1")
        assert health.collect(conn, xmin_warn_seconds=0)["xmin_holders"] == []


def test_status__sizes_purge_and_outbox(conn: psycopg.Connection) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    conn.execute("UPDATE runpool.runs SET status = 'failed', finished_at = now(),"
                 " error = '{\"reason\": \"x\"}' WHERE id = %s", (run_id,))
    conn.execute("UPDATE runpool.alerts SET tries = 1, last_error = 'HTTP 503'")
    scalar(conn, "SELECT runpool._purge_turn('1 day', 10, '1 minute')")
    doc = health.collect(conn)
    assert doc["tables"]["runs"]["bytes"] > 0
    assert doc["retention"]["last_purged"] == 0 and doc["retention"]["last_purge_at"]
    assert doc["alerts"]["pending"] == 1
    assert "1 dead-letter alerts not delivered (last error: HTTP 503)" in doc["warnings"]
    lines = health.render(doc)
    assert lines[len(doc["warnings"])].startswith("tables: ")
    assert all(line.startswith("WARNING: ") for line in lines[:len(doc["warnings"])])


def test_status__warns_when_nothing_vacuums_the_queue(conn: psycopg.Connection) -> None:
    server_on = scalar(conn, "SHOW autovacuum") == "on"
    doc = health.collect(conn)
    assert doc["autovacuum"] == {"server": server_on, "tables_off": []}
    assert any(w.startswith("autovacuum is off on this server") for w in doc["warnings"]) \
        is not server_on
    conn.execute("ALTER TABLE runpool.messages SET (autovacuum_enabled = false)")
    warnings = health.collect(conn)["warnings"]
    assert "autovacuum is off for messages: their dead rows stay until someone runs VACUUM" \
        in warnings


def _xmin(doc: dict[str, Any]) -> list[str]:
    return [w for w in doc["warnings"] if w.startswith("xmin held")]
