"""Text encodings: runpool's JSON is UTF-8 bytes, so every connection that carries it must be
UTF-8 too, and the database must hold any Unicode text."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

import runpool
from runpool.migrate import check, migrate
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


@pytest.mark.parametrize("encoding", ["LATIN1", "SQL_ASCII"])
def test_caller_connection_not_in_utf8__each_call_refused_naming_the_encoding(
        conn: psycopg.Connection, dsn: str, encoding: str) -> None:
    # Under SQL_ASCII psycopg reads text as bytes: `wait` never saw b'succeeded' as terminal.
    run_id = runpool.enqueue(conn, "acme", "noop")
    with psycopg.connect(dsn, autocommit=True, client_encoding=encoding) as latin:
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
            with pytest.raises(runpool.UsageError, match=f"client_encoding is {encoding}"):
                call()
            assert latin.info.transaction_status == psycopg.pq.TransactionStatus.IDLE, what
    assert scalar(conn, "SELECT count(*) FROM runpool.runs") == 1
    assert scalar(conn, "SELECT count(*) FROM runpool.signals") == 0


@pytest.mark.parametrize("encoding", ["LATIN1", "SQL_ASCII"])
def test_database_not_utf8__migrate_and_a_pools_start_refuse_it_naming_the_encoding(
        server_dsn: str, encoding: str) -> None:
    # SQL_ASCII too: it stores whatever bytes an SQL caller sends, and one run whose input is
    # not UTF-8 then failed every claim on runpool's UTF8 connections (every worker crashed,
    # restarted and crashed again; no run of any tenant ran).
    with scratch_database(server_dsn, prefix="runpool_enc", migrated=False,
                          encoding=encoding) as dsn, \
            psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(runpool.UsageError, match=f"encoded {encoding}: runpool needs a UTF8"):
            migrate(conn)
        assert scalar(conn, "SELECT to_regnamespace('runpool') IS NULL")
        # A database migrated before this check: the pool refuses to start on it.
        with pytest.raises(runpool.UsageError, match=f"encoded {encoding}"):
            check(conn)


def test_names_and_tenants_with_lone_surrogates__invalid_input_from_every_api_call(
        conn: psycopg.Connection) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    bad = "a\ud800"
    calls: dict[str, Any] = {
        "signal_run tenant": lambda: runpool.signal_run(conn, run_id, "go", tenant=bad),
        "resolve call_id": lambda: runpool.resolve_tool_call(conn, run_id, bad, retry=True),
        "resolve tenant": lambda: runpool.resolve_tool_call(conn, run_id, "c0", retry=True,
                                                            tenant=bad),
        "wait tenant": lambda: runpool.wait(conn, run_id, timeout=1, tenant=bad),
    }
    for what, call in calls.items():
        with pytest.raises(runpool.InvalidInput, match="UTF-8"):
            call()
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE, what
