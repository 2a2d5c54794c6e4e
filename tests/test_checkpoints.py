"""Checkpoints: tool results committed with their messages; resume instead of replay."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

import checkpoints
import runpool
from runpool.db import aconnect
from tests.helpers import assert_invariants, events, run_row, running_pool, scalar, wait_for


def _done(conn: psycopg.Connection, run_id: uuid.UUID) -> bool:
    return run_row(conn, run_id)["status"] in ("succeeded", "failed", "cancelled")


def _executions(conn: psycopg.Connection, run_id: uuid.UUID) -> dict[str, int]:
    return dict(conn.execute("SELECT call_id, count(*) FROM tool_log WHERE run_id = %s"
                             " GROUP BY call_id", (run_id,)).fetchall())


def _model_calls(conn: psycopg.Connection, run_id: uuid.UUID) -> int:
    return int(scalar(conn, "SELECT count(*) FROM model_calls WHERE run_id = %s", run_id))


def test_agent__messages_and_checkpoints_committed_linearly(conn: psycopg.Connection,
                                                           dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "agent", {"steps": 4})
    with running_pool(dsn):
        wait_for(lambda: _done(conn, run_id), what="agent run")
    assert run_row(conn, run_id)["result"] == {"turns": 4, "messages": 8}
    rows = conn.execute("SELECT seq, role, content, call_id FROM runpool.messages"
                        " WHERE run_id = %s ORDER BY seq", (run_id,)).fetchall()
    assert [r[0] for r in rows] == list(range(1, 9))
    assert [r[1] for r in rows] == ["assistant", "tool"] * 4
    # Each row holds one step, not the history so far: storage grows linearly.
    assert rows[7][2] == {"found": 30} and rows[7][3] == "c3"
    calls = conn.execute("SELECT call_id, status, result, executions, attempt"
                         " FROM runpool.tool_calls WHERE run_id = %s ORDER BY call_id",
                         (run_id,)).fetchall()
    assert calls == [(f"c{i}", "succeeded", {"found": i * 10}, 1, 1) for i in range(4)]
    keys = {k for (k,) in conn.execute("SELECT key FROM tool_log WHERE run_id = %s",
                                       (run_id,))}
    assert keys == {f"{run_id}:c{i}" for i in range(4)}


def test_crash_right_after_a_commit__resumes_without_repeating_tools_or_model_turns(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "agent", {"steps": 5, "crash_after": 2})
    with running_pool(dsn, lease_seconds=1.5):
        wait_for(lambda: _done(conn, run_id), timeout=30, what="resumed run")
    row = run_row(conn, run_id)
    assert (row["status"], row["attempt"]) == ("succeeded", 2)
    assert _executions(conn, run_id) == {f"c{i}": 1 for i in range(5)}
    assert _model_calls(conn, run_id) == 5
    assert row["result"] == {"turns": 5, "messages": 10}
    assert events(conn, run_id) == ["enqueued", "claimed", "reclaimed", "claimed", "succeeded"]
    assert_invariants(conn)


def test_crash_mid_tool_call__retried_when_the_tool_allows_it(conn: psycopg.Connection,
                                                             dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "agent", {"steps": 4, "crash_in_tool": 2})
    with running_pool(dsn, lease_seconds=1.5):
        wait_for(lambda: _done(conn, run_id), timeout=30, what="resumed run")
    assert run_row(conn, run_id)["status"] == "succeeded"
    assert _executions(conn, run_id) == {"c0": 1, "c1": 1, "c2": 2, "c3": 1}
    assert scalar(conn, "SELECT executions FROM runpool.tool_calls WHERE run_id = %s"
                  " AND call_id = 'c2'", run_id) == 2
    assert _model_calls(conn, run_id) == 4
    assert_invariants(conn)


def test_crash_mid_unsafe_tool_call__agent_told_outcome_unknown_never_a_duplicate(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "agent",
                             {"steps": 4, "crash_in_tool": 2, "unsafe": True})
    with running_pool(dsn, lease_seconds=1.5):
        wait_for(lambda: _done(conn, run_id), timeout=30, what="resumed run")
    assert run_row(conn, run_id)["status"] == "succeeded"
    assert _executions(conn, run_id) == {"c0": 1, "c1": 1, "c2": 1, "c3": 1}
    status = conn.execute("SELECT call_id, status FROM runpool.tool_calls WHERE run_id = %s"
                          " ORDER BY call_id", (run_id,)).fetchall()
    assert status == [("c0", "succeeded"), ("c1", "succeeded"), ("c2", "unknown"),
                      ("c3", "succeeded")]
    notes = [c for (c,) in conn.execute("SELECT content FROM runpool.messages"
                                        " WHERE run_id = %s AND role = 'user'", (run_id,))]
    assert notes == [{"note": "c2 may or may not have happened"}]
    assert_invariants(conn)


def test_tool_raising__error_is_the_committed_result_and_never_rerun(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "agent",
                             {"steps": 3, "raise_in_tool": 1, "crash_after": 2})
    with running_pool(dsn, lease_seconds=1.5):
        wait_for(lambda: _done(conn, run_id), timeout=30, what="run")
    assert run_row(conn, run_id)["status"] == "succeeded"
    result = scalar(conn, "SELECT result FROM runpool.tool_calls WHERE run_id = %s"
                    " AND call_id = 'c1'", run_id)
    assert result == {"error": {"type": "LookupError", "message": "nothing found for 1"}}
    assert _executions(conn, run_id) == {"c0": 1, "c1": 1, "c2": 1}
    assert_invariants(conn)


def test_tool_result_too_big_or_with_nul__committed_as_an_error_the_model_sees(
        conn: psycopg.Connection, dsn: str) -> None:
    big = runpool.enqueue(conn, "acme", "agent", {"steps": 1, "extra": {"b": "x" * 5000}})
    nul = runpool.enqueue(conn, "acme", "agent", {"steps": 1, "nul_in_result": True})
    lone = runpool.enqueue(conn, "acme", "agent", {"steps": 1, "surrogate_in_result": True})
    # An orjson.Fragment whose text would close this result's element of a batch's JSON array
    # and open another's (a write forged for another run).
    spliced = runpool.enqueue(conn, "acme", "agent", {"steps": 1, "fragment_in_result": (
        f'1}}}},{{"run_id":"{big}","attempt":1,"call_id":"c0","status":"done","result":{{"a":2')})
    with running_pool(dsn, max_message_bytes=4096):
        wait_for(lambda: all(_done(conn, r) for r in (big, nul, lone, spliced)), what="runs")
    for run_id, why in ((big, "over the limit of 4096 bytes"), (nul, "NUL character"),
                        (lone, "surrogate"), (spliced, "not one JSON value")):
        result = scalar(conn, "SELECT result FROM runpool.tool_calls WHERE run_id = %s", run_id)
        assert result["error"]["type"] == "ResultRejected"
        assert why in result["error"]["message"]
        # The model saw the error as the tool's message, and the run went on to finish.
        assert scalar(conn, "SELECT content FROM runpool.messages WHERE run_id = %s"
                      " AND role = 'tool'", run_id) == result
        assert run_row(conn, run_id)["status"] == "succeeded"


def test_oversized_message__fails_the_run_once_without_retries(conn: psycopg.Connection,
                                                               dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "big_message", max_attempts=5)
    with running_pool(dsn):
        wait_for(lambda: _done(conn, run_id), what="run")
    row = run_row(conn, run_id)
    assert (row["status"], row["attempt"], row["error"]["reason"]) == (
        "failed", 1, "invalid_input")
    assert "over the limit" in row["error"]["message"]


def test_sync_handler__uses_the_same_checkpoints(conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "agent_sync")
    with running_pool(dsn):
        wait_for(lambda: _done(conn, run_id), what="run")
    assert run_row(conn, run_id)["result"] == {"result": {"found": 0}}
    assert scalar(conn, "SELECT count(*) FROM runpool.messages WHERE run_id = %s", run_id) == 2


# -- the store itself -----------------------------------------------------------------------

def _running(conn: psycopg.Connection, attempt: int = 1) -> uuid.UUID:
    run_id = runpool.enqueue(conn, "acme", "noop")
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = %s,"
                 " lease_expires_at = now() + interval '1 minute' WHERE id = %s",
                 (attempt, run_id))
    return run_id


def test_store__a_fenced_attempt_writes_nothing(conn: psycopg.Connection, dsn: str) -> None:
    run_id = _running(conn)

    async def main() -> None:
        async with await aconnect(dsn, autocommit=True) as c:
            await checkpoints.record_tool_intent(c, run_id, 1, "c0", "t", Jsonb({}))
            await checkpoints.append_message(c, run_id, 1, "assistant", Jsonb("hi"))
            # Reclaimed: attempt 2 holds the run now. Attempt 1 is a zombie.
            await c.execute("UPDATE runpool.runs SET attempt = 2 WHERE id = %s", (run_id,))
            with pytest.raises(runpool.LeaseLost):
                await checkpoints.append_message(c, run_id, 1, "assistant", Jsonb("late"))
            with pytest.raises(runpool.LeaseLost):
                await checkpoints.commit_tool_result(
                    c, run_id, 1, "c0", status="succeeded", result=Jsonb(1),
                    message_role="tool", message_content=Jsonb(1))
            await checkpoints.append_message(c, run_id, 2, "assistant", Jsonb("new"))

    asyncio.run(main())
    assert conn.execute("SELECT seq, content, attempt FROM runpool.messages ORDER BY seq"
                        ).fetchall() == [(1, "hi", 1), (2, "new", 2)]
    assert conn.execute("SELECT status, result FROM runpool.tool_calls").fetchall() == [
        ("started", None)]


def test_store__a_write_numbers_its_events_once_and_a_row_written_without_gets_its_own(
        conn: psycopg.Connection, dsn: str) -> None:
    # 0018: the worker's statements take their event seqs themselves; the triggers number only
    # rows written without one (an operator's INSERT, resolve_tool_call, older code).
    run_id = _running(conn)  # its 'running' is event 2

    async def main() -> None:
        async with await aconnect(dsn, autocommit=True) as c:
            await checkpoints.record_tool_intent(c, run_id, 1, "c0", "t", Jsonb({}))  # 3
            await checkpoints.commit_tool_result(  # 4: the call's close, 5: its message
                c, run_id, 1, "c0", status="succeeded", result=Jsonb(1),
                message_role="tool", message_content=Jsonb(1))
            await c.execute("INSERT INTO runpool.messages (run_id, seq, role, content, attempt)"
                            " VALUES (%s, 2, 'note', '\"by hand\"', 1)", (run_id,))  # 6
            await checkpoints.append_message(c, run_id, 1, "assistant", Jsonb("hi"))  # 7
            await checkpoints.record_tool_intent(c, run_id, 1, "c1", "t", Jsonb({}))  # 8

    asyncio.run(main())
    assert conn.execute("SELECT seq, event_seq FROM runpool.messages ORDER BY seq"
                        ).fetchall() == [(1, 5), (2, 6), (3, 7)]
    assert conn.execute("SELECT call_id, started_seq, finished_seq FROM runpool.tool_calls"
                        " ORDER BY call_id").fetchall() == [("c0", 3, 4), ("c1", 8, None)]
    assert scalar(conn, "SELECT seq FROM runpool.event_seqs WHERE run_id = %s", run_id) == 8
    # A status change after them takes the next one.
    conn.execute("UPDATE runpool.runs SET status = 'succeeded', finished_at = now(),"
                 " lease_expires_at = NULL"
                 " WHERE id = %s", (run_id,))
    assert scalar(conn, "SELECT seq FROM runpool.event_seqs WHERE run_id = %s", run_id) == 9


def test_store__result_message_and_checkpoint_commit_together(conn: psycopg.Connection,
                                                              dsn: str) -> None:
    run_id = _running(conn)

    async def main() -> None:
        async with await aconnect(dsn, autocommit=True) as c:
            await checkpoints.record_tool_intent(c, run_id, 1, "c0", "t", Jsonb({}))
            # The message insert fails (role too long): the result must not land either.
            with pytest.raises(psycopg.errors.CheckViolation):
                await checkpoints.commit_tool_result(
                    c, run_id, 1, "c0", status="succeeded", result=Jsonb(1),
                    message_role="x" * 65, message_content=Jsonb(1))

    asyncio.run(main())
    assert conn.execute("SELECT status, result FROM runpool.tool_calls").fetchall() == [
        ("started", None)]
    assert scalar(conn, "SELECT count(*) FROM runpool.messages") == 0


def test_store__joins_the_callers_transaction(conn: psycopg.Connection, dsn: str) -> None:
    run_id = _running(conn)

    async def main() -> Any:
        async with await aconnect(dsn) as c:  # not autocommit: the caller's transaction
            await checkpoints.append_message(c, run_id, 1, "assistant", Jsonb("maybe"))
            await c.rollback()
            await checkpoints.append_message(c, run_id, 1, "assistant", Jsonb("kept"))
            await c.commit()

    asyncio.run(main())
    assert [c for (c,) in conn.execute("SELECT content FROM runpool.messages")] == ["kept"]


def test_store__load_returns_what_was_committed(conn: psycopg.Connection, dsn: str) -> None:
    run_id = _running(conn)

    async def main() -> Any:
        async with await aconnect(dsn, autocommit=True) as c:
            await checkpoints.append_message(c, run_id, 1, "assistant", Jsonb({"t": 0}))
            await checkpoints.record_tool_intent(c, run_id, 1, "c0", "t", Jsonb({"a": 1}))
            await checkpoints.commit_tool_result(
                c, run_id, 1, "c0", status="succeeded", result=Jsonb({"r": 1}),
                message_role="tool", message_content=Jsonb({"r": 1}))
            await checkpoints.record_tool_intent(c, run_id, 1, "c1", "t", Jsonb({"a": 2}))
            return await checkpoints.load(c, run_id)

    messages, calls = asyncio.run(main())
    assert [(m.seq, m.role, m.content, m.call_id) for m in messages] == [
        (1, "assistant", {"t": 0}, None), (2, "tool", {"r": 1}, "c0")]
    assert calls["c0"].committed and calls["c0"].result == {"r": 1}
    assert calls["c1"].status == "started" and not calls["c1"].committed


def test_zombie__a_stopped_worker_resumed_after_a_reclaim_writes_nothing(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "agent", {"steps": 8, "tool_seconds": 0.5})
    with running_pool(dsn, lease_seconds=1.2) as first:
        # Stopped while c1 runs (its execution recorded, the tool sleeping): a stop that lands
        # before the tool has recorded its execution would make the zombie's in-flight call
        # look started after attempt 2 committed it (see test_zombie__resumed_between...).
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM tool_log WHERE run_id = %s"
                                " AND call_id = 'c1'", run_id), interval=0.01, what="c1 running")
        pid = scalar(conn, "SELECT w.pid FROM runpool.workers w JOIN runpool.runs r"
                     " ON r.worker_id = w.id WHERE r.id = %s", run_id)
        os.kill(pid, signal.SIGSTOP)
        try:
            with running_pool(dsn, lease_seconds=1.2):
                # Another worker reclaims the run and makes progress with attempt 2.
                wait_for(lambda: scalar(conn, "SELECT count(*) FROM runpool.messages"
                                        " WHERE run_id = %s AND attempt = 2", run_id) >= 2,
                         timeout=30, what="attempt 2 progress")
                os.kill(pid, signal.SIGCONT)
                wait_for(lambda: "action=lease_lost" in first.log(), what="zombie notices")
                wait_for(lambda: _done(conn, run_id), timeout=30, what="run finished")
        finally:
            os.kill(pid, signal.SIGCONT)
    assert run_row(conn, run_id)["status"] == "succeeded"
    reclaimed_at = scalar(conn, "SELECT at FROM runpool.run_events WHERE run_id = %s"
                          " AND kind = 'reclaimed'", run_id)
    late = scalar(conn, "SELECT count(*) FROM runpool.messages WHERE run_id = %s"
                  " AND attempt = 1 AND created_at >= %s", run_id, reclaimed_at)
    assert late == 0
    # Every committed call ran once; only the call in flight at the stop may have run twice.
    executions = _executions(conn, run_id)
    assert sorted(executions) == sorted(f"c{i}" for i in range(8))
    assert sum(n - 1 for n in executions.values()) <= 1
    assert_invariants(conn)


def test_zombie__resumed_between_a_tool_intent_and_the_tool__does_not_start_the_tool(
        conn: psycopg.Connection, dsn: str) -> None:
    """The worker stops itself right after c1's intent committed (the answer to the intent
    write read late: a paused process, a slow network); a new attempt runs c1 meanwhile. On
    resume the lease has run out by the local clock: the zombie must not start c1 again."""
    run_id = runpool.enqueue(conn, "acme", "agent", {"steps": 3})
    with running_pool(dsn, lease_seconds=1.2,
                      env={"RUNPOOL_FAULTS": "tool.intended=stop@2"}) as first:
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM runpool.tool_calls WHERE run_id = %s"
                                " AND call_id = 'c1'", run_id), what="c1's intent")
        pid = scalar(conn, "SELECT w.pid FROM runpool.workers w JOIN runpool.runs r"
                     " ON r.worker_id = w.id WHERE r.id = %s", run_id)
        try:
            with running_pool(dsn, lease_seconds=1.2):
                wait_for(lambda: _done(conn, run_id), timeout=30, what="run finished")
            os.kill(pid, signal.SIGCONT)
            wait_for(lambda: "action=lease_lost" in first.log(), what="zombie notices")
        finally:
            os.kill(pid, signal.SIGCONT)
    assert run_row(conn, run_id)["attempt"] == 2
    # c1 was started by attempt 1 and never committed: attempt 2 ran it; the zombie did not.
    assert conn.execute("SELECT call_id, attempt FROM tool_log WHERE run_id = %s"
                        " ORDER BY at", (run_id,)).fetchall() == [
        ("c0", 1), ("c1", 2), ("c2", 2)]
    assert_invariants(conn)


def test_connections_killed_during_checkpoint_commits__each_call_committed_once(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "agent", {"steps": 30}, max_attempts=50)

    def progressed_beyond(seen: int) -> int:
        now = int(scalar(conn, "SELECT count(*) FROM runpool.messages WHERE run_id = %s",
                         run_id))
        return now if now > seen else 0

    kills = 0
    with running_pool(dsn, retry_backoff_seconds=0.02):
        seen = 0
        # Each time the run commits a step, terminate one of the worker's pool connections:
        # the next checkpoint write (or the one in flight) loses its connection.
        for _ in range(8):
            seen = wait_for(functools.partial(progressed_beyond, seen), timeout=30,
                            what="progress")
            backends = live_pool_backends(conn)
            if backends:
                kills += scalar(conn, "SELECT pg_terminate_backend(%s)", backends[0])
        wait_for(lambda: _done(conn, run_id), timeout=60, what="run finished")
    assert kills > 0
    row = run_row(conn, run_id)
    # Every write that met a killed connection went again on another one (each is safe to
    # repeat): the run finished in its first attempt.
    assert (row["status"], row["attempt"]) == ("succeeded", 1)
    # Never both committed and not: one tool message per finished call, none for others.
    rows = conn.execute(
        "SELECT t.call_id, t.status, count(m.seq) FROM runpool.tool_calls t"
        " LEFT JOIN runpool.messages m ON m.run_id = t.run_id AND m.call_id = t.call_id"
        " WHERE t.run_id = %s GROUP BY t.call_id, t.status", (run_id,)).fetchall()
    assert sorted(c for c, _, _ in rows) == sorted(f"c{i}" for i in range(30))
    assert all(status == "succeeded" and messages == 1 for _, status, messages in rows), [
        r for r in rows if r[1:] != ("succeeded", 1)]
    assert scalar(conn, "SELECT count(*) FROM runpool.messages WHERE run_id = %s"
                  " AND role = 'assistant'", run_id) == 30
    assert_invariants(conn)


def live_pool_backends(conn: psycopg.Connection) -> list[int]:
    """The workers' pool connections (not the LISTEN one, not ours, not the test tools')."""
    return [p for (p,) in conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name LIKE 'runpool-%%'")]


def test_sample_agent__sigkilled_mid_run_resumes_each_committed_call_run_once(
        conn: psycopg.Connection, dsn: str) -> None:
    from runpool.harness import sample_agent

    sample_agent.prepare(conn)
    run_id = runpool.enqueue(conn, "acme", "research",
                             {"searches": 4, "think_seconds": 0.05, "tool_seconds": 0.3})
    with running_pool(dsn, app="runpool.harness.sample_agent:app", workers=2, lease_seconds=1.5):
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM runpool.tool_calls WHERE run_id = %s"
                                " AND status = 'succeeded'", run_id) >= 2, what="two calls")
        pid = scalar(conn, "SELECT w.pid FROM runpool.workers w JOIN runpool.runs r"
                     " ON r.worker_id = w.id WHERE r.id = %s", run_id)
        committed_before = {c for (c,) in conn.execute(
            "SELECT call_id FROM runpool.tool_calls WHERE run_id = %s AND status = 'succeeded'",
            (run_id,))}
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: _done(conn, run_id), timeout=30, what="resumed run")
    row = run_row(conn, run_id)
    assert (row["status"], row["attempt"]) == ("succeeded", 2)
    assert row["result"] == {"answer": "report on postgres queues sent", "turns": 6}
    effects: dict[str, int] = dict(conn.execute("SELECT call_id, count(*) FROM sample_agent_effects"
                                " WHERE run_id = %s GROUP BY call_id", (run_id,)).fetchall())
    assert all(effects[c] == 1 for c in committed_before)
    # The call in flight at the kill ran at most twice, with one idempotency key.
    assert all(n <= 2 for n in effects.values()) and set(effects) == {
        "search-0", "search-1", "search-2", "search-3", "report"}
    keys = conn.execute("SELECT call_id, count(DISTINCT idempotency_key) FROM"
                        " sample_agent_effects WHERE run_id = %s GROUP BY call_id",
                        (run_id,)).fetchall()
    assert all(n == 1 for _, n in keys)
    assert_invariants(conn)
