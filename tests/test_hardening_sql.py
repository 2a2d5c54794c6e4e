"""Issue 11, SQL side: no tenant, caller or deployment can break the pool.

Each test names the defect it covers; every one of them failed on the code before 0006."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

import runpool
from runpool.claiming import ClaimedRun, claim
from runpool.db import aconnect, connect
from runpool.errors import UnsafeSchema
from runpool.migrate import migrate
from runpool.queries import QUERIES
from tests.helpers import (
    assert_invariants,
    finish_params,
    run_row,
    running_pool,
    scalar,
    wait_for,
)

# Keys whose unfinished runs do not have exactly one head (none: stuck; two: run at once).
BAD_KEYS = """
SELECT tenant, serial_key, count(*) FILTER (WHERE NOT held) FROM runpool.runs
WHERE serial_key IS NOT NULL AND status IN ('queued', 'running')
GROUP BY tenant, serial_key HAVING count(*) FILTER (WHERE NOT held) <> 1
"""


def _claim(dsn: str, limit: int = 10, **options: Any) -> list[ClaimedRun]:
    async def main() -> list[ClaimedRun]:
        async with await aconnect(dsn, autocommit=True) as c:
            return await claim(c, worker_id=uuid.uuid4(), limit=limit, lease_seconds=30,
                               **options)
    return asyncio.run(main())


def _beat(conn: psycopg.Connection, runs: list[ClaimedRun]) -> list[tuple[Any, ...]]:
    # (run id, cancel flag); the third column (overdue) is test_cost's.
    return [row[:2] for row in conn.execute(QUERIES["heartbeat"], {
        "ids": [r.id for r in runs], "attempts": [r.attempt for r in runs],
        "lease_seconds": 30, "worker_id": uuid.uuid4()}).fetchall()]


def _bounded(conn: psycopg.Connection) -> None:
    # A statement that waits on a caller's lock fails here instead of hanging the test.
    conn.execute("SET statement_timeout = '3s'")


# -- defect 2: a refused cancel holds no lock; the heartbeat skips rows a caller holds --------

def test_defect2_cancel__another_tenants_run_is_refused_before_its_row_is_locked(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    (claimed,) = _claim(dsn)
    with connect(dsn) as caller, connect(dsn, autocommit=True) as worker:
        _bounded(worker)
        assert scalar(caller, "SELECT runpool.cancel_run(%s, 'x', 'evil')", run_id) is None
        # The caller's transaction is still open: the heartbeat must not wait for it.
        assert _beat(worker, [claimed]) == [(run_id, False)]
        caller.rollback()


def test_defect2_heartbeat__a_row_a_caller_holds_is_busy_not_lost_and_others_renew(
        conn: psycopg.Connection, dsn: str) -> None:
    a = runpool.enqueue(conn, "acme", "noop")
    b = runpool.enqueue(conn, "acme", "noop")
    claimed = _claim(dsn)
    with connect(dsn) as caller, connect(dsn, autocommit=True) as worker:
        _bounded(worker)
        assert scalar(caller, "SELECT runpool.cancel_run(%s, 'x', 'acme')", a) == "cancelling"
        # a: busy (NULL), neither renewed nor reported lost; b: renewed.
        assert sorted(_beat(worker, claimed), key=lambda r: r[0] != a) == [
            (a, None), (b, False)]
        caller.commit()
        assert sorted(_beat(worker, claimed), key=lambda r: r[0] != a) == [
            (a, True), (b, False)]
    assert run_row(conn, b)["status"] == "running"


def test_defect2_finish__a_row_a_caller_holds_is_busy_and_the_rest_of_the_batch_lands(
        conn: psycopg.Connection, dsn: str) -> None:
    a = runpool.enqueue(conn, "acme", "noop")
    b = runpool.enqueue(conn, "acme", "noop")
    claimed = _claim(dsn)
    params = finish_params([(c.id, c.attempt) for c in claimed])
    with connect(dsn) as caller, connect(dsn, autocommit=True) as writer:
        _bounded(writer)
        assert scalar(caller, "SELECT runpool.cancel_run(%s, 'x', 'acme')", a) == "cancelling"
        assert sorted(writer.execute(QUERIES["finish_runs"], params).fetchall(),
                      key=lambda r: r[0] != a) == [(a, 1, "busy"), (b, 1, "succeeded")]
        caller.commit()
        assert writer.execute(QUERIES["finish_runs"], params).fetchall() == [
            (a, 1, "succeeded")]


def test_defect2_outcome_writer__writes_a_busy_outcome_again_once_the_caller_commits(
        conn: psycopg.Connection, dsn: str) -> None:
    a = runpool.enqueue(conn, "acme", "sleep", {"seconds": 1})
    b = runpool.enqueue(conn, "acme", "sleep", {"seconds": 1})
    with running_pool(dsn, lease_seconds=30), connect(dsn) as caller:
        wait_for(lambda: run_row(conn, a)["status"] == "running", what="a running")
        scalar(caller, "SELECT runpool.cancel_run(%s, 'held open', 'acme')", a)
        # The caller keeps a's row locked; b, finished in the same batch, lands anyway.
        wait_for(lambda: run_row(conn, b)["status"] == "succeeded", timeout=6, what="b done")
        assert run_row(conn, a)["status"] == "running"
        caller.commit()
        wait_for(lambda: run_row(conn, a)["status"] == "succeeded", what="a recorded")
    assert run_row(conn, a)["attempt"] == 1
    assert_invariants(conn)


# -- defect 3: a caller's open serial-key enqueue does not hold the outcome writer ------------

@pytest.mark.parametrize("waiting", [0, 1])
def test_defect3_release__does_not_wait_for_a_callers_key_lock_and_no_key_goes_headless(
        conn: psycopg.Connection, dsn: str, waiting: int) -> None:
    head = runpool.enqueue(conn, "acme", "noop", serial_key="k")
    other = runpool.enqueue(conn, "acme", "noop", serial_key="other")
    queued = [runpool.enqueue(conn, "acme", "noop", serial_key="k") for _ in range(waiting)]
    claimed = _claim(dsn)
    assert {c.id for c in claimed} == {head, other}
    params = finish_params([(c.id, c.attempt) for c in claimed])
    with connect(dsn) as caller, connect(dsn) as writer:
        _bounded(writer)
        late = runpool.enqueue(caller, "acme", "noop", serial_key="k")  # holds k's lock
        # The outcome writer's batched path: it must finish both runs now.
        writer.execute(QUERIES["defer_serial_release"])
        assert len(writer.execute(QUERIES["finish_runs"], params).fetchall()) == 2
        writer.execute(QUERIES["lock_ended_serial_keys"], params)
        writer.execute(QUERIES["release_serial_keys"], params)
        writer.commit()
        # A run that waited already is released at once, caller or not.
        assert [run_row(conn, q)["held"] for q in queued] == [False] * waiting
        assert conn.execute(BAD_KEYS).fetchall() == []
        caller.commit()
    # The caller's run is released at its own commit when nothing else was waiting.
    assert run_row(conn, late)["held"] == bool(waiting)
    assert conn.execute(BAD_KEYS).fetchall() == []
    assert scalar(conn, "SELECT runpool.heal_serial_keys()") == 0


def test_defect3_trigger__a_reap_does_not_wait_for_a_callers_key_lock(
        conn: psycopg.Connection, dsn: str) -> None:
    head = runpool.enqueue(conn, "acme", "noop", serial_key="k")
    _claim(dsn)
    conn.execute("UPDATE runpool.runs SET lease_expires_at = now() - interval '1 s',"
                 " attempt_offset = 0, max_attempts = 1 WHERE id = %s", (head,))
    with connect(dsn) as caller, connect(dsn, autocommit=True) as reaper:
        _bounded(reaper)
        late = runpool.enqueue(caller, "acme", "noop", serial_key="k")
        assert scalar(reaper, QUERIES["reap_expired"]) == 1  # the row trigger path
        caller.commit()
    assert run_row(conn, head)["status"] == "failed"
    assert not run_row(conn, late)["held"]  # released by the caller's own commit
    assert conn.execute(BAD_KEYS).fetchall() == []


def test_defect3_sweep__heals_a_key_left_headless(conn: psycopg.Connection) -> None:
    head = runpool.enqueue(conn, "acme", "noop", serial_key="k")
    nxt = runpool.enqueue(conn, "acme", "noop", serial_key="k")
    # A release that could not happen (its next run was locked by a cancel that rolled back).
    with conn.transaction():
        conn.execute("SELECT set_config('runpool.release', pg_current_xact_id()::text, true)")
        conn.execute("UPDATE runpool.runs SET status = 'cancelled', finished_at = now()"
                     " WHERE id = %s", (head,))
    assert run_row(conn, nxt)["held"]
    assert scalar(conn, "SELECT runpool.heal_serial_keys()") == 1
    assert not run_row(conn, nxt)["held"]
    assert scalar(conn, "SELECT runpool.heal_serial_keys()") == 0


# -- defect 4: other isolation levels can neither strand a key nor give it two heads ----------

@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_defect4_enqueue_under_snapshot_isolation__never_two_heads_never_stuck(
        conn: psycopg.Connection, dsn: str, isolation: str) -> None:
    begin = sql.SQL("BEGIN ISOLATION LEVEL {}").format(sql.SQL(isolation))
    # A tenant created after a snapshot is a serialization failure of its own (retryable).
    conn.execute("SELECT runpool.set_tenant_quota('acme', NULL)")
    with connect(dsn, autocommit=True) as caller:
        # Two heads: the caller's snapshot predates a committed enqueue of the key.
        caller.execute(begin)
        caller.execute("SELECT 1")
        first = runpool.enqueue(conn, "acme", "noop", serial_key="a")
        second = runpool.enqueue(caller, "acme", "noop", serial_key="a")
        caller.execute("COMMIT")
        assert run_row(conn, second)["held"] and not run_row(conn, first)["held"]
        # Stuck: the snapshot still shows a head that has ended since.
        head = runpool.enqueue(conn, "acme", "noop", serial_key="b")
        (claimed,) = [c for c in _claim(dsn) if c.id == head]
        caller.execute(begin)
        caller.execute("SELECT 1")
        conn.execute(QUERIES["finish_runs"], finish_params([(head, claimed.attempt)]))
        waiting = runpool.enqueue(caller, "acme", "noop", serial_key="b")
        caller.execute("COMMIT")
    assert run_row(conn, waiting)["held"]
    assert scalar(conn, "SELECT runpool.heal_serial_keys()") == 1
    assert not run_row(conn, waiting)["held"]
    assert conn.execute(BAD_KEYS).fetchall() == []


def test_defect4_heal__refuses_snapshot_isolation(conn: psycopg.Connection) -> None:
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        with pytest.raises(psycopg.errors.InvalidTransactionState, match="READ COMMITTED"):
            conn.execute("SELECT runpool.heal_serial_keys()")


# -- defect 5: nothing a caller sets changes what the serial trigger does --------------------

def test_defect5_api_session__cannot_switch_off_the_serial_release(
        conn: psycopg.Connection, dsn: str) -> None:
    head = runpool.enqueue(conn, "acme", "noop", serial_key="k")
    nxt = runpool.enqueue(conn, "acme", "noop", serial_key="k")
    with connect(dsn) as api:
        api.execute("SET ROLE runpool_api")
        api.execute("SELECT set_config('runpool.release', pg_current_xact_id()::text, true)")
        api.execute("SET LOCAL runpool.session = 'worker'")
        assert scalar(api, "SELECT runpool.cancel_run(%s)", head) == "cancelled"
        api.commit()
    assert not run_row(conn, nxt)["held"]
    assert conn.execute(BAD_KEYS).fetchall() == []


# -- defect 7: claim cost does not grow with future runs or paused tenants -------------------

def _claim_blocks(conn: psycopg.Connection,
                  handlers: list[str] | None = None) -> tuple[int, list[str]]:
    """Buffers touched by one claim's statements (rolled back), and the tenants it locked."""
    blocks = 0
    with conn.transaction():
        if handlers is None:
            # A claimer serving every handler first reads which have ready runs (claiming.py).
            stmt = sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + sql.SQL(
                QUERIES["ready_handlers"])
            plan = scalar(conn, stmt)[0]["Plan"]
            blocks += plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
            handlers = [h for (h,) in conn.execute(QUERIES["ready_handlers"])]
        stmt = sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + sql.SQL(
            QUERIES["lock_tenants"])
        plan = scalar(conn, stmt, {"handlers": handlers, "limit": 10,
                                   "roomy": False})[0]["Plan"]
        blocks += plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
        chosen = conn.execute(QUERIES["lock_tenants"],
                              {"handlers": handlers, "limit": 10,
                               "roomy": False}).fetchall()
        locked = [t for (t, _, skipped) in chosen if not skipped]
        stmt = sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + sql.SQL(
            QUERIES["claim_runs"])
        plan = scalar(conn, stmt, {"limit": 10, "handlers": handlers,
                                   "worker_id": uuid.uuid4(), "lease_seconds": 30})[0]["Plan"]
        blocks += plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
        raise psycopg.Rollback()  # EXPLAIN ANALYZE really claims: undo it
    return blocks, locked


def test_defect7_claim__cost_ignores_runs_scheduled_later_and_paused_tenants(
        conn: psycopg.Connection) -> None:
    conn.execute("SET jit = off")
    runpool.enqueue(conn, "live", "noop")
    conn.execute("ANALYZE runpool.runs")
    empty, locked = _claim_blocks(conn)
    assert locked == ["live"]
    conn.execute("SELECT runpool.enqueue('future', 'noop', run_at => now() + interval '1 day')"
                 " FROM generate_series(1, 5000)")
    conn.execute("SELECT runpool.set_tenant_quota('paused' || g, 0),"
                 " runpool.enqueue('paused' || g, 'noop') FROM generate_series(1, 500) g")
    conn.execute("ANALYZE runpool.runs")
    loaded, locked = _claim_blocks(conn)
    assert locked == ["live"]  # neither the future tenant nor a paused one is locked
    assert loaded <= empty * 1.5 + 10, (empty, loaded)


def test_defect7_deferred__a_scheduled_run_and_a_backoff_become_claimable_when_due(
        conn: psycopg.Connection, dsn: str) -> None:
    soon = runpool.enqueue(conn, "acme", "noop",
                           run_at=datetime.now(UTC) + timedelta(seconds=0.5))
    assert run_row(conn, soon)["deferred"] and _claim(dsn) == []
    wait_for(lambda: [c.id for c in _claim(dsn)] == [soon], what="the scheduled run claimed")
    conn.execute("SELECT runpool.set_tenant_quota('acme', 0)")
    paused = runpool.enqueue(conn, "acme", "noop")
    assert run_row(conn, paused)["paused"] and _claim(dsn) == []
    conn.execute("SELECT runpool.set_tenant_quota('acme', NULL)")
    assert [c.id for c in _claim(dsn)] == [paused]
    # A stale flag (an enqueue that raced an unpause) is put right by the sweep, which a
    # claim that reaps runs too.
    stale = runpool.enqueue(conn, "acme", "noop")
    conn.execute("UPDATE runpool.runs SET paused = true WHERE id = %s", (stale,))
    assert _claim(dsn, reap_expired=False) == []
    conn.execute("SELECT runpool.heal_serial_keys()")
    assert [c.id for c in _claim(dsn, reap_expired=False)] == [stale]
    other = runpool.enqueue(conn, "acme", "noop")
    conn.execute("UPDATE runpool.runs SET paused = true WHERE id = %s", (other,))
    assert [c.id for c in _claim(dsn)] == [other]


# -- defect 8: a mixed fleet claims only what it serves ---------------------------------------

def test_defect8_mixed_fleet__a_run_no_pool_serves_waits_and_explain_says_so(
        conn: psycopg.Connection, dsn: str) -> None:
    foreign = runpool.enqueue(conn, "acme", "handler_of_another_app", priority=10)
    mine = runpool.enqueue(conn, "acme", "noop")
    with running_pool(dsn):
        wait_for(lambda: run_row(conn, mine)["status"] == "succeeded", what="own run done")
        row = run_row(conn, foreign)
        assert (row["status"], row["attempt"]) == ("queued", 0)
        doc = scalar(conn, "SELECT runpool.explain_run(%s)", foreign)
        assert doc["handler_served"] is False
        assert doc["summary"].startswith("no live pool serves handler handler_of_another_app")
    assert_invariants(conn, all_terminal=False)


# -- defect 9: absurd timestamps are refused --------------------------------------------------

@pytest.mark.parametrize("run_at", ["infinity", "-infinity", "3000-01-01"])
def test_defect9_run_at__non_finite_or_absurd_is_refused(
        conn: psycopg.Connection, run_at: str) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="run_at must be a finite"):
        conn.execute("SELECT runpool.enqueue('acme', 'noop', run_at => %s::timestamptz)",
                     (run_at,))
    with pytest.raises(runpool.InvalidInput, match="run_at"):
        runpool.enqueue(conn, "acme", "noop", run_at=datetime(3000, 1, 1, tzinfo=UTC))
    assert scalar(conn, "SELECT count(*) FROM runpool.runs") == 0


# -- defect 10: privileges --------------------------------------------------------------------

def test_defect10_functions__pg_catalog_comes_first_in_every_search_path(
        conn: psycopg.Connection) -> None:
    # A SQL-standard body (0008's rule functions, which must stay SET-free to be inlined)
    # binds every name when it is created: no search_path is ever consulted for it.
    rows = conn.execute("""
        SELECT p.oid::regprocedure::text, array_to_string(p.proconfig, ',')
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = 'runpool' AND (p.prosqlbody IS NULL OR p.prosecdef
                                         OR p.provolatile = 'v')
          -- the doorbell (0018), a run id with its salt (0021, inlined into enqueue) and
          -- the deadline rule (0022, read of clock_timestamp(), inlined into enqueue and
          -- enqueue_many): volatile SQL-standard bodies, no rights of their own
          AND NOT (p.proname IN ('_ring', 'new_run_id', 'new_run_salt', 'deadline_problem')
                   AND p.prosqlbody IS NOT NULL)
          -- the hot statements' functions (runpool.pooled): the worker's own statements,
          -- invoker's rights, names resolved as if the worker sent them; a SET clause
          -- would undo their set_config(..., true) (the serial keys' deferred release)
          AND NOT (p.proname LIKE 'hot\\_%' AND NOT p.prosecdef)""").fetchall()
    bad = [(f, c) for f, c in rows if not (c or "").startswith("search_path=pg_catalog")]
    assert len(rows) > 10 and bad == []


def test_defect10_counter_bump__only_the_worker_role_may_call_it(
        conn: psycopg.Connection) -> None:
    # A definer since 0023 (owner's rights): an API caller bumping a run's counter would leave
    # a gap in its event seqs that a follower waits on.
    def may(role: str) -> bool:
        return bool(scalar(conn, "SELECT has_function_privilege(%s,"
                                 " 'runpool._bump_event_seqs(uuid[])', 'EXECUTE')", role))

    assert may("runpool_worker")
    assert not may("runpool_api")
    assert not may("public")


def test_defect10_worker_role__holds_no_delete_and_no_migration_writes(
        conn: psycopg.Connection) -> None:
    grants = conn.execute("""
        SELECT table_name, privilege_type FROM information_schema.role_table_grants
        WHERE grantee = 'runpool_worker' AND table_schema = 'runpool'
          AND (privilege_type IN ('DELETE', 'TRUNCATE')
               OR (table_name IN ('schema_migrations', 'tenants', 'runs')
                   AND privilege_type = 'INSERT'))""").fetchall()
    assert grants == []


def test_defect10_scoped_retry_and_explain__another_tenants_run_is_null(
        conn: psycopg.Connection) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    assert scalar(conn, "SELECT runpool.cancel_run(%s)", run_id) == "cancelled"
    with conn.transaction():
        conn.execute("SET LOCAL ROLE runpool_api")
        assert scalar(conn, "SELECT runpool.explain_run(%s, 'evil')", run_id) is None
        assert scalar(conn, "SELECT runpool.retry_run(%s, 'evil')", run_id) is None
        assert scalar(conn, "SELECT runpool.explain_run(%s, 'acme')", run_id)["status"] == \
            "cancelled"
        assert scalar(conn, "SELECT runpool.retry_run(%s, 'acme')", run_id) == "queued"
        assert scalar(conn, "SELECT runpool.retry_run(%s, 'acme')", run_id) == "queued"
    assert scalar(conn, "SELECT runpool.explain_run(%s, 'evil')", uuid.uuid4()) is None


def test_defect10_migrate__refuses_a_schema_others_may_create_in(empty_dsn: str) -> None:
    with connect(empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA runpool")
        conn.execute("GRANT CREATE ON SCHEMA runpool TO PUBLIC")
        with pytest.raises(UnsafeSchema, match="REVOKE CREATE"):
            migrate(conn)
        conn.execute("REVOKE CREATE ON SCHEMA runpool FROM PUBLIC")
        assert migrate(conn)


def test_defect10_a_pool_logged_in_with_only_the_worker_role_runs_everything(
        conn: psycopg.Connection, dsn: str) -> None:
    login = f"rp_worker_{uuid.uuid4().hex[:10]}"
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE runpool_worker").format(
        sql.Identifier(login)))
    # The test handlers' side tables (what a real model and real tools would have done).
    conn.execute(sql.SQL("GRANT INSERT ON model_calls, tool_log TO {}").format(
        sql.Identifier(login)))
    try:
        params = psycopg.conninfo.conninfo_to_dict(dsn)
        params["user"] = login
        worker_dsn = psycopg.conninfo.make_conninfo(**params)  # type: ignore[arg-type]
        ids = [runpool.enqueue(conn, "acme", "agent", {"steps": 2}),
               runpool.enqueue(conn, "acme", "fails"),
               *[runpool.enqueue(conn, "acme", "noop", serial_key="k") for _ in range(3)]]
        retried = runpool.enqueue(conn, "acme", "flaky", {"fail_times": 1})
        with running_pool(worker_dsn):
            wait_for(lambda: all(run_row(conn, i)["status"] in ("succeeded", "failed")
                                 for i in [*ids, retried]), what="runs done", timeout=30)
        assert [run_row(conn, i)["status"] for i in ids] == [
            "succeeded", "failed", "succeeded", "succeeded", "succeeded"]
        assert run_row(conn, retried)["attempt"] == 2
        assert_invariants(conn)
    finally:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(login)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(login)))


# -- defect 11: heartbeats do not queue behind checkpoint writes ------------------------------

def test_defect11_heartbeat__renews_while_checkpoint_writes_hold_every_pooled_connection(
        conn: psycopg.Connection, dsn: str) -> None:
    # concurrency 8: a pool of 3 + 8/4 = 5 connections, and 7 agents whose first message
    # write waits on the table lock below, holding (or queueing for) every one of them.
    with connect(dsn) as blocker:
        blocker.execute("LOCK TABLE runpool.messages IN ACCESS EXCLUSIVE MODE")
        sleeper = runpool.enqueue(conn, "acme", "sleep", {"seconds": 8})
        for _ in range(7):
            runpool.enqueue(conn, "acme", "agent", {"steps": 1})
        with running_pool(dsn, concurrency=8, lease_seconds=6):
            wait_for(lambda: scalar(conn, "SELECT count(*) FROM pg_locks l JOIN pg_class c"
                                          " ON c.oid = l.relation WHERE NOT l.granted"
                                          " AND c.relname = 'messages'") >= 5,
                     what="every pooled connection waiting on a checkpoint write")
            before = run_row(conn, sleeper)["lease_expires_at"]
            # A heartbeat is due every 2 s; the writes' own deadline is 3 s away at least.
            renewed = wait_for(lambda: run_row(conn, sleeper)["lease_expires_at"] > before,
                               timeout=2.8, what="a renewal while the writes wait")
            blocker.rollback()
            assert renewed
            wait_for(lambda: run_row(conn, sleeper)["status"] == "succeeded", timeout=20,
                     what="the sleeper done")
    assert run_row(conn, sleeper)["attempt"] == 1


# -- review of 0006/0007 (a hostile tenant's repros) -------------------------------------------

def test_review1_resolve_tool_call__another_tenants_run_is_refused_before_its_row_is_locked(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    (claimed,) = _claim(dsn)
    with connect(dsn) as caller, connect(dsn, autocommit=True) as worker:
        _bounded(worker)
        caller.execute("SET ROLE runpool_api")
        assert scalar(caller, "SELECT runpool.resolve_tool_call(%s, 'c0', retry => true,"
                              " tenant => 'evil')", run_id) is None
        # The caller's transaction is still open: the heartbeat renews the lease (not busy).
        assert _beat(worker, [claimed]) == [(run_id, False)]
        caller.rollback()


def _seq_scans_of_runs(session: psycopg.Connection) -> int:
    """Sequential scans of runpool.runs so far, counting this (autocommit) session's own."""
    session.execute("SELECT pg_stat_force_next_flush()")
    session.execute("SELECT pg_stat_clear_snapshot()")
    return int(scalar(session, "SELECT seq_scan FROM pg_stat_user_tables"
                               " WHERE relid = 'runpool.runs'::regclass"))


def test_review2_keyed_enqueue_and_retry__never_scan_the_table_once_the_plan_is_generic(
        conn: psycopg.Connection, dsn: str) -> None:
    # Another tenant's deep keyed backlog: 20,000 runs on 10 keys (one head each).
    conn.execute("""
        INSERT INTO runpool.runs (tenant, handler, input, priority, available_at, rank,
                                  max_attempts, serial_key, serial_order, status, held)
        SELECT 'big', 'noop', '{}', 0, now(), g, 3, 'k' || (g % 10), g, 'queued', g > 10
        FROM generate_series(1, 20000) g""")
    conn.execute("ANALYZE runpool.runs")
    failed = [runpool.enqueue(conn, "acme", "noop") for _ in range(10)]
    conn.execute("UPDATE runpool.runs SET status = 'failed', finished_at = now()"
                 " WHERE tenant = 'acme'")
    conn.execute("UPDATE runpool.runs SET serial_key = 'r' || id WHERE tenant = 'acme'")
    # The setup's own scans are counted before `before` is read: a backend flushes its counts
    # when it next goes idle, no sooner than a second after its last flush unless told to.
    conn.execute("SELECT pg_stat_force_next_flush()")
    with connect(dsn, autocommit=True) as api:  # one session: past the fifth call, generic
        before = _seq_scans_of_runs(api)
        for i in range(10):
            runpool.enqueue(api, "acme", "noop", serial_key=f"x{i}")
        for run_id in failed:
            assert scalar(api, "SELECT runpool.retry_run(%s)", run_id) == "queued"
        assert _seq_scans_of_runs(api) == before
        # The keyed path's custom plans do not outlive the call.
        assert scalar(api, "SHOW plan_cache_mode") == "auto"


def _blocks(conn: psycopg.Connection, query: str) -> int:
    """Buffers one statement touches (rolled back)."""
    with conn.transaction():
        stmt = sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + sql.SQL(query)
        plan = scalar(conn, stmt)[0]["Plan"]
        raise psycopg.Rollback()
    return int(plan["Shared Hit Blocks"] + plan["Shared Read Blocks"])


def test_review3_claim__cost_ignores_held_deferred_runs_and_runs_of_unserved_handlers(
        conn: psycopg.Connection) -> None:
    conn.execute("SET jit = off")
    runpool.enqueue(conn, "live", "noop")
    conn.execute("ANALYZE runpool.runs")
    empty, locked = _claim_blocks(conn, ["noop", "sleep"])
    assert locked == ["live"]
    promote_empty = _blocks(conn, QUERIES["promote_due"])
    # A key's line of 5,000 runs waiting held and deferred (retries in backoff), all due,
    # behind a head that runs for a day.
    conn.execute("""
        INSERT INTO runpool.runs (tenant, handler, input, priority, available_at, rank,
                                  max_attempts, serial_key, serial_order, status, held, deferred,
                                  attempt, lease_expires_at)
        SELECT 'atk', 'noop', '{}', 0, now() - interval '1 s', g, 3, 'k', g,
               CASE WHEN g = 0 THEN 'running' ELSE 'queued' END, g > 0, g > 0, 1,
               CASE WHEN g = 0 THEN now() + interval '1 day' END
        FROM generate_series(0, 5000) g""")
    # 5,000 ready runs, ranked best, of a handler no pool here serves.
    conn.execute("""
        INSERT INTO runpool.runs (tenant, handler, input, priority, available_at, rank,
                                  max_attempts, status)
        SELECT 'atk', 'nobody', '{}', 0, now(), g - 1e9, 3, 'queued'
        FROM generate_series(1, 5000) g""")
    conn.execute("ANALYZE runpool.runs")
    assert _blocks(conn, QUERIES["promote_due"]) <= promote_empty + 5
    loaded, locked = _claim_blocks(conn, ["noop", "sleep"])
    assert locked == ["live"]
    assert loaded <= empty * 1.5 + 10, (empty, loaded)


def test_review4_heal_sweep__visits_a_bounded_number_of_keys_and_resumes_where_it_stopped(
        conn: psycopg.Connection) -> None:
    def headless(keys: list[str]) -> None:
        conn.execute("SELECT runpool.enqueue('acme', 'noop', serial_key => k)"
                     " FROM unnest(%s::text[]) k", (keys,))
        conn.execute("SELECT runpool.enqueue('acme', 'noop', serial_key => k)"
                     " FROM unnest(%s::text[]) k", (keys,))
        # Releases that could not happen: every head ends and its key is left headless.
        with conn.transaction():
            conn.execute("SELECT set_config('runpool.release', pg_current_xact_id()::text,"
                         " true)")
            conn.execute("UPDATE runpool.runs SET status = 'cancelled', finished_at = now()"
                         " WHERE serial_key = ANY(%s) AND NOT held", (keys,))

    headless([f"k{i:03}" for i in range(250)])
    assert len(conn.execute(BAD_KEYS).fetchall()) == 250
    # 100 keys a sweep, each sweep going on from where the previous one stopped.
    assert [scalar(conn, "SELECT runpool.heal_serial_keys()") for _ in range(4)] == [
        100, 100, 50, 0]
    assert conn.execute(BAD_KEYS).fetchall() == []
    # Past the last key it starts again from the first.
    headless(["a"])
    assert [scalar(conn, "SELECT runpool.heal_serial_keys()") for _ in range(2)] == [1, 0]
    assert conn.execute(BAD_KEYS).fetchall() == []


def test_review5_explain__a_key_kept_headless_by_a_sessions_advisory_lock_names_its_pid(
        conn: psycopg.Connection, dsn: str) -> None:
    head = runpool.enqueue(conn, "acme", "noop", serial_key="k1")
    nxt = runpool.enqueue(conn, "acme", "noop", serial_key="k1")
    with connect(dsn) as squatter:
        # What any login that may connect can do: both of the key's locks, held open.
        squatter.execute("SELECT pg_advisory_xact_lock(hashtextextended("
                         "'acme' || chr(31) || 'k1', 7371)), pg_advisory_xact_lock("
                         "hashtextextended('acme' || chr(31) || 'k1', 7370))")
        pid = squatter.info.backend_pid
        assert scalar(conn, "SELECT runpool.cancel_run(%s)", head) == "cancelled"
        assert scalar(conn, "SELECT runpool.heal_serial_keys()") == 0  # the key stays headless
        summary = scalar(conn, "SELECT runpool.explain_run(%s) ->> 'summary'", nxt)
        assert f"whose lock session pid {pid} holds" in summary, summary
        squatter.rollback()
    assert scalar(conn, "SELECT runpool.heal_serial_keys()") == 1
    doc = scalar(conn, "SELECT runpool.explain_run(%s)", nxt)
    assert "pid" not in doc["summary"]


def test_review6_enqueue_many__caps_distinct_serial_keys_per_call(
        conn: psycopg.Connection) -> None:
    from runpool.enqueue import MAX_SERIAL_KEYS

    too_many = [runpool.RunSpec("acme", "noop", serial_key=f"k{i}")
                for i in range(MAX_SERIAL_KEYS + 1)]
    with pytest.raises(runpool.InvalidInput, match="1001 distinct serial keys"):
        runpool.enqueue_many(conn, too_many)
    assert scalar(conn, "SELECT count(*) FROM runpool.runs") == 0
    # The limit itself is fine, and so are many runs of few keys and unkeyed runs.
    assert len(runpool.enqueue_many(conn, too_many[:-1])) == MAX_SERIAL_KEYS
    same_key = [runpool.RunSpec("acme", "noop", serial_key="one")] * 1500
    assert len(runpool.enqueue_many(conn, same_key)) == 1500
    assert len(runpool.enqueue_many(conn, [runpool.RunSpec("acme", "noop")] * 1500)) == 1500
