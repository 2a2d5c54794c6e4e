"""Hardening, Python side (issue 11): no tenant's input, no forged notice and no oversized
result can cost a worker, or another tenant's run, anything."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

import runpool
from runpool.cancellation import EARLY_MAX, Canceller
from runpool.claiming import ClaimedRun
from runpool.errors import TEXT_LIMIT
from runpool.listener import ClaimBudget
from runpool.settings import Settings
from runpool.slot import Slot
from runpool.testing.hostile import (
    DEEP_JSON,
    POISON_INPUTS,
    enqueue_raw,
    notify_flood,
    unprivileged_login,
)
from runpool.worker import Worker
from tests.helpers import (
    assert_invariants,
    live_workers,
    running_pool,
    scalar,
    until,
    wait_for,
)


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
            poison.append(enqueue_raw(conn, "tenant-a", POISON_INPUTS[i // 4]))
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
                 " VALUES (%s, 1, 'user', %s::jsonb, 1)", (run_id, DEEP_JSON))
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


def test_handler_passes_lone_surrogates_and_forged_fragments__each_call_is_invalid_input(
        conn: psycopg.Connection, dsn: str) -> None:
    # Handler code, not a tenant's input (inputs arrive decoded): a name with a lone surrogate
    # raised orjson's bare TypeError from inside the batch encoder, and an orjson.Fragment was
    # spliced into the batch's JSON array unchecked. Each call now raises InvalidInput, writes
    # nothing, and the run goes on; a run beside it is untouched.
    other = runpool.enqueue(conn, "other", "agent", {"steps": 2})
    run_id = runpool.enqueue(conn, "acme", "bad_names", {"forged": (
        f'1}}}},{{"run_id":"{other}","attempt":1,"role":"user","content":{{"a":2')})
    with running_pool(dsn, concurrency=8):
        wait_for(lambda: _terminal(conn, run_id) and _terminal(conn, other), what="runs")
    result = scalar(conn, "SELECT result FROM runpool.runs WHERE id = %s", run_id)
    assert set(result["raised"]) == {"role", "content", "float_enum", "call_id", "tool_name",
                                     "arguments", "signal", "spawn", "cost_key"}, result
    for what, raised in result["raised"].items():
        assert raised is not None and raised.startswith("InvalidInput: "), (what, raised)
    assert result["seq"] == 1  # only the message after them was written
    assert scalar(conn, "SELECT count(*) FROM runpool.tool_calls WHERE run_id = %s", run_id) == 0
    assert run_row(conn, other)["status"] == "succeeded"
    assert scalar(conn, "SELECT count(*) FROM runpool.messages WHERE run_id = %s"
                  " AND role = 'user'", other) == 0
    assert_invariants(conn)


def test_unprintable_exceptions_and_reasons__the_run_ends_as_its_kind_says_with_what_can_be_said(
        conn: psycopg.Connection, dsn: str) -> None:
    # A Fail whose reason is no str and an exception whose str() raises made the outcome's
    # own code raise: the run ended internal_error (and a tool's such exception escaped the
    # tool call, its intent left 'started'). A str() raising SystemExit or KeyboardInterrupt,
    # or a handler's own sys.exit(), ended the worker process and every run in it (the attack
    # on the first fix: a poison pill, each claim killing its worker). Now each run ends as
    # its kind says, with the text that can be had, and the run beside them is untouched.
    unreadable = "<Unprintable str() failed>"
    cases = {
        "fail_int": ("failed", "failed", "404"),
        "fail_evil_str": ("failed", "failed", "evil reason"),
        "RuntimeError": ("failed", "exception", unreadable),
        "SystemExit": ("failed", "exception", unreadable),
        "KeyboardInterrupt": ("failed", "exception", unreadable),
        "CancelledError": ("failed", "exception", unreadable),
        "sys_exit": ("failed", "exception", "3"),
        "keyboard": ("failed", "exception", ""),
        "huge": ("failed", "exception", "x" * TEXT_LIMIT),
        # sys.exit() in a task the handler made (asyncio lets it out of the loop: the worker
        # ended, or wedged draining), a Suspended or CancelledError raised by the code itself
        # (the run was held to its lease's end), a Fail whose reason cannot be read.
        "gather_exit": ("failed", "exception", "a task of the run's code raised SystemExit"),
        "wait_for_exit": ("failed", "exception", "a task of the run's code raised SystemExit"),
        "suspended": ("failed", "exception", ""),
        "cancelled": ("failed", "exception", ""),
        "fail_no_reason": ("failed", "failed", "<reason cannot be read>"),
    }
    tools = {"fail_int": ("SystemExit", False), "fail_evil_str": ("GeneratorExit", True),
             "RuntimeError": ("KeyboardInterrupt", True)}
    ids = {how: runpool.enqueue(conn, "acme", "unprintable",
                                {"how": how, "tool": tools.get(how, ("RuntimeError", False))[0],
                                 "sync_tool": tools.get(how, ("", False))[1]}, max_attempts=2)
           for how in cases}
    genexit = runpool.enqueue(conn, "acme", "generator_exit", max_attempts=2)
    other = runpool.enqueue(conn, "other", "agent", {"steps": 3})
    # A lease far longer than the wait: a run held to its lease's end fails the wait.
    with running_pool(dsn, workers=1, concurrency=12, retry_backoff_seconds=0.05,
                      lease_seconds=120):
        wait_for(lambda: all(_terminal(conn, r) for r in [*ids.values(), genexit, other]),
                 timeout=30, what="runs")
        # No run killed the worker: the one process that started is the one still working.
        assert scalar(conn, "SELECT count(*) FROM runpool.workers") == 1
    for how, (status, reason, message) in cases.items():
        row = run_row(conn, ids[how])
        assert (row["status"], row["error"]["reason"]) == (status, reason), (how, row)
        assert row["error"]["message"] == message, (how, row["error"]["message"][:100])
        assert row["attempt"] == (1 if reason == "failed" else 2), (how, row)
        call = conn.execute("SELECT status, result FROM runpool.tool_calls WHERE run_id = %s",
                            (ids[how],)).fetchone()
        assert call == ("failed", {"error": {"type": "Unprintable", "message": unreadable}}), \
            (how, call)
    assert run_row(conn, ids["sys_exit"])["error"]["type"] == "SystemExit"
    assert run_row(conn, ids["gather_exit"])["error"]["type"] == "TaskExited"
    assert run_row(conn, ids["suspended"])["error"]["type"] == "Suspended"
    assert run_row(conn, ids["cancelled"])["error"]["type"] == "CancelledError"
    # A plain handler: its sync tool's GeneratorExit is a failed call it reads, its own
    # GeneratorExit an exception of the run (a GeneratorExit thrown into the awaiting task
    # closed the coroutines under it: nothing recorded, the run held to its lease's end).
    row = run_row(conn, genexit)
    assert (row["status"], row["attempt"], row["error"]["reason"]) == \
        ("failed", 2, "exception"), row
    assert row["error"]["message"] == "the thread raised GeneratorExit: from the handler"
    assert conn.execute("SELECT status, result FROM runpool.tool_calls WHERE run_id = %s",
                        (genexit,)).fetchone() == ("failed", {"error": {
                            "type": "RuntimeError",
                            "message": "the thread raised GeneratorExit: from the tool"}})
    assert run_row(conn, ids["RuntimeError"])["error"]["type"] == "Unprintable"
    assert (run_row(conn, other)["status"], run_row(conn, other)["attempt"]) == ("succeeded", 1)
    assert_invariants(conn)


def test_sys_exit_out_of_the_event_loop__the_worker_exits_at_once_and_is_replaced(
        conn: psycopg.Connection, dsn: str) -> None:
    # A SystemExit no task factory contains (a task made outside any run's context) leaves
    # the loop; closing the loop then waited for tasks that never ended: the worker hung
    # draining, its leases held, and nothing restarted it. It now exits at once; the
    # supervisor starts another, and the runs it held are reclaimed when their leases expire.
    escape = runpool.enqueue(conn, "acme", "escape_loop", max_attempts=1)
    other = runpool.enqueue(conn, "other", "sleep", {"seconds": 2})
    with running_pool(dsn, workers=1, concurrency=4, lease_seconds=3, poll_seconds=0.5):
        wait_for(lambda: _terminal(conn, escape) and _terminal(conn, other), timeout=40,
                 what="runs ended")
        assert scalar(conn, "SELECT count(*) FROM runpool.workers") >= 2  # replaced
    row = run_row(conn, escape)
    assert (row["status"], row["error"]["reason"]) == ("failed", "lease_expired"), row
    assert run_row(conn, other)["status"] == "succeeded"
    assert_invariants(conn)


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


def test_forged_cancel_flood__constant_work_per_notice_and_capped_memory() -> None:
    async def main() -> float:
        worker = Worker(Settings(), runpool.App(), "postgresql://unused")
        started = time.perf_counter()
        for _ in range(3 * EARLY_MAX // 2):
            worker.cancels.on_notice(uuid.uuid4())
        elapsed = time.perf_counter() - started
        assert len(worker.cancels._early) == EARLY_MAX
        return elapsed

    # Linear: 15,000 notices in well under a second (the old store, rebuilt per notice, took
    # tens of seconds and kept every id).
    assert asyncio.run(main()) < 1.0


def test_flapping_listen__one_catch_up_read_in_flight_and_one_more_after_it() -> None:
    """A login that terminates the LISTEN as fast as it comes back forces a reconnect each
    time (attack14: ~8 a second); each would read the flags of every run the worker holds.
    The reads are folded: the one in flight, and one more for the reconnects meanwhile."""
    snapshots: list[int] = []

    def slots() -> list[Slot]:
        snapshots.append(1)  # one snapshot of the slots per catch-up read
        return []

    async def main() -> None:
        canceller = Canceller(lookup=lambda run_id: None, slots=slots, pool=lambda: None,
                              on_cancel=lambda slot: None)
        async def settled() -> None:  # the catch-up tasks have ended
            _, pending = await asyncio.wait(set(canceller._background._tasks), timeout=5)
            assert not pending and canceller._catching_up is None

        for _ in range(50):
            canceller.on_listening()
        await settled()
        canceller.on_listening()  # the next reconnect, after: a read of its own
        await settled()

    asyncio.run(main())
    assert len(snapshots) == 3


def test_forged_notify_flood_from_a_bare_login__runs_keep_their_leases_and_cancels_work(
        conn: psycopg.Connection, dsn: str) -> None:
    held = runpool.enqueue(conn, "acme", "hold", {"seconds": 4})
    victim = runpool.enqueue(conn, "acme", "hold", {"seconds": 60})
    # A long lease: heartbeats every 20 s, so only the cancel's NOTIFY can end the victim soon.
    with unprivileged_login(dsn) as login, running_pool(
            dsn, workers=1, concurrency=4, lease_seconds=60) as pool:
        workers = wait_for(lambda: live_workers(conn), what="the worker registered")
        wait_for(lambda: run_row(conn, held)["status"] == "running", what="runs started")
        wait_for(lambda: run_row(conn, victim)["status"] == "running", what="runs started")
        notify_flood(login, cancels=60_000, noise=5_000, named=[held, victim], named_each=2_000)
        # A real cancel, whose notice queues behind the whole flood, still arrives at once:
        # the worker got through the flood in constant work per notice.
        conn.execute("SELECT runpool.cancel_run(%s, 'real')", (victim,))
        wait_for(lambda: run_row(conn, victim)["status"] == "cancelled", timeout=8,
                 what="the real cancel")
        wait_for(lambda: _terminal(conn, held), what="the held run ended")
        assert live_workers(conn) == workers
        log = pool.log()
    row = run_row(conn, held)
    assert (row["status"], row["attempt"]) == ("succeeded", 1), log[-3000:]
    assert "lease_lost" not in log
    # Noise is logged as a count, not a line per notice.
    assert log.count("cancel_notice_ignored") <= 2
    assert_invariants(conn)


def test_forged_wakeup_flood__claims_are_rate_limited(
        conn: psycopg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    app = runpool.App()

    @app.handler("noop")
    async def noop(run: runpool.Run) -> Any:
        return None

    worker = Worker(Settings(dsn=dsn, concurrency=2, poll_seconds=600), app, dsn)
    claim = worker._claim
    claims = 0

    async def counted(limit: int) -> list[tuple[ClaimedRun, float]]:
        nonlocal claims
        claims += 1
        return await claim(limit)

    monkeypatch.setattr(worker, "_claim", counted)

    async def main(login: str) -> tuple[int, float]:
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop, asyncio.Event()))
        await until(lambda: worker.listener is not None and worker.listener.connected.is_set(),
                    "the listener to connect", interval=0.02)
        before, started = claims, time.monotonic()
        await asyncio.to_thread(notify_flood, login, wakeups=3_000)
        # A real run after the flood still starts promptly, and its doorbell comes after
        # every forged one.
        run_id = runpool.enqueue(conn, "acme", "noop")
        await until(lambda: run_row(conn, run_id)["status"] == "succeeded", "the real run",
                    30, interval=0.02)
        elapsed = time.monotonic() - started
        stop.set()
        await running
        return claims - before, elapsed

    with unprivileged_login(dsn) as login:
        made, elapsed = asyncio.run(main(login))
    # The budget: a burst of 10, then 10 fruitless claims a second (plus the real run's).
    assert made <= 10 + 10 * elapsed + 3, (made, elapsed)


# A long run's history, written as its attempt 1 would have: `n` messages and `n` tool calls
# of about 2 KB each.
LONG_HISTORY = """
WITH m AS (
    INSERT INTO runpool.messages (run_id, seq, role, content, attempt)
    SELECT %(run_id)s, i, 'assistant', jsonb_build_object('turn', i, 'text', repeat('x', 2000)), 1
    FROM generate_series(1, %(n)s) AS i
)
INSERT INTO runpool.tool_calls (run_id, call_id, name, arguments, status, result, attempt,
                                started_at, finished_at)
SELECT %(run_id)s, 'c' || i, 'lookup', jsonb_build_object('i', i), 'succeeded',
       jsonb_build_object('text', repeat('y', 2000)), 1,
       now() - interval '1 day' + i * interval '1 second', now()
FROM generate_series(1, %(n)s) AS i
"""


def test_resume_of_a_long_run__20000_messages_and_calls_load_in_pages_under_a_short_lease(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "history_size", max_attempts=2)
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1,"
                 " lease_expires_at = now() - interval '1 second' WHERE id = %s", (run_id,))
    conn.execute(LONG_HISTORY, {"run_id": run_id, "n": 20_000})
    # A 1 s lease: every read of the resume must end within half of it (one read of the whole
    # history took longer), and heartbeats must go on between the pages.
    with running_pool(dsn, workers=1, concurrency=2, lease_seconds=1):
        wait_for(lambda: _terminal(conn, run_id), timeout=60, what="the resumed run ended")
    row = run_row(conn, run_id)
    assert (row["status"], row["result"]) == ("succeeded", {
        "messages": 20_000, "calls": 20_000, "attempt": 2, "in_order": True}), row


def test_default_workers__a_many_core_host_stays_within_the_connection_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 32)
    settings = Settings.from_env({})
    # workers x (pool + LISTEN + heartbeat): the README's 32 per host, far under PostgreSQL's
    # default max_connections (100).
    assert settings.workers == 4
    assert settings.workers * (settings.connections + 2) == 32


def test_claim_budget__racing_workers_never_wait_but_a_flood_does() -> None:
    # Every enqueue wakes every worker and one wins: a worker losing half its races (and
    # claiming once more when its run ends) must never be held back (W2's latency)...
    racing = ClaimBudget()
    for _ in range(1_000):
        racing.spend()
        racing.spend()
        racing.found_work()
        assert racing.delay() == 0
    # ...while doorbells that never lead to work are answered 10 at once, then 10 a second.
    flooded = ClaimBudget()
    for _ in range(10):
        assert flooded.delay() == 0
        flooded.spend()
    assert 0 < flooded.delay() <= 0.1


def test_tenant_with_a_newline__cannot_forge_a_log_line(
        conn: psycopg.Connection, dsn: str) -> None:
    forged = "2026-01-01 00:00:00,000 ERROR runpool.worker[1]: forged action=forged"
    run_id = runpool.enqueue(conn, f"evil\n{forged}", "fails")
    with running_pool(dsn, workers=1) as pool:
        wait_for(lambda: _terminal(conn, run_id), what="the run ended")
        # The worker logs the run's end after committing it: on a loaded machine, later.
        wait_for(lambda: 'tenant="evil' in pool.log(), what="the failed run's log line")
        log = pool.log()
    assert not any(line.startswith("2026-01-01") for line in log.splitlines()), log[-2000:]
    # The tenant is still there, quoted: "evil\n2026-...".
    assert 'tenant="evil\\n2026-01-01' in log
