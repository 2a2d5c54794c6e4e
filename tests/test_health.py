"""`status`' health part: the pinned-xmin warning, table sizes, the purge and the alert outbox."""

from __future__ import annotations

import json
import subprocess
import sys

import psycopg

import runpool
from runpool import health
from runpool.db import connect
from tests.helpers import ROOT, pool_env, scalar, wait_for


def test_status__names_the_session_whose_snapshot_pins_xmin(
        conn: psycopg.Connection, dsn: str) -> None:
    runpool.enqueue(conn, "acme", "noop")
    assert health.collect(conn, xmin_warn_seconds=0.2)["warnings"] == []
    with connect(dsn) as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM runpool.runs")  # the snapshot is taken
        pid = holder.info.backend_pid
        doc = wait_for(lambda: health.collect(conn, xmin_warn_seconds=0.2)["warnings"],
                       what="the warning")
        (warning,) = doc
        assert warning.startswith(f"xmin held by pid {pid} for ")
        assert warning.endswith(" s — vacuum cannot clean the queue")
        # The CLI says it too, first thing, and in its JSON document.
        env = pool_env(dsn)
        text = subprocess.run([sys.executable, "-m", "runpool", "status", "--xmin-warn", "0.2"],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert text.returncode == 0, text.stderr
        assert text.stdout.splitlines()[1].startswith(f"WARNING: xmin held by pid {pid}")
        out = subprocess.run([sys.executable, "-m", "runpool", "status", "--json",
                              "--xmin-warn", "0.2"], env=env, cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        doc_json = json.loads(out.stdout)["health"]
        assert [h["pid"] for h in doc_json["xmin_holders"]] == [pid]
        holder.rollback()
    # Its transaction over, the warning is gone.
    assert health.collect(conn, xmin_warn_seconds=0.2)["warnings"] == []


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
    assert doc["warnings"] == ["1 dead-letter alerts not delivered (last error: HTTP 503)"]
    lines = health.render(doc)
    assert lines[0].startswith("WARNING: 1 dead-letter") and lines[1].startswith("tables: ")
