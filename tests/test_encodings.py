"""Text encodings: runpool's JSON is UTF-8 bytes, so every connection that carries it must be
UTF-8 too, and the database must hold any Unicode text."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

import runpool
from runpool.migrate import migrate
from runpool.testing import scratch_database
from tests.helpers import assert_invariants, running_pool, scalar, wait_for

# Latin-1, beyond it, and beyond the Basic Multilingual Plane.
TEXT = "café € 🙂 ü"


def _done(conn: psycopg.Connection, run_id: Any) -> bool:
    return bool(scalar(conn, "SELECT status FROM runpool.runs WHERE id = %s", run_id)
                == "succeeded")


def test_pool_under_a_latin1_client_encoding__stores_every_character_exactly(
        conn: psycopg.Connection, dsn: str) -> None:
    # PGCLIENTENCODING in a worker host's environment made the server read runpool's UTF-8
    # JSON as Latin-1: "café" was stored as "cafÃ©", and "€" could not be stored at all.
    ids = [runpool.enqueue(conn, "acme", "agent", {"steps": 2, "extra": {"t": TEXT, "i": i}})
           for i in range(6)]
    with running_pool(dsn, concurrency=6, env={"PGCLIENTENCODING": "LATIN1"}):
        wait_for(lambda: all(_done(conn, r) for r in ids), what="runs")
    results = conn.execute("SELECT c.result FROM runpool.tool_calls c WHERE c.run_id = ANY(%s)",
                           (ids,)).fetchall()
    assert len(results) == 12
    assert all(r["t"] == TEXT for (r,) in results), results
    tools = conn.execute("SELECT content FROM runpool.messages WHERE run_id = ANY(%s)"
                         " AND role = 'tool'", (ids,)).fetchall()
    assert len(tools) == 12 and all(c["t"] == TEXT for (c,) in tools)
    assert_invariants(conn)


def test_caller_connection_in_latin1__each_call_refused_naming_the_encoding(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    with psycopg.connect(dsn, autocommit=True, client_encoding="LATIN1") as latin:
        calls: dict[str, Any] = {
            "enqueue": lambda: runpool.enqueue(latin, "acme", "noop", {"t": TEXT}),
            "enqueue_many": lambda: runpool.enqueue_many(
                latin, [runpool.RunSpec("acme", "noop", {"t": TEXT})]),
            "signal_run": lambda: runpool.signal_run(latin, run_id, "go", {"t": TEXT}),
            "resolve_tool_call": lambda: runpool.resolve_tool_call(
                latin, run_id, "c0", result={"t": TEXT}),
            "wait": lambda: runpool.wait(latin, run_id, timeout=1),
        }
        for what, call in calls.items():
            with pytest.raises(runpool.UsageError, match="client_encoding is LATIN1"):
                call()
            assert latin.info.transaction_status == psycopg.pq.TransactionStatus.IDLE, what
    assert scalar(conn, "SELECT count(*) FROM runpool.runs") == 1
    assert scalar(conn, "SELECT count(*) FROM runpool.signals") == 0


def test_latin1_database__migrate_refuses_it_naming_the_encoding(server_dsn: str) -> None:
    with scratch_database(server_dsn, prefix="runpool_latin1", migrated=False,
                          encoding="LATIN1") as dsn, \
            psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(runpool.UsageError, match="encoded LATIN1: runpool needs a UTF8"):
            migrate(conn)
        assert scalar(conn, "SELECT to_regnamespace('runpool') IS NULL")
