"""Enqueue's cheaper writes (0021): time-ordered run ids (UUID version 7 layout) in input order,
the plain-INSERT path of a batch without idempotency or serial keys storing what the keyed
path stores, and the id's SQL functions inlined (no call per run, no planning per
transaction)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

import runpool
from tests.helpers import events, run_row, scalar

MANY = "SELECT id FROM runpool.enqueue_many(%s) AS id"


def many(conn: psycopg.Connection[Any], runs: Any) -> list[uuid.UUID]:
    return [row[0] for row in conn.execute(MANY, [Jsonb(runs)])]


def _now(conn: psycopg.Connection[Any]) -> datetime:
    return scalar(conn, "SELECT clock_timestamp()")  # type: ignore[no-any-return]


def _id_time(run_id: uuid.UUID) -> datetime:
    """The millisecond a version 7 id carries in its top 48 bits."""
    return datetime.fromtimestamp((run_id.int >> 80) / 1000, UTC)


def _check_layout(ids: list[uuid.UUID], before: datetime, after: datetime) -> None:
    for run_id in ids:
        assert (run_id.version, run_id.variant) == (7, uuid.RFC_4122), run_id
        ms = timedelta(milliseconds=1)
        assert before - ms <= _id_time(run_id) <= after + ms, (run_id, before, after)
    # The random low 62 bits differ from run to run (a trace-id-ratio sampler reads them).
    assert len({run_id.int & (2**62 - 1) for run_id in ids}) == len(ids)


@pytest.mark.parametrize("extra", [{}, {"idempotency_key": None}, {"serial_key": "s"}],
                         ids=["plain", "keyed-path", "serial"])
def test_enqueue_many__ids_are_time_ordered_and_sort_in_input_order(
        conn: psycopg.Connection, extra: dict[str, Any]) -> None:
    runs: list[dict[str, Any]] = [
        {"tenant": f"t{i % 3}", "handler": "noop", "input": {"i": i}, **extra}
        for i in range(500)]
    if "idempotency_key" in extra:
        # One key in the batch takes it down the ON CONFLICT path.
        runs[7]["idempotency_key"] = "k"
    before = _now(conn)
    ids = many(conn, runs)
    after = _now(conn)
    _check_layout(ids, before, after)
    assert ids == sorted(ids) and len(set(ids)) == 500
    assert [run_row(conn, run_id)["input"] for run_id in ids] == [{"i": i} for i in range(500)]
    # The next batch's ids come after this one's.
    (later,) = many(conn, [{"tenant": "t0", "handler": "noop", **extra}])
    assert later > ids[-1]


def test_enqueue__single_ids_are_time_ordered(conn: psycopg.Connection) -> None:
    before = _now(conn)
    ids = [runpool.enqueue(conn, "acme", "noop", {"i": i}) for i in range(20)]
    ids.append(runpool.enqueue(conn, "acme", "noop", idempotency_key="k"))
    after = _now(conn)
    _check_layout(ids, before, after)
    assert ids == sorted(ids)
    # A repeated key still answers with the first run's id.
    assert runpool.enqueue(conn, "acme", "noop", idempotency_key="k") == ids[-1]


def test_enqueue_many__plain_insert_path_stores_what_the_keyed_path_stores(
        conn: psycopg.Connection) -> None:
    # Every field but the keys, through the plain path (no key in the batch) and through the
    # ON CONFLICT path (an idempotency key in the batch); a paused tenant's run is paused.
    conn.execute("INSERT INTO runpool.tenants (tenant, max_running) VALUES ('paused', 0)")
    later = datetime.now(UTC) + timedelta(hours=1)
    run: dict[str, Any] = {
        "handler": "noop", "input": {"deep": [1, {"x": None}]}, "priority": -3,
        "run_at": later.isoformat(), "max_attempts": 7,
        "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01", "timeout": 120,
        "deadline": (later + timedelta(hours=1)).isoformat(), "budget": {"max_turns": 4}}
    plain = many(conn, [{**run, "tenant": "acme"}, {**run, "tenant": "paused"},
                        {"tenant": "acme", "handler": "noop"}])
    keyed = many(conn, [{**run, "tenant": "acme", "idempotency_key": "a"},
                        {**run, "tenant": "paused", "idempotency_key": "b"},
                        {"tenant": "acme", "handler": "noop", "idempotency_key": "c"}])
    skip = {"id", "idempotency_key", "available_at", "rank", "created_at"}
    for p, k in zip(plain, keyed, strict=True):
        p_row, k_row = run_row(conn, p), run_row(conn, k)
        assert {c: v for c, v in p_row.items() if c not in skip} == \
            {c: v for c, v in k_row.items() if c not in skip}, (p_row, k_row)
        assert events(conn, p) == events(conn, k) == ["enqueued"]
    assert [run_row(conn, i)["paused"] for i in plain] == [False, True, False]
    assert run_row(conn, plain[0])["available_at"] == later
    assert scalar(conn, "SELECT count(*) FROM runpool.run_events WHERE detail IS NOT NULL") == 0


@pytest.mark.parametrize("expression", [
    "runpool.new_run_id(runpool.epoch_us($1), runpool.new_run_salt())",
    "runpool.new_run_id($2 - ($3 - $4), $2)",
])
def test_the_run_id_functions_are_inlined_in_generic_plans(
        conn: psycopg.Connection, expression: str) -> None:
    # plpgsql plans its statements generically: a function not inlined there is called per
    # run, and a SQL function's body is parsed again in every transaction (0021's header).
    conn.execute("SET plan_cache_mode = force_generic_plan")
    conn.execute(f"PREPARE ids(timestamptz, bigint, bigint, bigint) AS SELECT {expression}")
    plan = "\n".join(r[0] for r in conn.execute(
        "EXPLAIN (VERBOSE, COSTS OFF) EXECUTE ids(now(), 1, 2, 3)"))
    assert "runpool." not in plan, plan


def test_run_ids_do_not_repeat_after_setseed(conn: psycopg.Connection) -> None:
    # random() is the session's generator, which a caller may seed; the salt, drawn from the
    # strong source, keeps two sessions seeded alike from making the same id.
    same = ("SELECT runpool.new_run_id(1700000000000000, {salt})"
            " FROM (SELECT setseed(0.5)) AS seeded")
    unsalted = {scalar(conn, same.format(salt="0")) for _ in range(2)}
    salted = {scalar(conn, same.format(salt="runpool.new_run_salt()")) for _ in range(2)}
    assert (len(unsalted), len(salted)) == (1, 2)
