"""Failover under load (issue 19): a primary with a synchronous streaming standby, a pool on a
multi-host DSN with target_session_attrs=read-write; the primary is stopped hard and the
standby promoted while runs are in flight. Every run ends as the invariants demand, and
nothing committed before the crash is lost (a synchronous standby had it on disk before the
commit was acknowledged)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import runpool
from runpool.db import connect
from runpool.testing import Watch
from tests.clusters import migrated_database, synchronous_pair
from tests.helpers import assert_invariants, running_pool, scalar, wait_for

RUNS = 30
TERMINAL = ("succeeded", "failed", "cancelled")


def _both(dsn: str, primary: int, standby: int) -> str:
    """`dsn` naming both servers; connections go to whichever accepts writes."""
    params: dict[str, Any] = conninfo_to_dict(dsn)
    params.update(host="127.0.0.1,127.0.0.1", port=f"{primary},{standby}",
                  target_session_attrs="read-write", connect_timeout="3")
    return make_conninfo(**params)


def _statuses(conn: psycopg.Connection[Any], ids: list[Any]) -> dict[str, int]:
    return dict(conn.execute("SELECT status, count(*) FROM runpool.runs WHERE id = ANY(%s)"
                             " GROUP BY status", (ids,)).fetchall())


def test_failover__primary_killed_standby_promoted_under_load_nothing_committed_is_lost(
        ) -> None:
    with synchronous_pair() as (primary, standby):
        direct = migrated_database(primary.dsn())
        dsn = _both(direct, primary.port, standby.port)
        with connect(dsn, autocommit=True) as conn:
            ids = runpool.enqueue_many(conn, [
                runpool.RunSpec("acme" if i % 2 else "beta", "agent",
                                {"steps": 3, "tool_seconds": 0.3}) for i in range(RUNS)])
        with running_pool(dsn, workers=2, concurrency=4, lease_seconds=6, poll_seconds=1,
                          grace_seconds=2) as pool:
            with connect(dsn, autocommit=True) as conn:
                wait_for(lambda: _statuses(conn, ids).get("succeeded", 0) >= 4
                         and _statuses(conn, ids).get("running", 0) >= 2,
                         timeout=60, what="runs finished and running")
                # Read on the primary itself, last thing before it dies: all of it committed.
                done = [r for (r,) in conn.execute(
                    "SELECT id FROM runpool.runs WHERE id = ANY(%s) AND status = 'succeeded'",
                    (ids,))]
                calls = scalar(conn, "SELECT count(*) FROM runpool.tool_calls"
                                     " WHERE status = 'succeeded'")
            primary.stop("immediate")
            standby.promote()
            with connect(dsn, autocommit=True) as conn, Watch(dsn) as watch:
                assert conn.info.port == standby.port
                wait_for(lambda: sum(_statuses(conn, ids).get(s, 0) for s in TERMINAL) == RUNS,
                         timeout=90, what="every run ended on the promoted standby")
                assert _statuses(conn, ids) == {"succeeded": RUNS}
                # Nothing acknowledged before the crash was lost.
                assert scalar(conn, "SELECT count(*) FROM runpool.runs WHERE id = ANY(%s)"
                                    " AND status = 'succeeded'", done) == len(done)
                assert scalar(conn, "SELECT count(*) FROM runpool.tool_calls"
                                    " WHERE status = 'succeeded'") >= calls
                assert_invariants(conn, watch=watch)
            assert "action=listen_lost" in pool.log()
