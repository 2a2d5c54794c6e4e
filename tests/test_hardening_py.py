"""Hardening, Python side (issue 11): no tenant's input, no forged notice and no oversized
result can cost a worker, or another tenant's run, anything."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

import runpool
from runpool.claiming import ClaimedRun
from runpool.settings import Settings
from runpool.worker import Worker
from tests.helpers import (
    assert_invariants,
    live_workers,
    running_pool,
    scalar,
    wait_for,
)

# Valid jsonb that orjson refuses to decode (it stops at 1,024 levels).
DEEP = "[" * 2000 + "]" * 2000
# Enqueue through the SQL API, as an API login would: no Python check in the way.
SQL_ENQUEUE = "SELECT runpool.enqueue(%s, %s, %s::jsonb)"


def run_row(conn: psycopg.Connection, run_id: uuid.UUID) -> dict[str, Any]:
    """The run's row without its input (which this test's own decoder may refuse)."""
    cur = conn.cursor(row_factory=dict_row)
    row = cur.execute("SELECT status, attempt, result, error FROM runpool.runs WHERE id = %s",
                      (run_id,)).fetchone()
    assert row is not None
    return row


def _terminal(conn: psycopg.Connection, run_id: uuid.UUID) -> bool:
    return run_row(conn, run_id)["status"] in ("succeeded", "failed", "cancelled")


def _error(conn: psycopg.Connection, run_id: uuid.UUID) -> dict[str, Any]:
    error = run_row(conn, run_id)["error"]
    assert isinstance(error, dict), error
    return error


def test_poison_input__fails_its_run_alone_while_another_tenant_runs_on_the_same_worker(
        conn: psycopg.Connection, dsn: str) -> None:
    # Interleaved, so poison runs ride in the first claim and in the outcome writer's refills.
    good: list[uuid.UUID] = []
    poison: list[uuid.UUID] = []
    for i in range(12):
        good.append(runpool.enqueue(conn, "tenant-b", "noop", {"n": i}))
        if i % 4 == 0:
            poison.append(scalar(conn, SQL_ENQUEUE, "tenant-a", "noop", DEEP))
    with running_pool(dsn, workers=1, concurrency=4) as pool:
        workers = wait_for(lambda: live_workers(conn), what="the worker registered")
        wait_for(lambda: all(_terminal(conn, r) for r in good + poison), what="runs ended")
        assert live_workers(conn) == workers, pool.log()[-3000:]
        assert pool.poll() is None
    for run_id in poison:
        row = run_row(conn, run_id)
        assert (row["status"], row["attempt"]) == ("failed", 1)
        error = _error(conn, run_id)
        assert error["reason"] == "invalid_input"
        assert "cannot be decoded" in error["message"]
    for i, run_id in enumerate(good):
        row = run_row(conn, run_id)
        assert (row["status"], row["attempt"]) == ("succeeded", 1), row
        assert row["result"] == {"input": {"n": i}, "attempt": 1}
    assert_invariants(conn)


def test_poison_history__a_resumed_run_whose_history_cannot_be_decoded_fails_clearly(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "tenant-a", "noop", {}, max_attempts=5)
    # Attempt 1 committed a message the decoder refuses, then its lease expired.
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1,"
                 " lease_expires_at = now() - interval '1 second' WHERE id = %s", (run_id,))
    conn.execute("INSERT INTO runpool.messages (run_id, seq, role, content, attempt)"
                 " VALUES (%s, 1, 'user', %s::jsonb, 1)", (run_id, DEEP))
    with running_pool(dsn, workers=1, concurrency=2):
        wait_for(lambda: _terminal(conn, run_id), what="the run ended")
    row = run_row(conn, run_id)
    # Decoding fails the same way on every attempt: no retries burnt on it.
    assert (row["status"], row["attempt"]) == ("failed", 2), row
    error = _error(conn, run_id)
    assert error["reason"] == "invalid_input"
    assert "history cannot be decoded" in error["message"]


def test_enqueue__lone_surrogates_anywhere_are_invalid_input(conn: psycopg.Connection) -> None:
    bad = "a\ud800b"
    attempts: list[dict[str, Any]] = [
        {"tenant": bad}, {"handler": bad}, {"input": {"text": bad}}, {"input": {bad: 1}},
        {"idempotency_key": bad}, {"traceparent": bad}, {"serial_key": bad},
    ]
    for change in attempts:
        args: dict[str, Any] = {"tenant": "acme", "handler": "noop", "input": {}, **change}
        tenant, handler = args.pop("tenant"), args.pop("handler")
        try:
            runpool.enqueue(conn, tenant, handler, **args)
        except runpool.InvalidInput as exc:
            assert "surrogate" in str(exc) or "UTF-8" in str(exc), (change, exc)
        else:
            raise AssertionError(f"{change} was accepted")
        try:
            runpool.enqueue_many(conn, [runpool.RunSpec(tenant, handler, **args)])
        except runpool.InvalidInput:
            pass
        else:
            raise AssertionError(f"{change} was accepted by enqueue_many")
    assert scalar(conn, "SELECT count(*) FROM runpool.runs") == 0
    # Inside the caller's transaction, a refusal leaves the transaction usable.
    with conn.transaction():
        try:
            runpool.enqueue(conn, bad, "noop")
        except runpool.InvalidInput:
            pass
        runpool.enqueue(conn, "acme", "noop")
    assert scalar(conn, "SELECT count(*) FROM runpool.runs") == 1


def test_worker_loop_dies__the_runs_in_flight_are_drained_not_left_to_expire(
        conn: psycopg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    app = runpool.App()

    @app.handler("short")
    async def short(run: runpool.Run) -> Any:
        await asyncio.sleep(0.5)
        return {"done": True}

    run_id = runpool.enqueue(conn, "acme", "short")
    worker = Worker(Settings(dsn=dsn, concurrency=2, poll_seconds=0.1, grace_seconds=10),
                    app, dsn)
    claim = worker._claim
    claims = 0

    async def claim_then_break(limit: int) -> list[tuple[ClaimedRun, float]]:
        # A bug of ours in the loop, after a run is already in flight.
        nonlocal claims
        claims += 1
        if claims > 1:
            raise RuntimeError("a bug in the claim loop")
        return await claim(limit)

    monkeypatch.setattr(worker, "_claim", claim_then_break)

    async def main() -> None:
        with pytest.raises(RuntimeError, match="a bug in the claim loop"):
            await worker.run(asyncio.Event(), asyncio.Event())

    asyncio.run(main())
    row = run_row(conn, run_id)
    assert (row["status"], row["attempt"], row["result"]) == ("succeeded", 1, {"done": True})


def test_result_over_the_cap__fails_its_run_with_a_reason_and_the_batch_beside_it_lands(
        conn: psycopg.Connection, dsn: str) -> None:
    big = runpool.enqueue(conn, "acme", "sized_result", {"bytes": 20_000})
    small = runpool.enqueue(conn, "acme", "sized_result", {"bytes": 5_000})
    others = [runpool.enqueue(conn, "other", "noop", {"n": i}) for i in range(6)]
    with running_pool(dsn, workers=1, concurrency=8, max_result_bytes=10_000):
        wait_for(lambda: all(_terminal(conn, r) for r in [big, small, *others]),
                 what="runs ended")
    row = run_row(conn, big)
    assert (row["status"], row["attempt"]) == ("failed", 1)
    error = _error(conn, big)
    assert error["reason"] == "result_too_large"
    assert "RUNPOOL_MAX_RESULT_BYTES" in error["message"]
    assert run_row(conn, small)["status"] == "succeeded"
    assert all(run_row(conn, r)["status"] == "succeeded" for r in others)
