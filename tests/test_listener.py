from __future__ import annotations

import psycopg
from psycopg import sql

import runpool
from tests.helpers import (
    assert_invariants,
    live_workers,
    run_row,
    running_pool,
    scalar,
    wait_for,
)

# The worker's LISTEN connection, seen from the server.
LISTENER_PIDS = """
SELECT pid FROM pg_stat_activity
WHERE datname = current_database() AND query LIKE 'LISTEN runpool_wakeup%%'
"""


# Has this backend been idle (waiting for notices) for 3 s?
IDLE_FOR = """
SELECT coalesce(bool_or(state = 'idle' AND now() - state_change > interval '3 s'), false)
FROM pg_stat_activity WHERE pid = %s
"""


def _listener_pids(conn: psycopg.Connection) -> list[int]:
    return [p for (p,) in conn.execute(LISTENER_PIDS)]


def test_notify__wakes_an_idle_worker_long_before_its_poll(conn: psycopg.Connection,
                                                          dsn: str) -> None:
    with running_pool(dsn, poll_seconds=600):
        wait_for(lambda: _listener_pids(conn), what="listener up")
        run_id = runpool.enqueue(conn, "acme", "noop")
        wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded", timeout=10,
                 what="run started by NOTIFY")


def test_listen_connection_killed__worker_reconnects_and_catches_up(
        conn: psycopg.Connection, dsn: str) -> None:
    # A 600 s poll: only the reconnect (and its catch-up claim) can start these runs in time.
    with running_pool(dsn, poll_seconds=600):
        (old,) = wait_for(lambda: _listener_pids(conn), what="listener up")
        conn.execute("SELECT pg_terminate_backend(%s)", (old,))
        missed = runpool.enqueue(conn, "acme", "noop")  # likely while disconnected
        new = wait_for(lambda: [p for p in _listener_pids(conn) if p != old],
                       what="listener reconnected")
        assert new
        wait_for(lambda: run_row(conn, missed)["status"] == "succeeded", timeout=10,
                 what="run enqueued during the outage")
        after = runpool.enqueue(conn, "acme", "noop")
        wait_for(lambda: run_row(conn, after)["status"] == "succeeded", timeout=10,
                 what="run enqueued after reconnect")
        assert len(live_workers(conn)) == 1
    assert_invariants(conn)


def test_idle_session_timeout__the_listen_connection_stays(conn: psycopg.Connection,
                                                           dsn: str) -> None:
    # An operator's reaper of idle sessions must not reap the one connection that is idle by
    # design: each reconnect would lose the notices sent while it was away.
    conn.execute(sql.SQL("ALTER DATABASE {} SET idle_session_timeout = '1s'").format(
        sql.Identifier(conn.info.dbname)))
    with running_pool(dsn, poll_seconds=600) as pool:
        (pid,) = wait_for(lambda: _listener_pids(conn), what="listener up")
        # Idle for well past the timeout, and still the same session.
        wait_for(lambda: scalar(conn, IDLE_FOR, pid), timeout=15,
                 what="listener idle for 3 s")
        assert _listener_pids(conn) == [pid]
        run_id = runpool.enqueue(conn, "acme", "noop")
        wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded", timeout=10,
                 what="run started by NOTIFY")
        assert "action=listen_lost" not in pool.log()
    assert_invariants(conn)


def test_listen_off__polling_alone_picks_up_work(conn: psycopg.Connection, dsn: str) -> None:
    with running_pool(dsn, listen=0, poll_seconds=0.5):
        wait_for(lambda: live_workers(conn), what="worker up")
        run_id = runpool.enqueue(conn, "acme", "noop")
        wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded", timeout=10,
                 what="polled run")
        assert _listener_pids(conn) == []
    assert_invariants(conn)
