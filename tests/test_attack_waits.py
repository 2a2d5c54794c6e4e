"""Attack on durable waits and child runs (issue 15): a hostile tenant and an unlucky
operator, on real PostgreSQL (several connections) and real pools. Each test failed on the
code before its fix (named in the commit that fixed it)."""

from __future__ import annotations

import functools
import uuid
from typing import Any

import psycopg

import runpool
import runpool.testing.invariants
from runpool.queries import QUERIES
from tests.helpers import run_row, running_pool, scalar, status_of, wait_for

APP = "tests.wait_apps:app"
TERMINAL = ("succeeded", "failed", "cancelled")

# A chain of `depth` runs, each spawned by the one before and waiting to join it (a handler
# that spawns its own handler and joins it: a recursive agent), the last one queued. Built in
# one statement through the worker's own functions, as claims and handlers would.
CHAIN = """
DO $$
DECLARE
    cur uuid := %(root)s;
    kid uuid;
BEGIN
    FOR i IN 1..%(depth)s LOOP
        UPDATE runpool.runs SET status = 'running', attempt = 1, started_at = now(),
            lease_expires_at = now() + interval '1 hour'
        WHERE id = cur;
        kid := runpool._spawn(cur, 1, 'again', 'parent');
        PERFORM runpool._wait(cur, 1, 1, 'join', NULL, ARRAY[kid], NULL, 0);
        cur := kid;
    END LOOP;
END
$$"""


def _violations(conn: psycopg.Connection[Any]) -> list[str]:
    # Runs moved by hand (no claim, no outcome) lack the events a worker writes.
    report = runpool.testing.invariants.check(conn, all_terminal=False)
    return [v for v in report.violations if "events" not in v]


def _running(conn: psycopg.Connection[Any], handler: str = "approval") -> uuid.UUID:
    """A run as a claim leaves it: running, attempt 1, with a lease."""
    run_id = runpool.enqueue(conn, "acme", handler, {})
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1, started_at = now(),"
                 " lease_expires_at = now() + interval '1 minute' WHERE id = %s", (run_id,))
    return run_id


def test_cancel_run__a_chain_of_1000_spawned_runs_is_cancelled_whole(
        conn: psycopg.Connection[Any]) -> None:
    """A recursive agent (a child spawning its parent's handler) makes a chain as deep as it
    likes; cancelling its root must cancel all of it (a recursive cascade ran the server out
    of stack past ~500 levels: 'stack depth limit exceeded', nothing cancelled)."""
    root = runpool.enqueue(conn, "acme", "parent", {})
    conn.execute(CHAIN.replace("%(root)s", f"'{root}'").replace("%(depth)s", "1000"))
    assert scalar(conn, "SELECT count(*) FROM runpool.runs WHERE status = 'waiting'") == 1000
    assert scalar(conn, "SELECT runpool.cancel_run(%s, 'stop the recursion')", root) \
        == "cancelled"
    assert list(conn.execute("SELECT status, count(*) FROM runpool.runs GROUP BY 1")) == [
        ("cancelled", 1001)]
    assert scalar(conn, "SELECT count(*) FROM runpool.waits WHERE state = 'pending'") == 0
    assert scalar(conn, "SELECT count(DISTINCT cancel_reason) FROM runpool.runs") == 1
    assert _violations(conn) == []


def test_cancel_run__of_a_middle_run_cancels_below_it_only_and_answers_as_before(
        conn: psycopg.Connection[Any]) -> None:
    root = runpool.enqueue(conn, "acme", "parent", {})
    conn.execute(CHAIN.replace("%(root)s", f"'{root}'").replace("%(depth)s", "4"))
    chain = [root]
    for _ in range(4):
        chain.append(scalar(conn, "SELECT id FROM runpool.runs WHERE parent_id = %s", chain[-1]))
    # The leaf is claimed (running): it gets a cancel request; a sibling already ended is left.
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1, started_at = now(),"
                 " lease_expires_at = now() + interval '1 minute' WHERE id = %s", (chain[4],))
    assert scalar(conn, "SELECT runpool.cancel_run(%s, 'mid', 'globex')", chain[2]) is None
    assert scalar(conn, "SELECT runpool.cancel_run(%s, 'mid', 'acme')", chain[2]) == "cancelled"
    # Its parent, joining it, is woken by its end (cancelled is an end); the root still waits.
    assert [status_of(conn, r) for r in chain] == [
        "waiting", "queued", "cancelled", "cancelled", "running"]
    assert run_row(conn, chain[4])["cancel_requested_at"] is not None
    assert scalar(conn, "SELECT runpool.cancel_run(%s)", chain[2]) == "cancelled"
    assert scalar(conn, "SELECT runpool.cancel_run(%s)", chain[4]) == "cancelling"


def test_a_caller_holding_a_waits_row__claims_and_outcomes_do_not_wait_for_it(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    """A session holding a pending wait's row (an operator's `SELECT … FOR UPDATE` left open)
    stalled every claim of every worker (wake_due and the deadline sweep updated that row) and
    the outcome batch ending a child of a parent joining it. Now they pass it by; the run is
    woken once the row is free."""
    timed = _running(conn)
    assert scalar(conn, "SELECT state FROM runpool._wait(%s, 1, 1, 'signal', 'go', NULL,"
                        " 0.01, 0)", timed) == "waiting"
    late = _running(conn)
    assert scalar(conn, "SELECT state FROM runpool._wait(%s, 1, 1, 'signal', 'go', NULL,"
                        " NULL, 0)", late) == "waiting"
    conn.execute("UPDATE runpool.runs SET deadline = now() WHERE id = %s", (late,))
    parent = _running(conn, "parent")
    kid = scalar(conn, "SELECT runpool._spawn(%s, 1, 'c0', 'child')", parent)
    assert scalar(conn, "SELECT state FROM runpool._wait(%s, 1, 1, 'join', NULL, %s, NULL, 0)",
                  parent, [kid]) == "waiting"
    wait_for(lambda: scalar(conn, "SELECT count(*) FROM runpool.waits WHERE until < now()"),
             what="the timeout passed")
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as worker:
        holder.execute("SELECT 1 FROM runpool.waits FOR UPDATE")
        worker.execute("SET lock_timeout = '2s'")
        # The claim's sweeps (each would have failed with LockNotAvailable after 2 s).
        assert worker.execute(QUERIES["wake_due"]).fetchall() in ([], [(0,)])
        worker.execute(QUERIES["expire_deadlines"])
        # The child's end (a worker's outcome batch).
        worker.execute("UPDATE runpool.runs SET status = 'succeeded', finished_at = now()"
                       " WHERE id = %s", (kid,))
        assert [status_of(conn, r) for r in (timed, late, parent)] == ["waiting"] * 3
        holder.rollback()
        assert worker.execute(QUERIES["wake_due"]).fetchone() == (2,)
        worker.execute(QUERIES["expire_deadlines"])
    assert [status_of(conn, r) for r in (timed, late, parent)] == ["queued", "failed", "queued"]
    assert list(conn.execute("SELECT run_id, state FROM runpool.waits ORDER BY state")) == [
        (late, "cancelled"), (parent, "joined"), (timed, "timed_out")]
    assert scalar(conn, "SELECT count(*) FROM runpool.join_checks") == 0
    assert _violations(conn) == []


def test_signal_payloads_sent_through_sql__decoded_exactly_or_the_run_fails_once(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    """SQL's signal_run stores any jsonb. A payload nested past the decoder's 1,024 levels was
    retried until the run's attempts ran out (a JSONDecodeError, reason 'exception'); integers
    beyond 64 bits came back as floats. Now: decoded as a run's input is (exactly), and a
    payload no attempt can decode fails the run at once (invalid_input)."""
    deep = runpool.enqueue(conn, "acme", "approval", {"name": "deep"}, max_attempts=3)
    big = runpool.enqueue(conn, "acme", "signal_repr", {"name": "big"})
    conn.execute("SELECT runpool.signal_run(%s, 'deep', (repeat('[', 2000) || repeat(']', 2000))"
                 "::jsonb)", (deep,))
    conn.execute("SELECT runpool.signal_run(%s, 'big', '{\"n\": 123456789012345678901234567890}')",
                 (big,))
    with running_pool(dsn, app=APP, retry_backoff_seconds=0.1):
        for run_id in (deep, big):
            wait_for(functools.partial(lambda r: status_of(conn, r) in TERMINAL, run_id),
                     timeout=30, what="the run ended")
    row = run_row(conn, deep)
    assert (row["status"], row["error"]["reason"], row["attempt"]) == (
        "failed", "invalid_input", 1), row["error"]
    assert "signal payload" in row["error"]["message"]
    row = run_row(conn, big)
    assert row["status"] == "succeeded", row["error"]
    assert row["result"] == {"repr": "{'n': 123456789012345678901234567890}"}


def test_retry_run_of_a_run_whose_wait_went_unanswered__it_waits_again_afresh(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    """The dead-letter replay of an unanswered approval must be able to succeed. Before: a run
    failed by its wait's timeout (wait_timeout) met the same timed-out wait on every retry_run,
    and a run cancelled while it waited, retried after its wait's first deadline, timed out at
    once: retry_run answered 'queued' and the run failed again without waiting."""
    timed_out = runpool.enqueue(conn, "acme", "approval", {"timeout": 1})
    cancelled = runpool.enqueue(conn, "acme", "approval", {"timeout": 2})
    with running_pool(dsn, app=APP, lease_seconds=6) as pool:
        wait_for(lambda: status_of(conn, timed_out) == "failed", timeout=30, what="timed out")
        wait_for(lambda: status_of(conn, cancelled) == "waiting", timeout=30, what="waiting")
        assert scalar(conn, "SELECT runpool.cancel_run(%s)", cancelled) == "cancelled"
        # Past the cancelled wait's first deadline.
        wait_for(lambda: scalar(conn, "SELECT bool_and(until < now()) FROM runpool.waits"),
                 what="every first deadline passed")
        for run_id in (timed_out, cancelled):
            assert scalar(conn, "SELECT runpool.retry_run(%s)", run_id) == "queued"
            wait_for(lambda r=run_id: status_of(conn, r) == "waiting", timeout=30,  # type: ignore[misc]
                     what="waiting again")
            assert runpool.signal_run(conn, run_id, "approval", {"approved": True}) \
                == "delivered"
            wait_for(lambda r=run_id: status_of(conn, r) in TERMINAL, timeout=30,  # type: ignore[misc]
                     what="ended")
            row = run_row(conn, run_id)
            assert row["status"] == "succeeded", row["error"]
            assert row["result"]["payloads"] == [{"approved": True}]
        assert "action=run_internal_error" not in pool.log()
    assert _violations(conn) == []


def test_a_handler_swallowing_Suspended__its_slot_is_freed_and_the_run_resumes(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    """A bare `except:` around wait_for (a retry loop) swallows Suspended: the wait is
    committed and the run 'waiting', but the handler goes on. Its slot was held for as long
    as the handler ran (forever here: on a concurrency-1 pool nothing else ever ran, any
    tenant's runs); the heartbeat passes a suspended slot by. Now the worker cancels it and
    frees the slot after the cancel grace, as for a handler outliving a lost lease."""
    zombie = runpool.enqueue(conn, "acme", "bare_except", {})
    with running_pool(dsn, app=APP, workers=1, concurrency=1, cancel_grace_seconds=1) as pool:
        wait_for(lambda: status_of(conn, zombie) == "waiting", timeout=30, what="waiting")
        other = runpool.enqueue(conn, "globex", "child", {"n": 1})
        wait_for(lambda: status_of(conn, other) == "succeeded", timeout=20,
                 what="another tenant's run on the only slot")
        assert "action=slot_forced_free" in pool.log()
        assert runpool.signal_run(conn, zombie, "go", {"n": 2}) == "delivered"
        wait_for(lambda: status_of(conn, zombie) in TERMINAL, timeout=20, what="resumed")
    row = run_row(conn, zombie)
    assert row["status"] == "succeeded", row["error"]
    assert row["result"] == {"payload": {"n": 2}, "attempt": 2}
    assert _violations(conn) == []


def test_a_child_deleted_after_it_ended__never_spawned_again_the_parent_fails_once(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    """parent_id has no foreign key: a purge of finished runs may delete a child whose parent
    still waits for its siblings. The resumed parent spawned it again (its call id found no
    child): the child ran twice, then the join failed on the changed set of children. Now the
    spawn is refused (invalid_input naming the call id, once), nothing runs twice; a join
    that cannot read a child's result fails the same way (it was a KeyError, retried)."""
    parent = runpool.enqueue(conn, "acme", "parent", {"children": 1, "child": {"seconds": 0.5}},
                             max_attempts=3)
    with running_pool(dsn, app=APP, retry_backoff_seconds=0.1) as pool:
        wait_for(lambda: status_of(conn, parent) == "waiting", timeout=30, what="joining")
        kid = scalar(conn, "SELECT id FROM runpool.runs WHERE parent_id = %s", parent)
        with psycopg.connect(dsn) as holder:
            # The parent's row held while its child ends: woken by a claim once free, by
            # then its child is gone (the purge's DELETE).
            holder.execute("SELECT 1 FROM runpool.runs WHERE id = %s FOR NO KEY UPDATE",
                           (parent,))
            wait_for(lambda: status_of(conn, kid) == "succeeded", timeout=30, what="child")
            conn.execute("DELETE FROM runpool.runs WHERE id = %s", (kid,))
        wait_for(lambda: status_of(conn, parent) in TERMINAL, timeout=30, what="ended")
        assert "action=run_internal_error" not in pool.log()
    row = run_row(conn, parent)
    assert (row["status"], row["error"]["reason"], row["attempt"]) == (
        "failed", "invalid_input", 2), row["error"]
    assert "call id c0" in row["error"]["message"], row["error"]
    assert scalar(conn, "SELECT count(*) FROM runpool.runs WHERE parent_id = %s", parent) == 0


def test_a_parent_at_its_tenants_quota_of_1__its_children_run_while_it_joins(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    """Held: the tenant's quota (not the pool's slots) is 1 and the parent holds it while it
    spawns; joining, it holds nothing, so its children take the quota one at a time: no
    deadlock."""
    conn.execute("SELECT runpool.set_tenant_quota('acme', 1)")
    parent = runpool.enqueue(conn, "acme", "parent", {"children": 3, "child": {"seconds": 0.3}})
    with running_pool(dsn, app=APP, concurrency=4):
        wait_for(lambda: status_of(conn, parent) in TERMINAL, timeout=45, what="ended")
    row = run_row(conn, parent)
    assert row["status"] == "succeeded", row["error"]
    assert [c["status"] for c in row["result"]["children"]] == ["succeeded"] * 3
    assert scalar(conn, "SELECT count(*) FROM runpool.runs WHERE parent_id = %s", parent) == 3
