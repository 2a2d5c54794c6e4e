"""Cost control (issue 17): timeouts, deadlines, budgets, usage and shared rate limits.

Statement-level tests drive the real claim/heartbeat/reap statements on real connections (a
worker that claimed and then stopped beating is a dead worker); the rest run real pools of
tests/cost_apps.py."""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import signal
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from psycopg_pool import AsyncConnectionPool

import runpool
from runpool import costs, telemetry
from runpool.claiming import claim
from runpool.context import Run
from runpool.db import aconnect
from runpool.queries import QUERIES
from runpool.status import collect
from tests.helpers import (
    events,
    live_workers,
    run_row,
    running_pool,
    scalar,
    status_of,
    wait_for,
)
from tests.test_cli import cli

APP = "tests.cost_apps:app"


def _claim(dsn: str, *, lease: float = 30, reap: bool = True) -> list[Any]:
    async def main() -> list[Any]:
        async with await aconnect(dsn, autocommit=True) as c:
            return await claim(c, worker_id=uuid.uuid4(), limit=10, lease_seconds=lease,
                               reap_expired=reap)
    return asyncio.run(main())


def _error(conn: psycopg.Connection, run_id: uuid.UUID) -> dict[str, Any]:
    return dict(run_row(conn, run_id)["error"] or {})


# -- bad values ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("options", "message"), [
    ({"budget": {"max_tokens": -1}}, "budget.max_tokens must be a number from 0"),
    ({"budget": {"max_cost": "1"}}, "budget.max_cost must be a number"),
    ({"budget": {"max_turns": 2.5}}, "budget.max_turns must be a whole number"),
    ({"budget": {"max_money": 1}}, "budget.max_money is not a budget limit"),
    ({"budget": [1]}, "budget must be a JSON object"),
    ({"timeout": 0}, "timeout must be more than 0"),
    ({"timeout": -5}, "timeout must be more than 0"),
    ({"timeout": timedelta(seconds=-1)}, "timeout must be more than 0"),
    ({"timeout": float("nan")}, "timeout must be a number of seconds"),
    # Far but finite was accepted, and then unreadable by psycopg in any session east of UTC
    # (the year 10000 there): refused like a run_at over 10 years ahead (attack 2).
    ({"deadline": datetime.max.replace(tzinfo=UTC)}, "deadline must be a finite time from 1970"),
    ({"deadline": datetime.now(UTC) + timedelta(days=9 * 365)}, None),
])
def test_enqueue_bad_cost_values__clear_error_nothing_written(
        conn: psycopg.Connection, options: dict[str, Any], message: str | None) -> None:
    if message is None:
        runpool.enqueue(conn, "t", "noop", **options)
        assert scalar(conn, "SELECT count(*) FROM runpool.runs") == 1
        return
    with pytest.raises(runpool.InvalidInput, match=message):
        runpool.enqueue(conn, "t", "noop", **options)
    assert scalar(conn, "SELECT count(*) FROM runpool.runs") == 0


def test_enqueue_infinite_deadline__refused_by_sql(conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="deadline must be a finite"):
        conn.execute("SELECT runpool.enqueue('t', 'h', deadline => 'infinity')")


def test_rate_limit_bad_values__clear_errors(conn: psycopg.Connection) -> None:
    for sql, message in [
        ("SELECT runpool.set_rate_limit('k', 0)", "per_minute must be more than 0"),
        ("SELECT runpool.set_rate_limit('k', -1)", "per_minute must be more than 0"),
        ("SELECT runpool.set_rate_limit('k', 'NaN')", "per_minute must be more than 0"),
        ("SELECT runpool.set_rate_limit('k', 60, -1)", "burst must be 0 or more"),
        ("SELECT runpool.set_rate_limit('', 60)", "key must be 1 to 200"),
        ("SELECT runpool.acquire_rate('nope', 1)", 'no rate limit named "nope"'),
    ]:
        with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
            conn.execute(sql)
    assert scalar(conn, "SELECT count(*) FROM runpool.rate_limits") == 0
    conn.execute("SELECT runpool.set_rate_limit('k', 60, 5)")
    for units, message in [(0, "units must be more than 0"), (-1, "units must be more than 0"),
                           (66, "more than rate limit")]:
        with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
            conn.execute("SELECT runpool.acquire_rate('k', %s)", (units,))


def test_enqueue_many_and_cli__carry_timeout_deadline_budget(
        conn: psycopg.Connection, dsn: str) -> None:
    deadline = datetime.now(UTC) + timedelta(hours=1)
    ids = runpool.enqueue_many(conn, [
        runpool.RunSpec("t", "noop", timeout=2.5, deadline=deadline,
                        budget={"max_tool_calls": 3}),
        runpool.RunSpec("t", "noop")])
    first, second = (run_row(conn, i) for i in ids)
    assert first["attempt_timeout"] == timedelta(seconds=2.5)
    assert first["deadline"] == deadline
    assert first["budget"] == {"max_tool_calls": 3}
    assert (second["attempt_timeout"], second["deadline"], second["budget"]) == (None, None, None)
    with pytest.raises(runpool.InvalidInput, match=r"budget\.max_turns"):
        runpool.enqueue_many(conn, [runpool.RunSpec("t", "noop"),
                                    runpool.RunSpec("t", "noop", budget={"max_turns": -1})])
    assert scalar(conn, "SELECT count(*) FROM runpool.runs") == 2


def test_cli_enqueue_cost_options_and_status_usage(conn: psycopg.Connection, dsn: str) -> None:
    out = cli(dsn, "enqueue", "acme", "noop", "--timeout", "2.5", "--deadline",
              "2030-01-01T00:00:00+00:00", "--budget", '{"max_turns": 3}')
    assert out.returncode == 0, out.stderr
    row = run_row(conn, uuid.UUID(out.stdout.strip()))
    assert row["attempt_timeout"] == timedelta(seconds=2.5)
    assert row["deadline"] == datetime(2030, 1, 1, tzinfo=UTC)
    assert row["budget"] == {"max_turns": 3}
    out = cli(dsn, "enqueue", "acme", "noop", "--budget", '{"max_turns": -3}')
    assert out.returncode != 0 and "budget.max_turns" in out.stderr
    conn.execute("UPDATE runpool.runs SET usage = %s", (psycopg.types.json.Jsonb({
        "input_tokens": 7, "output_tokens": 3, "cost": 0.125, "tool_calls": 2, "turns": 1}),))
    out = cli(dsn, "status")
    assert out.returncode == 0, out.stderr
    (line,) = [x for x in out.stdout.splitlines() if x.strip().startswith("acme ")
               and "0.1250" in x]
    assert line.split() == ["acme", "1", "7", "3", "0.1250", "2", "1"]


# -- deadlines and timeouts, by the database's clock ---------------------------------------------

def test_queued_run_past_its_deadline__ends_without_a_worker_and_never_starts(
        conn: psycopg.Connection, dsn: str) -> None:
    soon = runpool.enqueue(conn, "t", "noop", deadline=datetime.now(UTC) + timedelta(seconds=1))
    past = runpool.enqueue(conn, "t", "noop", deadline=datetime.now(UTC) - timedelta(seconds=1))
    later = runpool.enqueue(conn, "t", "noop", deadline=datetime.now(UTC) + timedelta(hours=1))
    # A claim that does not sweep still never starts the run already past its deadline.
    assert {c.id for c in _claim(dsn, reap=False)} == {soon, later}
    conn.execute("UPDATE runpool.runs SET status = 'queued', lease_expires_at = NULL"
                 " WHERE id IN (%s, %s)", (soon, later))
    wait_for(lambda: scalar(conn, "SELECT now() > deadline FROM runpool.runs WHERE id = %s",
                            soon), what="the deadline to pass")
    # A caller's open transaction on one of them delays only that run: the sweep skips it.
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT 1 FROM runpool.runs WHERE id = %s FOR UPDATE", (past,))
        assert [c.id for c in _claim(dsn)] == [later]
        assert status_of(conn, past) == "queued"
    # The sweep rides on the claim's reap: both runs past their deadline end, unclaimed.
    assert _claim(dsn) == []
    for run_id in (soon, past):
        assert status_of(conn, run_id) == "failed"
        assert _error(conn, run_id)["reason"] == "deadline_exceeded"
        assert events(conn, run_id)[-1] == "failed"


def test_dead_workers_run__reaped_past_its_deadline_as_deadline_exceeded_not_retried(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "t", "noop", max_attempts=5,
                             deadline=datetime.now(UTC) + timedelta(seconds=0.5))
    # A worker claims it with a 1 s lease and dies: no heartbeat ever comes.
    assert [c.id for c in _claim(dsn, lease=1)] == [run_id]
    wait_for(lambda: scalar(conn, "SELECT lease_expires_at < now() FROM runpool.runs"
                                  " WHERE id = %s", run_id), what="the lease to expire")
    _claim(dsn)  # any other claimer reaps
    assert status_of(conn, run_id) == "failed"
    assert _error(conn, run_id)["reason"] == "deadline_exceeded"
    assert run_row(conn, run_id)["attempt"] == 1


def test_dead_workers_attempt_past_its_timeout__reclaimed_as_timeout_then_failed(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "t", "noop", max_attempts=2, timeout=0.2)
    for attempt in (1, 2):
        (c,) = _claim(dsn, lease=1)
        assert (c.id, c.attempt) == (run_id, attempt)
        assert c.due_in is not None and 0 < c.due_in <= 0.2
        wait_for(lambda: scalar(conn, "SELECT lease_expires_at < now() FROM runpool.runs"
                                      " WHERE id = %s", run_id), what="the lease to expire")
        conn.execute(QUERIES["reap_expired"])  # the reap alone (a claim might take it again)
    assert status_of(conn, run_id) == "failed"
    assert _error(conn, run_id)["reason"] == "timeout"
    reasons = [d["reason"] for (d,) in conn.execute(
        "SELECT detail FROM runpool.run_events WHERE run_id = %s AND kind IN"
        " ('reclaimed', 'failed') ORDER BY id", (run_id,))]
    assert reasons == ["timeout", "timeout"]


def test_heartbeat__reports_runs_past_their_timeout_or_deadline(
        conn: psycopg.Connection, dsn: str) -> None:
    timed = runpool.enqueue(conn, "a", "noop", timeout=0.3)
    dated = runpool.enqueue(conn, "b", "noop", timeout=60,
                            deadline=datetime.now(UTC) + timedelta(seconds=0.3))
    plain = runpool.enqueue(conn, "c", "noop")
    claimed = _claim(dsn)
    by_id = {c.id: c for c in claimed}
    assert by_id[plain].due_in is None

    def beat() -> dict[uuid.UUID, Any]:
        rows = conn.execute(QUERIES["heartbeat"], {
            "ids": [c.id for c in claimed], "attempts": [c.attempt for c in claimed],
            "lease_seconds": 30, "worker_id": uuid.uuid4()}).fetchall()
        return {run_id: overdue for run_id, _, overdue in rows}

    assert beat() == {timed: None, dated: None, plain: None}
    wait_for(lambda: beat() == {timed: "timeout", dated: "deadline_exceeded", plain: None},
             what="both runs reported overdue")


# -- usage: committed, fenced, on the chat span ---------------------------------------------------

def test_record_usage__fenced_idempotent_on_the_chat_span_and_a_zombie_adds_nothing(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "t", "noop", budget={"max_cost": 1})
    (c,) = _claim(dsn)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def main() -> None:
        telemetry.activate(provider)
        async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False,
                                       kwargs={"autocommit": True}) as pool:
            run = Run(id=run_id, tenant="t", handler="noop", attempt=c.attempt, input={},
                      pool=pool, budget=costs.decode(c.budget), usage=costs.decode(c.usage))
            with run.model_call("openai:gpt-x"):
                totals = await run.record_usage(model="openai:gpt-x", input_tokens=100,
                                                output_tokens=20, cost=0.5)
            assert totals == {"input_tokens": 100, "output_tokens": 20, "cost": 0.5,
                              "tool_calls": 0, "turns": 0}
            # A repeat of the same write (its acknowledgement lost) adds nothing.
            op = costs.recorder(run_id=run_id, attempt=c.attempt, write=f"{c.attempt}:1",
                                input_tokens=100, output_tokens=20, cost=0.5, tool_calls=0,
                                turns=0)
            async with pool.connection() as aconn:
                assert (await op(aconn, 1))["input_tokens"] == 100
            with pytest.raises(runpool.InvalidInput, match="input_tokens"):
                await run.record_usage(input_tokens=-1)
            # Rate limits from Python: refusals are InvalidInput, nothing reserved.
            async with pool.connection() as aconn:
                await aconn.execute("SELECT runpool.set_rate_limit('k', 60)")
            for key, units, message in [("nope", 1, 'no rate limit named "nope"'),
                                        ("k", 0, "units must be a finite number > 0"),
                                        ("k", 61, "more than rate limit"),
                                        ("", 1, "key must be 1 to")]:
                with pytest.raises(runpool.InvalidInput, match=message):
                    await run.acquire(key, units)
            assert await run.acquire("k", 1) == 0  # the first unit of an idle key: at once
            with pytest.raises(runpool.BudgetExceeded, match="max_cost"):
                await run.record_usage(cost=0.6)  # recorded: it was spent
            # The attempt is reclaimed: the zombie's usage is refused, nothing added.
            await (await pool.getconn()).close()
            async with pool.connection() as aconn:
                await aconn.execute("UPDATE runpool.runs SET attempt = attempt + 1"
                                    " WHERE id = %s", (run_id,))
            with pytest.raises(runpool.LeaseLost):
                await run.record_usage(input_tokens=1_000)

    asyncio.run(main())
    usage = run_row(conn, run_id)["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (100, 20)
    assert float(usage["cost"]) == pytest.approx(1.1)
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "chat openai:gpt-x"]
    assert span.attributes is not None
    assert span.attributes["gen_ai.usage.input_tokens"] == 100
    assert span.attributes["gen_ai.usage.output_tokens"] == 20
    assert span.attributes["gen_ai.provider.name"] == "openai"
    provider.shutdown()


# -- rate limits (statement level) ----------------------------------------------------------------

# One reservation as the database recorded it: when it was asked for (the statement's clock),
# how long it waits, when it starts, and the key's line after it (epoch seconds).
RESERVE = """
SELECT extract(epoch FROM starts_at) - wait, wait, extract(epoch FROM starts_at),
       extract(epoch FROM reserved_until)
FROM runpool.acquire_rate(%s, 1)
"""


def _reserve(conn: psycopg.Connection, key: str) -> tuple[float, ...]:
    row = conn.execute(RESERVE, (key,)).fetchone()
    assert row is not None
    return tuple(float(x) for x in row)


def _paced(reservations: list[tuple[float, ...]], per_unit: float, burst: int) -> None:
    """The reservations of one key, in the order the database took them (its line only grows),
    follow the limit by what the database recorded, however fast or slowly they came: each
    moves the line one unit past the later of the line and its asking time, and waits until
    the line less the burst's units (and its own)."""
    assert [u for *_, u in reservations] == sorted(u for *_, u in reservations)
    for (*_, line), (asked, wait, starts, until) in itertools.pairwise(reservations):
        assert until == pytest.approx(max(line, asked) + per_unit, abs=1e-4)
        assert wait == pytest.approx(max(0.0, until - asked - (1 + burst) * per_unit), abs=1e-4)
        assert starts == pytest.approx(asked + wait, abs=1e-4)


def test_acquire_rate__reserves_in_arrival_order_paced_after_the_burst(
        conn: psycopg.Connection) -> None:
    conn.execute("SELECT runpool.set_rate_limit('k', 600, 2)")
    reservations = [_reserve(conn, "k") for _ in range(8)]
    # burst 2: three start at once (the bucket is full), then one per 0.1 s, in order.
    assert [wait for _, wait, _, _ in reservations[:3]] == [0, 0, 0]
    _paced(reservations, 0.1, 2)
    # However slowly the eight came (a loaded machine), they came within the line's reach.
    assert reservations[-1][1] > 0


def test_acquire_rate__reservations_from_many_sessions_stay_within_limit_plus_burst(
        dsn: str, conn: psycopg.Connection) -> None:
    """4 sessions reserving at once: by the database's record, in any window of 2 s at most
    20 (600/min) + burst 5 start, each session's reservations start in its own order, and
    together they follow the limit as one line (no reservation lost to a race)."""
    conn.execute("SELECT runpool.set_rate_limit('k', 600, 5)")

    def reserve() -> list[tuple[float, ...]]:
        with psycopg.connect(dsn, autocommit=True) as c:
            return [_reserve(c, "k") for _ in range(30)]

    with ThreadPoolExecutor(4) as pool:
        sessions = list(pool.map(lambda _: reserve(), range(4)))
    for session in sessions:
        assert [s for _, _, s, _ in session] == sorted(s for _, _, s, _ in session)
    every = sorted((r for session in sessions for r in session), key=lambda r: r[3])
    starts = sorted(s for _, _, s, _ in every)
    assert max(sum(1 for b in starts if a <= b < a + 2.0) for a in starts) <= 20 + 5
    _paced(every, 0.1, 5)
    assert len({u for *_, u in every}) == 120


def test_release_rate__gives_back_only_the_last_reservation(conn: psycopg.Connection) -> None:
    conn.execute("SELECT runpool.set_rate_limit('k', 6)")  # one each 10 s, no burst

    def acquire() -> tuple[float, Any]:
        row = conn.execute("SELECT extract(epoch FROM starts_at), reserved_until"
                           " FROM runpool.acquire_rate('k')").fetchone()
        assert row is not None
        return float(row[0]), row[1]

    def release(until: Any) -> bool | None:
        return scalar(conn, "SELECT runpool.release_rate('k', 1, %s)", until)  # type: ignore[no-any-return]

    acquire()
    (_, middle), (last_starts, last) = acquire(), acquire()
    assert release(middle) is None  # a later reservation was planned after it: kept
    assert release(last) is True
    assert release(last) is None  # once
    # The next one takes the released place (by the database's plan, however long this
    # took, within the 10 s the place is ahead), not the one after it.
    assert acquire()[0] == pytest.approx(last_starts, abs=1e-3)


# -- real pools -----------------------------------------------------------------------------------

def test_live_worker__timeout_stops_the_attempt_retries_then_fails_and_deadline_is_not_retried(
        conn: psycopg.Connection, dsn: str) -> None:
    with running_pool(dsn, APP, lease_seconds=6, retry_backoff_seconds=0.1,
                      cancel_grace_seconds=2):
        # Enqueued once the worker is up: a slow start must not spend the deadline.
        wait_for(lambda: live_workers(conn), what="the worker to start")
        timed = runpool.enqueue(conn, "t1", "hang", timeout=0.5, max_attempts=2)
        dated = runpool.enqueue(conn, "t2", "hang", max_attempts=3,
                                deadline=datetime.now(UTC) + timedelta(seconds=2))
        wait_for(lambda: status_of(conn, timed) == "failed" and status_of(conn, dated)
                 == "failed", timeout=20, what="both runs to fail")
    assert _error(conn, timed)["reason"] == "timeout"
    assert run_row(conn, timed)["attempt"] == 2
    assert _error(conn, dated)["reason"] == "deadline_exceeded"
    assert run_row(conn, dated)["attempt"] == 1
    # Each attempt was stopped through its cancellation, which the handler saw (well before a
    # heartbeat interval of 2 s would have noticed: the claim's due time asks at once).
    stopped = {(r, a) for r, a in conn.execute(
        "SELECT run_id, (content ->> 'stopped_in_attempt')::int FROM runpool.messages")}
    assert stopped == {(timed, 1), (timed, 2), (dated, 1)}
    assert scalar(conn, "SELECT count(*) FROM runpool.run_events WHERE run_id = %s"
                        " AND kind = 'retry_scheduled' AND detail ->> 'reason' = 'timeout'",
                  timed) == 1


def test_budget_exceeded__at_record_usage_tool_and_add_message(
        conn: psycopg.Connection, dsn: str) -> None:
    tokens = runpool.enqueue(conn, "t", "spend_tokens", budget={"max_tokens": 150})
    tools = runpool.enqueue(conn, "t", "call_tools", budget={"max_tool_calls": 2})
    turns = runpool.enqueue(conn, "t", "take_turns", budget={"max_turns": 2})
    plain = runpool.enqueue(conn, "t", "spend_tokens_sync", budget={"max_tokens": 150})
    with running_pool(dsn, APP):
        wait_for(lambda: all(status_of(conn, r) in ("failed", "succeeded")
                             for r in (tokens, tools, turns, plain)), timeout=20,
                 what="the runs")
    # record_usage: the third call (180 tokens) is recorded and raises; not retried.
    for run_id in (tokens, plain):
        assert status_of(conn, run_id) == "failed"
        assert _error(conn, run_id)["reason"] == "budget_exceeded"
        assert run_row(conn, run_id)["attempt"] == 1
        assert run_row(conn, run_id)["usage"]["input_tokens"] == 120
    # tool: the third call raises before it runs, so it is not even recorded.
    assert _error(conn, tools)["reason"] == "budget_exceeded"
    assert run_row(conn, tools)["attempt"] == 1
    assert scalar(conn, "SELECT count(*) FROM runpool.tool_calls WHERE run_id = %s", tools) == 2
    # add_message: the third turn is refused unwritten; the handler caught it and wrapped up.
    assert status_of(conn, turns) == "succeeded"
    result = run_row(conn, turns)["result"]
    assert result["stopped_by"] == "max_turns" and result["usage"]["turns"] == 2
    roles = [r for (r,) in conn.execute(
        "SELECT role FROM runpool.messages WHERE run_id = %s ORDER BY seq", (turns,))]
    assert roles == ["assistant", "assistant", "system"]


def test_usage__totals_across_a_reclaim_and_per_tenant_in_status(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "usage_then_die")
    with running_pool(dsn, APP, lease_seconds=2):
        wait_for(lambda: status_of(conn, run_id) == "succeeded", timeout=25,
                 what="the run to succeed on its second attempt")
    row = run_row(conn, run_id)
    assert row["attempt"] == 2
    expected = {"input_tokens": 20, "output_tokens": 10, "cost": 0.5}
    assert {k: row["result"][k] for k in expected} == expected
    assert {k: row["usage"][k] for k in expected} == expected
    (acme,) = [u for u in collect(conn)["usage"] if u["tenant"] == "acme"]
    assert (acme["runs"], acme["input_tokens"], acme["cost"]) == (1, 20, 0.5)


def test_rate_limit_shared_by_two_pools__within_limit_plus_burst_in_every_window(
        conn: psycopg.Connection, dsn: str) -> None:
    conn.execute("CREATE TABLE rate_log (run_id uuid, at double precision,"
                 " planned double precision)")
    conn.execute("GRANT ALL ON rate_log TO PUBLIC")
    conn.execute("SELECT runpool.set_rate_limit('openai:gpt-x', 600, 3)")  # 10/s, burst 3
    n = 45
    ids = runpool.enqueue_many(conn, [runpool.RunSpec(f"t{i % 3}", "acquire",
                                                      {"key": "openai:gpt-x"})
                                      for i in range(n)])
    with running_pool(dsn, APP, concurrency=8), running_pool(dsn, APP, concurrency=8):
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM runpool.runs"
                                      " WHERE status = 'succeeded'") == n, timeout=30,
                 what="every run admitted and finished")
    assert scalar(conn, "SELECT count(*) FROM rate_log") == n
    assert all(status_of(conn, i) == "succeeded" for i in ids)
    rows = conn.execute("SELECT at, planned FROM rate_log").fetchall()

    def most_in_a_second(times: list[float]) -> int:
        times = sorted(times)
        return max(sum(1 for b in times if a <= b < a + 1.0) for a in times)

    # The reservations both pools got: at most 10 a second + burst 3 (+1: the plan is read
    # on each host's clock around the statement, a millisecond either way at a window's edge).
    assert most_in_a_second([p for _, p in rows]) <= 10 + 3 + 1
    # What the handlers saw: the same, but a timer firing late (a loaded machine) bunches a
    # waiter with the next ones by at most its lateness' worth of the rate.
    late = max(at - planned for at, planned in rows)
    assert most_in_a_second([at for at, _ in rows]) <= 10 + 3 + 1 + math.ceil(10 * late)
    # Two pools served it (the limit was shared, not per pool).
    assert scalar(conn, "SELECT count(DISTINCT worker_id) FROM runpool.runs") == 2


def test_cancelled_run_waiting_for_a_rate_limit__stops_waiting(
        conn: psycopg.Connection, dsn: str) -> None:
    conn.execute("SELECT runpool.set_rate_limit('slow', 1)")  # one a minute
    conn.execute("SELECT runpool.acquire_rate('slow', 1)")  # this minute's is taken
    planned = scalar(conn, "SELECT tat FROM runpool.rate_limits WHERE key = 'slow'")
    waiting = runpool.enqueue(conn, "t", "acquire", {"key": "slow"})
    plain = runpool.enqueue(conn, "t", "acquire_sync", {"key": "slow"})
    with running_pool(dsn, APP, cancel_grace_seconds=30):
        wait_for(lambda: status_of(conn, waiting) == "running"
                 and status_of(conn, plain) == "running", what="both runs waiting")
        for run_id in (waiting, plain):
            conn.execute("SELECT runpool.cancel_run(%s, 'user stop')", (run_id,))
        # Well within the cancel grace (30 s) and the minute the key would make them wait.
        wait_for(lambda: status_of(conn, waiting) == "cancelled"
                 and status_of(conn, plain) == "cancelled", timeout=10,
                 what="both waits to end on the cancel")
    # The last reservation was given back (the other too when it was cancelled last): the
    # key's line is at most one minute longer than before the two runs came.
    tat = scalar(conn, "SELECT tat FROM runpool.rate_limits WHERE key = 'slow'")
    assert tat <= planned + timedelta(minutes=1)


def test_worker_killed_mid_run_with_a_deadline__the_restarted_worker_ends_it(
        conn: psycopg.Connection, dsn: str) -> None:
    with running_pool(dsn, APP, lease_seconds=2):
        wait_for(lambda: live_workers(conn), what="the worker to start")
        # Its lease (2 s from the claim) outlasts the deadline (1.5 s from now): the reap
        # that follows the kill finds the deadline passed.
        run_id = runpool.enqueue(conn, "t", "hang", max_attempts=5,
                                 deadline=datetime.now(UTC) + timedelta(seconds=1.5))
        wait_for(lambda: status_of(conn, run_id) == "running", what="the run to start")
        pid = scalar(conn, "SELECT w.pid FROM runpool.runs r JOIN runpool.workers w"
                           " ON w.id = r.worker_id WHERE r.id = %s", run_id)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: status_of(conn, run_id) == "failed", timeout=20,
                 what="the run to end by its deadline")
    assert _error(conn, run_id)["reason"] == "deadline_exceeded"
    assert run_row(conn, run_id)["attempt"] == 1
