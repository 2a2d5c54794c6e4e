"""Issue 15: durable waits and child runs — a waiting run holds no slot, lease or quota; it
comes back from checkpoints when its signal, time or children come, without re-executing what
it committed."""

from __future__ import annotations

import asyncio
import datetime
import functools
import signal
import tempfile
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

import runpool
import runpool.testing.invariants
from runpool.pools import open_pool
from runpool.queries import QUERIES
from runpool.status import collect
from tests.helpers import (
    assert_invariants,
    events,
    run_row,
    running_pool,
    scalar,
    status_of,
    wait_for,
)
from tests.otlp import Receiver

APP = "tests.wait_apps:app"
TERMINAL = ("succeeded", "failed", "cancelled")


def _is(conn: psycopg.Connection[Any], run_id: uuid.UUID, *statuses: str) -> bool:
    return status_of(conn, run_id) in statuses


def _waiting(conn: psycopg.Connection[Any], run_id: uuid.UUID, seconds: float = 30) -> None:
    wait_for(functools.partial(_is, conn, run_id, "waiting"), timeout=seconds,
             what=f"run {run_id} waiting")


def _waiting_in(conn: psycopg.Connection[Any], run_id: uuid.UUID, attempt: int) -> bool:
    row = run_row(conn, run_id)
    return bool(row["status"] == "waiting" and row["attempt"] == attempt)


def _ended(conn: psycopg.Connection[Any], run_id: uuid.UUID, seconds: float = 30) -> None:
    wait_for(functools.partial(_is, conn, run_id, *TERMINAL), timeout=seconds,
             what=f"run {run_id} ended")


def _executions(conn: psycopg.Connection[Any], run_id: uuid.UUID) -> dict[str, int]:
    return dict(conn.execute("SELECT call_id, count(*) FROM tool_log WHERE run_id = %s"
                             " GROUP BY call_id", (run_id,)).fetchall())


def _explain(conn: psycopg.Connection[Any], run_id: uuid.UUID,
             tenant: str | None = None) -> Any:
    return scalar(conn, "SELECT runpool.explain_run(%s, %s)", run_id, tenant)


def test_approval_flow__the_run_leaves_its_slot_and_continues_with_the_payload(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "approval", {})
    with running_pool(dsn, app=APP, concurrency=1) as pool:
        _waiting(conn, run_id)
        row = run_row(conn, run_id)
        # No lease, no quota used, one attempt ended without counting.
        assert row["lease_expires_at"] is None
        assert (row["attempt"], row["attempt_offset"]) == (1, 1)
        assert scalar(conn, "SELECT live FROM runpool.tenant_capacity WHERE tenant = 'acme'") == 0
        doc = _explain(conn, run_id)
        assert doc["status"] == "waiting"
        assert doc["waiting_for"]["kind"] == "signal" and doc["waiting_for"]["name"] == "approval"
        assert doc["summary"].startswith("waiting for signal approval since")
        # `status` counts it per tenant.
        assert collect(conn)["tenants"]["acme"]["waiting"] == 1
        # The pool's slot is free: another run goes through meanwhile.
        other = runpool.enqueue(conn, "acme", "child", {"n": 7})
        _ended(conn, other)
        assert runpool.signal_run(conn, run_id, "approval", {"approved": True}) == "delivered"
        _ended(conn, run_id)
        assert "action=run_internal_error" not in pool.log()
    row = run_row(conn, run_id)
    assert row["status"] == "succeeded", row["error"]
    assert row["result"] == {"payloads": [{"approved": True}], "attempt": 2}
    # The draft (before the wait) ran once; the send once, after the approval.
    assert _executions(conn, run_id) == {"draft": 1, "after0": 1, "send": 1}
    assert events(conn, run_id) == ["enqueued", "claimed", "waiting", "resumed", "claimed",
                                    "succeeded"]
    # Followers see it wait and resume (live runs' status events).
    assert list(conn.execute("SELECT status, reason FROM runpool.status_history"
                             " WHERE run_id = %s ORDER BY seq", (run_id,))) == [
        ("running", None), ("waiting", "signal"), ("queued", "resumed"), ("running", None),
        ("succeeded", None)]
    # Signalling a finished run stores nothing and says how it ended.
    assert runpool.signal_run(conn, run_id, "approval", {}) == "succeeded"
    assert scalar(conn, "SELECT count(*) FROM runpool.signals WHERE run_id = %s", run_id) == 1
    assert_invariants(conn)


def test_signal_before_wait__stored_then_consumed_by_that_wait(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "approval", {})
    # No pool yet: the run is queued, the signal is kept for it.
    assert runpool.signal_run(conn, run_id, "approval", {"approved": False}) == "stored"
    with running_pool(dsn, app=APP):
        _ended(conn, run_id)
    row = run_row(conn, run_id)
    assert row["status"] == "succeeded", row["error"]
    # Consumed by the first (and only) wait, without ever leaving the slot.
    assert row["result"] == {"payloads": [{"approved": False}], "attempt": 1}
    assert "waiting" not in events(conn, run_id)
    assert _executions(conn, run_id) == {"draft": 1, "after0": 1}
    assert scalar(conn, "SELECT consumed_by FROM runpool.signals WHERE run_id = %s", run_id) == 1
    assert_invariants(conn)


def test_many_waits_max_attempts_1__each_signal_consumed_once_nothing_re_executed(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    """Three waits for the same name with max_attempts=1: each wait consumes the next signal
    in arrival order (the third finds its signal stored and does not leave the slot); the
    run ends in its third attempt, only one of them counted."""
    run_id = runpool.enqueue(conn, "acme", "approval", {"waits": 3}, max_attempts=1)
    with running_pool(dsn, app=APP):
        for i in range(3):
            wait_for(functools.partial(_waiting_in, conn, run_id, i + 1), timeout=30,
                     what=f"wait {i + 1}")
            if i == 1:
                # Two signals at once: the second is kept for the third wait.
                assert runpool.signal_run(conn, run_id, "approval", {"n": 1}) == "delivered"
                assert runpool.signal_run(conn, run_id, "approval",
                                          {"n": 2, "approved": True}) == "stored"
                break
            assert runpool.signal_run(conn, run_id, "approval", {"n": i}) == "delivered"
        _ended(conn, run_id)
    row = run_row(conn, run_id)
    assert row["status"] == "succeeded", row["error"]
    assert row["result"]["payloads"] == [{"n": 0}, {"n": 1}, {"n": 2, "approved": True}]
    assert (row["attempt"], row["max_attempts"]) == (3, 1)
    assert _executions(conn, run_id) == {"draft": 1, "after0": 1, "after1": 1, "after2": 1,
                                         "send": 1}
    assert list(conn.execute("SELECT consumed_by FROM runpool.signals WHERE run_id = %s"
                             " ORDER BY id", (run_id,))) == [(1,), (2,), (3,)]
    assert_invariants(conn)


def test_wait_timeout__raises_WaitTimeout_caught_or_fails_without_retry(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    caught = runpool.enqueue(conn, "acme", "approval", {"timeout": 1, "catch_timeout": True})
    uncaught = runpool.enqueue(conn, "acme", "approval", {"timeout": 1})
    with running_pool(dsn, app=APP):
        _ended(conn, caught)
        _ended(conn, uncaught)
    row = run_row(conn, caught)
    assert row["status"] == "succeeded", row["error"]
    assert row["result"] == {"timed_out": True, "attempt": 2}
    row = run_row(conn, uncaught)
    assert row["status"] == "failed"
    assert row["error"]["reason"] == "wait_timeout"
    # One attempt waited, one timed out: no retry storm on a wait that stays timed out.
    assert row["attempt"] == 2
    # A signal after the timeout answers the terminal status; nothing is stored.
    assert runpool.signal_run(conn, uncaught, "approval", {}) == "failed"
    assert_invariants(conn)


@pytest.mark.parametrize("point", ["wait.committing", "wait.committed"])
def test_worker_sigkilled_around_the_wait_commit__the_run_still_finishes_once(
        conn: psycopg.Connection[Any], dsn: str, point: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "approval", {})
    with tempfile.TemporaryDirectory() as faults_dir, running_pool(
            dsn, app=APP, lease_seconds=2,
            env={"RUNPOOL_FAULTS": f"{point}=kill", "RUNPOOL_FAULTS_DIR": faults_dir}) as pool:
        # Killed before the commit: the lease expires and the next attempt waits; killed just
        # after it: the run is waiting already (no lease to expire).
        _waiting(conn, run_id)
        assert "fault point" in pool.log()
        assert runpool.signal_run(conn, run_id, "approval", {"approved": True}) == "delivered"
        _ended(conn, run_id)
    row = run_row(conn, run_id)
    assert row["status"] == "succeeded", row["error"]
    assert row["result"]["payloads"] == [{"approved": True}]
    assert _executions(conn, run_id) == {"draft": 1, "after0": 1, "send": 1}
    kinds = events(conn, run_id)
    assert kinds.count("waiting") == 1
    assert ("reclaimed" in kinds) == (point == "wait.committing")
    assert_invariants(conn)


def test_durable_sleep_on_a_concurrency_1_pool__other_runs_go_through(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    # lease 6 s: sleeps from 2 s on leave the slot.
    sleeper = runpool.enqueue(conn, "acme", "sleeper", {"seconds": 5})
    short = runpool.enqueue(conn, "acme", "sleeper", {"seconds": 0.5}, priority=-1)
    with running_pool(dsn, app=APP, concurrency=1, lease_seconds=6):
        _waiting(conn, sleeper)
        assert _explain(conn, sleeper)["summary"].startswith("sleeping until")
        others = [runpool.enqueue(conn, "acme", "child", {"n": n}) for n in range(3)]
        for other in others:
            _ended(conn, other, seconds=10)
        # The others ended while the sleeper still slept.
        assert status_of(conn, sleeper) == "waiting"
        _ended(conn, sleeper)
        _ended(conn, short)
    row = run_row(conn, sleeper)
    assert row["status"] == "succeeded", row["error"]
    assert row["finished_at"] - row["created_at"] >= datetime.timedelta(seconds=5)
    # The short sleep stayed in its slot (no wait committed for it).
    assert "waiting" not in events(conn, short)
    assert status_of(conn, short) == "succeeded"
    assert_invariants(conn)


def test_parent_joins_children_on_a_concurrency_1_pool__the_parent_left_its_slot(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    parent = runpool.enqueue(conn, "acme", "parent", {"children": 3, "child": {"seconds": 0.2}})
    with running_pool(dsn, app=APP, concurrency=1):
        _ended(conn, parent, seconds=45)
    row = run_row(conn, parent)
    assert row["status"] == "succeeded", row["error"]
    children = row["result"]["children"]
    assert [c["result"]["child"] for c in children] == [0, 1, 2]
    assert all(c["status"] == "succeeded" for c in children)
    for c in children:
        kid = run_row(conn, uuid.UUID(c["id"]))
        # Same tenant, linked, in the parent's trace (the parent had none: its run-derived one).
        assert (kid["tenant"], kid["parent_id"]) == ("acme", parent)
        assert kid["traceparent"].split("-")[1] == parent.hex
    assert "waiting" in events(conn, parent)
    assert_invariants(conn)


def test_duplicate_spawn_after_a_crash__one_child_per_call_id(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    parent = runpool.enqueue(conn, "acme", "parent", {"children": 2, "crash_after_spawn": 0})
    with running_pool(dsn, app=APP, lease_seconds=2):
        _ended(conn, parent, seconds=45)
    row = run_row(conn, parent)
    assert row["status"] == "succeeded", row["error"]
    kids = list(conn.execute("SELECT spawn_call_id, count(*) FROM runpool.runs"
                             " WHERE parent_id = %s GROUP BY 1 ORDER BY 1", (parent,)))
    assert kids == [("c0", 1), ("c1", 1)]
    assert "reclaimed" in events(conn, parent)
    assert_invariants(conn)


def test_cancel_cascades__a_waiting_parent_is_cancelled_at_once_and_its_children_too(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    parent = runpool.enqueue(conn, "acme", "parent", {"children": 2, "child": {"seconds": 60}})
    with running_pool(dsn, app=APP, concurrency=4, cancel_grace_seconds=1):
        _waiting(conn, parent)
        kids = [k for (k,) in conn.execute("SELECT id FROM runpool.runs WHERE parent_id = %s",
                                           (parent,))]
        assert len(kids) == 2
        assert scalar(conn, "SELECT runpool.cancel_run(%s, 'stop')", parent) == "cancelled"
        assert status_of(conn, parent) == "cancelled"
        for kid in kids:
            _ended(conn, kid, seconds=15)
            assert status_of(conn, kid) == "cancelled"
    assert scalar(conn, "SELECT state FROM runpool.waits WHERE run_id = %s", parent) \
        == "cancelled"
    assert_invariants(conn)


def test_another_tenants_run__signal_and_explain_answer_null_nothing_stored(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "approval", {})
    with running_pool(dsn, app=APP):
        _waiting(conn, run_id)
        assert runpool.signal_run(conn, run_id, "approval", {"approved": True},
                                  tenant="globex") is None
        assert runpool.signal_run(conn, uuid.uuid4(), "approval", {}) is None
        assert _explain(conn, run_id, "globex") is None
        assert scalar(conn, "SELECT count(*) FROM runpool.signals") == 0
        assert status_of(conn, run_id) == "waiting"
        # Its own tenant's signal goes through.
        assert runpool.signal_run(conn, run_id, "approval", {}, tenant="acme") == "delivered"
        _ended(conn, run_id)
    assert status_of(conn, run_id) == "succeeded"


def test_bad_signal_names_and_payloads__clear_errors_nothing_written(
        conn: psycopg.Connection[Any]) -> None:
    run_id = runpool.enqueue(conn, "acme", "approval", {})
    for name in ("", "x" * 201, "a\x00b", None):
        with pytest.raises(runpool.InvalidInput, match="name"):
            runpool.signal_run(conn, run_id, name, {})  # type: ignore[arg-type]
    with pytest.raises(runpool.InvalidInput):
        runpool.signal_run(conn, run_id, "approval", {"a": {1, 2}})
    with pytest.raises(runpool.InvalidInput, match="payload is"):
        runpool.signal_run(conn, run_id, "approval", {"big": "x" * (2 << 20)})
    with pytest.raises(runpool.InvalidInput, match="not a run id"):
        runpool.signal_run(conn, "nope", "approval", {})
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="payload must be"):
        conn.execute("SELECT runpool.signal_run(%s, 'approval', NULL)", (run_id,))
    assert scalar(conn, "SELECT count(*) FROM runpool.signals") == 0
    # A sender in a loop fills only this run's budget of stored signals.
    conn.execute("SELECT runpool.signal_run(%s, 'spam', to_jsonb(i))"
                 " FROM generate_series(1, runpool.max_stored_signals()) i", (run_id,))
    with pytest.raises(runpool.InvalidInput, match="signals not consumed yet"):
        runpool.signal_run(conn, run_id, "spam", {})
    other = runpool.enqueue(conn, "acme", "approval", {})
    assert runpool.signal_run(conn, other, "spam", {}) == "stored"


def test_bad_waits_in_handlers__the_run_fails_alone_the_worker_goes_on(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    stranger = runpool.enqueue(conn, "acme", "child", {})
    bad = [
        runpool.enqueue(conn, "acme", "bad_wait", {"name": ""}),
        runpool.enqueue(conn, "acme", "bad_wait", {"name": "x" * 500}),
        runpool.enqueue(conn, "acme", "bad_wait", {"name": "ok", "timeout": -1}),
        runpool.enqueue(conn, "acme", "bad_wait", {"name": "ok", "timeout": "soon"}),
        runpool.enqueue(conn, "acme", "stray_join", {"other": str(stranger)}),
        runpool.enqueue(conn, "acme", "stray_join", {"other": "not-a-uuid"}),
        # A run with a serial key cannot wait (it would have to keep its key).
        runpool.enqueue(conn, "acme", "bad_wait", {"name": "ok"}, serial_key="k"),
    ]
    with running_pool(dsn, app=APP):
        for run_id in bad:
            _ended(conn, run_id)
        good = runpool.enqueue(conn, "acme", "child", {"n": 1})
        _ended(conn, good)
    for run_id in bad:
        row = run_row(conn, run_id)
        assert (row["status"], row["error"]["reason"]) == ("failed", "invalid_input"), row
        assert row["attempt"] == 1
    assert status_of(conn, good) == "succeeded"
    assert scalar(conn, "SELECT count(*) FROM runpool.waits") == 0
    assert_invariants(conn)


def test_wait_arguments_checked_before_anything_is_written() -> None:
    async def main() -> None:
        run = runpool.Run(id=uuid.uuid4(), tenant="acme", handler="h", attempt=1, input={})
        for timeout in (float("inf"), float("nan"), -0.5, True, "1", 10 ** 12):
            with pytest.raises(runpool.InvalidInput, match="timeout"):
                await run.wait_for("ok", timeout=timeout)  # type: ignore[arg-type]
        with pytest.raises(runpool.InvalidInput, match="sleep"):
            await run.sleep(-1)
        with pytest.raises(runpool.InvalidInput, match="1 to 10000"):
            await run.join([])
        with pytest.raises(runpool.InvalidInput, match="not one string"):
            await run.join(str(uuid.uuid4()))
        with pytest.raises(runpool.InvalidInput, match="unknown option"):
            await run.spawn("c1", "child", {}, serial_key="k", tenant="other")
        # Valid arguments reach the database, which a hand-made Run does not have.
        with pytest.raises(runpool.UsageError, match="not attached"):
            await run.wait_for("ok", timeout=1)

    asyncio.run(main())


def test_parent_row_held_by_an_open_transaction__children_end_and_the_parent_wakes_later(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    """A caller's open transaction holding the parent's row must not stall the worker ending
    its children (their outcome batch), nor lose the parent's wake-up."""
    parent = runpool.enqueue(conn, "acme", "parent", {"children": 2, "child": {"seconds": 1}})
    with running_pool(dsn, app=APP, concurrency=4) as pool, \
            psycopg.connect(dsn) as holder:
        _waiting(conn, parent)
        holder.execute("SELECT 1 FROM runpool.runs WHERE id = %s FOR NO KEY UPDATE", (parent,))
        kids = [k for (k,) in conn.execute("SELECT id FROM runpool.runs WHERE parent_id = %s",
                                           (parent,))]
        for kid in kids:
            _ended(conn, kid, seconds=15)
        # The last child's end found the parent's row taken: left to the next claim.
        assert scalar(conn, "SELECT count(*) FROM runpool.join_checks WHERE parent_id = %s",
                      parent) >= 1
        assert status_of(conn, parent) == "waiting"
        holder.rollback()
        # A claim (the poll, at most poll_seconds later) wakes it.
        _ended(conn, parent, seconds=15)
        assert "action=run_internal_error" not in pool.log()
    assert status_of(conn, parent) == "succeeded"
    assert scalar(conn, "SELECT count(*) FROM runpool.join_checks") == 0
    assert_invariants(conn)


def test_invariants_see_a_broken_wait(conn: psycopg.Connection[Any]) -> None:
    run_id = runpool.enqueue(conn, "acme", "approval", {})
    assert runpool.signal_run(conn, run_id, "approval", {"n": 1}) == "stored"
    assert runpool.signal_run(conn, run_id, "approval", {"n": 2}) == "stored"
    # A wait that says it was signalled but consumed nothing.
    conn.execute("INSERT INTO runpool.waits (run_id, seq, kind, name, attempt, state, payload,"
                 " resolved_at) VALUES (%s, 1, 'signal', 'approval', 1, 'signalled',"
                 " '{\"n\": 1}', now())", (run_id,))
    report = runpool.testing.invariants.check(conn, all_terminal=False)
    assert any("consumed 0 signals" in v for v in report.violations), report.violations
    conn.execute("UPDATE runpool.signals SET consumed_by = 1, consumed_at = now()"
                 " WHERE payload = '{\"n\": 2}'")
    report = runpool.testing.invariants.check(conn, all_terminal=False)
    assert any("not the payload it returned" in v for v in report.violations)
    # One signal per wait: the database refuses a second consumption by the same wait.
    with pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute("UPDATE runpool.signals SET consumed_by = 1, consumed_at = now()"
                     " WHERE run_id = %s AND consumed_by IS NULL", (run_id,))


# -- races at the SQL level, on several real connections -----------------------------------

def _running(conn: psycopg.Connection[Any], handler: str = "approval") -> uuid.UUID:
    """A run as a claim leaves it: running, attempt 1, with a lease."""
    run_id = runpool.enqueue(conn, "acme", handler, {})
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1, started_at = now(),"
                 " lease_expires_at = now() + interval '1 minute' WHERE id = %s", (run_id,))
    return run_id


def _wait_sql(conn: psycopg.Connection[Any], run_id: uuid.UUID, seq: int, kind: str,
              name: str | None = None, children: list[uuid.UUID] | None = None) -> str:
    return str(scalar(conn, "SELECT state FROM runpool._wait(%s, 1, %s, %s, %s, %s::uuid[],"
                            " NULL, 0)", run_id, seq, kind, name, children))


def test_concurrent_signals__exactly_one_delivered_the_rest_stored(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    run_id = _running(conn)
    assert _wait_sql(conn, run_id, 1, "signal", "go") == "waiting"
    start = threading.Barrier(8)

    def send(n: int) -> str | None:
        with psycopg.connect(dsn, autocommit=True) as own:
            start.wait()
            return runpool.signal_run(own, run_id, "go", {"n": n})

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, range(8)))
    assert sorted(a or "" for a in answers) == ["delivered"] + ["stored"] * 7
    assert status_of(conn, run_id) == "queued"
    consumed = scalar(conn, "SELECT payload FROM runpool.signals WHERE run_id = %s"
                            " AND consumed_by = 1", run_id)
    assert scalar(conn, "SELECT payload FROM runpool.waits WHERE run_id = %s", run_id) \
        == consumed
    assert_invariants(conn, all_terminal=False)


def test_a_child_ending_while_its_parent_commits_its_join__the_parent_always_wakes(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    parent = _running(conn, "parent")
    kids = [uuid.UUID(str(scalar(conn, "SELECT runpool._spawn(%s, 1, %s, 'child')",
                                 parent, f"c{n}"))) for n in range(2)]
    end = ("UPDATE runpool.runs SET status = 'succeeded', finished_at = now() WHERE id = %s")
    with psycopg.connect(dsn) as child_tx, psycopg.connect(dsn) as parent_tx:
        # The first child ends in a transaction still open (its trigger holds the parent's
        # row); the parent's join commit waits for it, then sees that child ended.
        child_tx.execute(end, (kids[0],))
        joined = ThreadPoolExecutor(1).submit(_wait_sql, parent_tx, parent, 1, "join",
                                              None, kids)
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM pg_stat_activity WHERE"
                                      " datname = current_database()"
                                      " AND wait_event_type = 'Lock'") >= 1,
                 what="the join commit waiting for the child's transaction")
        child_tx.commit()
        assert joined.result(timeout=10) == "waiting"
        parent_tx.commit()
        # The other order: the parent's row held open while the last child ends (its end is
        # not held up; the next claim's wake_due wakes the parent).
        parent_tx.execute("SELECT 1 FROM runpool.runs WHERE id = %s FOR NO KEY UPDATE",
                          (parent,))
        child_tx.execute(end, (kids[1],))
        child_tx.commit()
        assert status_of(conn, parent) == "waiting"
        parent_tx.commit()
    assert scalar(conn, QUERIES["wake_due"]) == 1
    assert status_of(conn, parent) == "queued"
    assert scalar(conn, "SELECT state FROM runpool.waits WHERE run_id = %s", parent) == "joined"
    # (The children were ended by hand, without the events an outcome writes.)
    report = runpool.testing.invariants.check(conn, all_terminal=False)
    assert [v for v in report.violations if "terminal events" not in v] == []


def test_a_run_asked_to_stop_does_not_start_waiting__it_ends_cancelled(
        conn: psycopg.Connection[Any]) -> None:
    run_id = _running(conn)
    assert scalar(conn, "SELECT runpool.cancel_run(%s, 'stop')", run_id) == "cancelling"
    # Its handler reaches a wait before the worker acted on the cancel.
    assert _wait_sql(conn, run_id, 1, "signal", "go") == "cancelled"
    row = run_row(conn, run_id)
    assert (row["status"], row["lease_expires_at"]) == ("cancelled", None)
    assert events(conn, run_id)[-1] == "cancelled"
    assert runpool.signal_run(conn, run_id, "go", {}) == "cancelled"
    assert scalar(conn, "SELECT state FROM runpool.waits WHERE run_id = %s", run_id) \
        == "cancelled"


def test_trace__a_parent_and_its_children_are_one_trace(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    trace_id, parent_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    parent = scalar(conn, "SELECT runpool.enqueue('acme', 'parent', %s, traceparent => %s)",
                    # Children slower than the parent's join, so that the join waits (and
                    # the parent resumes in a second attempt) however fast its spawns commit.
                    Jsonb({"children": 2, "child": {"seconds": 0.5}}),
                    f"00-{trace_id}-{parent_span}-01")
    receiver = Receiver()
    try:
        endpoint = receiver.start()
        with running_pool(dsn, app=APP, env={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                                             "OTEL_SERVICE_NAME": "runpool-test",
                                             "OTEL_BSP_SCHEDULE_DELAY": "50"}) as pool:
            _ended(conn, parent)
            pool.send_signal(signal.SIGTERM)  # workers flush their spans on the way out
            assert pool.wait(timeout=30) == 0
        spans = receiver.spans
    finally:
        receiver.close()
    assert status_of(conn, parent) == "succeeded"
    process = {(s.attributes["runpool.run.id"], s.attributes["runpool.run.attempt"]): s
               for s in spans if s.name.startswith("process ")}
    first, resumed = process[(str(parent), 1)], process[(str(parent), 2)]
    assert first.attributes["runpool.run.outcome"] == "waiting"
    assert resumed.attributes["runpool.run.outcome"] == "succeeded"
    kids = [k for (k,) in conn.execute("SELECT id FROM runpool.runs WHERE parent_id = %s",
                                       (parent,))]
    # The handler of the attempt that spawned them: its invoke_agent span, in the first
    # attempt's process span.
    (agent,) = [s for s in spans if s.name == "invoke_agent parent"
                and s.parent_span_id == first.span_id]
    for kid in kids:
        span = process[(str(kid), 1)]
        # In the parent's trace, under the attempt that spawned it.
        assert (span.trace_id, span.parent_span_id) == (trace_id, agent.span_id)
    assert {first.trace_id, resumed.trace_id} == {trace_id}


def test_a_waiting_run_past_its_deadline__the_sweep_fails_it_and_closes_its_wait(
        conn: psycopg.Connection[Any]) -> None:
    run_id = _running(conn)
    assert _wait_sql(conn, run_id, 1, "signal", "go") == "waiting"
    conn.execute("UPDATE runpool.runs SET deadline = now() - interval '1 second' WHERE id = %s",
                 (run_id,))
    conn.execute(QUERIES["expire_deadlines"])
    row = run_row(conn, run_id)
    assert (row["status"], row["error"]["reason"]) == ("failed", "deadline_exceeded")
    assert scalar(conn, "SELECT state FROM runpool.waits WHERE run_id = %s", run_id) \
        == "cancelled"
    assert runpool.signal_run(conn, run_id, "go", {}) == "failed"


def test_spawn_takes_enqueue_options__checked_as_enqueue_checks_them(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    parent = _running(conn, "parent")

    async def main() -> None:
        pool = await open_pool(dsn, size=1, name="test-spawn")
        try:
            run = runpool.Run(id=parent, tenant="acme", handler="parent", attempt=1, input={},
                              pool=pool)
            child = await run.spawn("c1", "child", {"n": 1}, priority=3, max_attempts=2,
                                    timeout=30, budget={"max_tool_calls": 5})
            # Once per call id, whatever the repeat says.
            assert await run.spawn("c1", "child", {"n": 2}) == child
            row = run_row(conn, child)
            assert (row["tenant"], row["parent_id"], row["spawn_call_id"]) == (
                "acme", parent, "c1")
            assert (row["priority"], row["max_attempts"], row["budget"]) == (
                3, 2, {"max_tool_calls": 5})
            assert row["attempt_timeout"] == datetime.timedelta(seconds=30)
            for bad in ({"priority": 500}, {"budget": {"max_tokens": -1}},
                        {"timeout": float("nan")}):
                with pytest.raises(runpool.InvalidInput):
                    await run.spawn("c2", "child", {}, **bad)
            with pytest.raises(runpool.InvalidInput, match="handler"):
                await run.spawn("c3", "", {})
        finally:
            await pool.close()

    asyncio.run(main())
    assert scalar(conn, "SELECT count(*) FROM runpool.runs WHERE parent_id = %s", parent) == 1


def test_a_pool_logged_in_with_only_the_worker_role__waits_spawns_and_wakes(
        conn: psycopg.Connection[Any], dsn: str) -> None:
    login = f"rp_worker_{uuid.uuid4().hex[:10]}"
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE runpool_worker").format(
        sql.Identifier(login)))
    conn.execute(sql.SQL("GRANT INSERT ON tool_log TO {}").format(sql.Identifier(login)))
    try:
        params = psycopg.conninfo.conninfo_to_dict(dsn)
        params["user"] = login
        worker_dsn = psycopg.conninfo.make_conninfo(**params)  # type: ignore[arg-type]
        approval = runpool.enqueue(conn, "acme", "approval", {})
        parent = runpool.enqueue(conn, "acme", "parent", {"children": 2})
        sleeper = runpool.enqueue(conn, "acme", "sleeper", {"seconds": 2.5})
        timed = runpool.enqueue(conn, "acme", "approval", {"timeout": 1, "catch_timeout": True})
        late = runpool.enqueue(conn, "acme", "approval", {}, deadline=datetime.datetime.now(
            datetime.UTC) + datetime.timedelta(seconds=3))
        with running_pool(worker_dsn, app=APP, lease_seconds=6):
            _waiting(conn, approval)
            assert runpool.signal_run(conn, approval, "approval", {"approved": True}) \
                == "delivered"
            for run_id in (approval, parent, sleeper, timed, late):
                _ended(conn, run_id)
        assert [status_of(conn, r) for r in (approval, parent, sleeper, timed, late)] == [
            "succeeded", "succeeded", "succeeded", "succeeded", "failed"]
        assert run_row(conn, late)["error"]["reason"] == "deadline_exceeded"
        assert_invariants(conn)
    finally:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(login)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(login)))
