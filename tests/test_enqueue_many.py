"""runpool.enqueue_many(runs jsonb) (0016): one set-based call, all or none, ids in input
order, idempotency keys as enqueue honours them, one doorbell per batch."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

import runpool
from runpool.db import connect
from runpool.testing import wait_for
from tests.helpers import events, run_row, rung_before_fence, scalar

MANY = "SELECT id FROM runpool.enqueue_many(%s) AS id"


def many(conn: psycopg.Connection[Any], runs: Any) -> list[uuid.UUID]:
    return [row[0] for row in conn.execute(MANY, [Jsonb(runs)])]


def test_enqueue_many_sql__ids_in_input_order_and_rows_like_enqueues(
        conn: psycopg.Connection) -> None:
    runs = [{"tenant": f"t{i % 3}", "handler": "noop", "input": {"i": i}, "priority": i % 5}
            for i in range(300)]
    ids = many(conn, runs)
    assert len(set(ids)) == 300
    for i, run_id in enumerate(ids):
        row = run_row(conn, run_id)
        assert (row["tenant"], row["input"], row["priority"], row["status"], row["max_attempts"]
                ) == (f"t{i % 3}", {"i": i}, i % 5, "queued", 3), (i, row)
        assert events(conn, run_id) == ["enqueued"]
    # The batch keeps its order: arrival times strictly increase in input order.
    arrivals = [run_row(conn, i)["available_at"] for i in ids]
    assert arrivals == sorted(arrivals) and len(set(arrivals)) == 300
    # Defaults are enqueue's: an omitted input is {}, no priority is 0.
    (plain,) = many(conn, [{"tenant": "t", "handler": "noop"}])
    assert (run_row(conn, plain)["input"], run_row(conn, plain)["priority"]) == ({}, 0)
    assert many(conn, []) == []


def test_enqueue_many_sql__idempotency_keys_in_the_table_and_in_the_batch(
        conn: psycopg.Connection) -> None:
    first = runpool.enqueue(conn, "acme", "noop", {"n": 0}, idempotency_key="old")
    ids = many(conn, [
        {"tenant": "acme", "handler": "noop", "input": {"n": 1}, "idempotency_key": "new"},
        {"tenant": "acme", "handler": "noop", "input": {"n": 2}, "idempotency_key": "old"},
        {"tenant": "acme", "handler": "noop", "input": {"n": 3}, "idempotency_key": "new"},
        {"tenant": "other", "handler": "noop", "input": {"n": 4}, "idempotency_key": "new"},
    ])
    assert ids[1] == first
    assert ids[0] == ids[2] != ids[3]
    assert run_row(conn, ids[0])["input"] == {"n": 1}
    assert scalar(conn, "SELECT count(*) FROM runpool.runs") == 3
    assert scalar(conn, "SELECT count(*) FROM runpool.run_events") == 3


def test_enqueue_many_sql__one_bad_element_is_named_and_nothing_is_written(
        conn: psycopg.Connection) -> None:
    good = {"tenant": "acme", "handler": "noop"}
    cases: list[tuple[Any, str]] = [
        ({"tenant": "", "handler": "noop"}, r"runs\[1\]: tenant must be"),
        ({"handler": "noop"}, r"runs\[1\]: tenant must be"),
        ({"tenant": 5, "handler": "noop"}, r"runs\[1\]: tenant must be"),
        ({"tenant": "a", "handler": "x" * 201}, r"runs\[1\]: handler must be"),
        ({**good, "priority": "high"}, r"runs\[1\]: priority must be"),
        ({**good, "priority": 101}, r"runs\[1\]: priority must be"),
        ({**good, "priority": 1.5}, r"runs\[1\]: priority must be"),
        ({**good, "max_attempts": 0}, r"runs\[1\]: max_attempts must be"),
        ({**good, "idempotency_key": ""}, r"runs\[1\]: idempotency_key must be"),
        ({**good, "serial_key": 7}, r"runs\[1\]: serial_key must be"),
        ({**good, "traceparent": "t" * 129}, r"runs\[1\]: traceparent"),
        ({**good, "run_at": "not a time"}, r"runs\[1\]: run_at must be"),
        ({**good, "run_at": "infinity"}, r"runs\[1\]: run_at must be"),
        ({**good, "run_at": "3000-01-01T00:00:00Z"}, r"runs\[1\]: run_at must be"),
        ({**good, "timeout": -1}, r"runs\[1\]: timeout must be"),
        ({**good, "timeout": 1e-9}, r"runs\[1\]: timeout must be"),
        ({**good, "timeout": "1 hour"}, r"runs\[1\]: timeout must be"),
        ({**good, "deadline": "soon"}, r"runs\[1\]: deadline must be"),
        ({**good, "budget": [1]}, r"runs\[1\]: budget must be"),
        ({**good, "budget": {"max_turns": -1}}, r"budget\.max_turns"),
        ({**good, "prio": 1}, r"runs\[1\]: unknown key 'prio'"),
        ("acme", r"runs\[1\]: must be a JSON object"),
        ({**good, "input": {"x": "y" * 1_100_000}}, r"runs\[1\]: input is"),
    ]
    for bad, message in cases:
        with pytest.raises(psycopg.Error,
                           match=message) as caught:
            many(conn, [good, bad, good])
        # Bad input, in the classes runpool's Python API turns into InvalidInput.
        assert isinstance(caught.value, psycopg.errors.InvalidParameterValue
                          | psycopg.errors.ProgramLimitExceeded), (bad, caught.value)
    for not_array in ({"tenant": "a"}, "x", None):
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="JSON array"):
            conn.execute(MANY, [Jsonb(not_array) if not_array is not None else None])
    assert scalar(conn, "SELECT count(*) FROM runpool.runs") == 0
    assert scalar(conn, "SELECT count(*) FROM runpool.tenants WHERE tenant = 'acme'") == 0


def test_enqueue_many_sql__one_doorbell_per_batch_after_commit(dsn: str) -> None:
    with connect(dsn, autocommit=True) as listener, connect(dsn) as conn:
        listener.execute("LISTEN runpool_wakeup")
        many(conn, [{"tenant": "acme", "handler": "noop"}] * 50)
        assert list(listener.notifies(timeout=0.2)) == []
        conn.commit()
        notes = rung_before_fence(listener, dsn, "runpool_wakeup")
        assert [(n.channel, n.payload) for n in notes] == [("runpool_wakeup", "")]
        many(conn, [{"tenant": "acme", "handler": "noop", "idempotency_key": "k"}])
        conn.commit()
        assert len(rung_before_fence(listener, dsn, "runpool_wakeup")) == 1
        # A batch of known keys only adds nothing and rings nothing.
        many(conn, [{"tenant": "acme", "handler": "noop", "idempotency_key": "k"}])
        conn.commit()
        assert rung_before_fence(listener, dsn, "runpool_wakeup") == []


def test_enqueue_many_sql__serial_keys_queue_in_input_order_behind_a_queued_run(
        conn: psycopg.Connection) -> None:
    runpool.enqueue(conn, "acme", "noop", serial_key="busy")  # queued: the key's head
    ids = many(conn, [{"tenant": "acme", "handler": "noop", "serial_key": "fresh"},
                      {"tenant": "acme", "handler": "noop", "serial_key": "busy"},
                      {"tenant": "acme", "handler": "noop", "serial_key": "fresh"},
                      {"tenant": "other", "handler": "noop", "serial_key": "fresh"}])
    held = [run_row(conn, i)["held"] for i in ids]
    assert held == [False, True, True, False]
    orders = [run_row(conn, i)["serial_order"] for i in ids]
    assert orders == sorted(orders)
    detail = scalar(conn, "SELECT detail FROM runpool.run_events WHERE run_id = %s", ids[1])
    assert detail == {"held_by_serial_key": "busy"}


def test_enqueue_many_sql__concurrent_batches_sharing_keys_get_the_same_ids(dsn: str) -> None:
    # 8 sessions each enqueue the same 200 keys (in different orders): one row per key, and
    # every session gets that row's id, including the ones whose insert waited for another's.
    keys = [f"k{i}" for i in range(200)]
    barrier = threading.Barrier(8)
    results: dict[int, dict[str, uuid.UUID]] = {}
    errors: list[BaseException] = []

    def one(n: int) -> None:
        try:
            order = keys[n * 25:] + keys[:n * 25]
            with connect(dsn) as c:
                c.execute("SELECT 1")
                barrier.wait(timeout=30)
                ids = many(c, [{"tenant": "acme", "handler": "noop", "idempotency_key": k}
                               for k in order])
                c.commit()
            results[n] = dict(zip(order, ids, strict=True))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert all(results[n] == results[0] for n in range(8))
    with connect(dsn) as c:
        assert scalar(c, "SELECT count(*) FROM runpool.runs") == 200
        assert scalar(c, "SELECT count(*) FROM runpool.run_events") == 200


# A test's gate: each transaction's second keyed run waits, before it is inserted, for the
# advisory lock the test holds (its first run is in by then, and its key taken).
_GATE = """
CREATE FUNCTION public.second_run_waits() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE n integer := coalesce(nullif(current_setting('test.keyed', true), ''), '0')::integer + 1;
BEGIN
    PERFORM set_config('test.keyed', n::text, true);
    IF n = 2 THEN
        PERFORM pg_advisory_xact_lock_shared(4242);
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER second_run_waits BEFORE INSERT ON runpool.runs
FOR EACH ROW WHEN (NEW.idempotency_key IS NOT NULL) EXECUTE FUNCTION public.second_run_waits();
"""


def test_enqueue_many_sql__two_batches_with_keys_in_opposite_orders_do_not_deadlock(
        dsn: str) -> None:
    # Two sessions enqueue the same two keys, one as [a, b], the other as [b, a], and each
    # has written its first run when the other reaches its second. Inserted in input order,
    # each first run holds the key the other's second needs: a deadlock (40P01), one batch
    # lost. Inserted in key order, the second session waits on its first key for the first
    # session, then finds both keys taken and returns their ids.
    results: dict[str, list[uuid.UUID]] = {}
    errors: list[BaseException] = []

    def one(name: str, keys: list[str]) -> None:
        try:
            with connect(dsn) as c:
                results[name] = many(c, [{"tenant": "acme", "handler": "noop",
                                          "idempotency_key": k} for k in keys])
                c.commit()
        except BaseException as exc:  # reported below
            errors.append(exc)

    with connect(dsn) as gate, connect(dsn) as observer:
        gate.autocommit = observer.autocommit = True
        gate.execute(_GATE)
        # The tenant known: neither session waits for the other's insertion of its row.
        gate.execute("INSERT INTO runpool.tenants (tenant) VALUES ('acme')")
        gate.execute("SELECT pg_advisory_lock(4242)")
        threads = [threading.Thread(target=one, args=("ab", ["a", "b"])),
                   threading.Thread(target=one, args=("ba", ["b", "a"]))]
        for t in threads:
            t.start()
        # Both sessions stopped: at the gate, or (in key order) behind the other's first key.
        wait_for(lambda: scalar(observer, """
            SELECT count(*) FROM pg_stat_activity
            WHERE datname = current_database() AND wait_event_type = 'Lock'
              AND query LIKE '%enqueue_many%'""") == 2, 30,
                 what="both batches to be waiting")
        gate.execute("SELECT pg_advisory_unlock(4242)")
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        assert results["ab"] == results["ba"][::-1] and len(set(results["ab"])) == 2
        assert scalar(observer, "SELECT count(*) FROM runpool.runs") == 2


def test_enqueue_many_sql__an_operator_holding_an_unpaused_tenant_is_not_waited_for(
        dsn: str) -> None:
    # Only a tenant that reads as paused is upserted (0022: so an unpause being committed
    # cannot miss the batch); an unpaused one is read, as by enqueue (test_attack_one_trip).
    with connect(dsn) as operator, connect(dsn) as app:
        operator.execute("SELECT runpool.set_tenant_quota('acme', 5)")
        operator.commit()
        operator.execute("SELECT runpool.set_tenant_quota('acme', 3)")  # held, uncommitted
        # A wait would end in an error here, not hang the test.
        app.execute("SET lock_timeout = '10s'")
        ids = many(app, [{"tenant": "acme", "handler": "noop"},
                         {"tenant": "acme", "handler": "noop", "idempotency_key": "k"}])
        app.commit()
        operator.commit()
        assert len(ids) == 2
        assert scalar(app, "SELECT count(*) FROM runpool.runs WHERE NOT paused") == 2


def test_enqueue_many_sql__the_api_role_may_call_it(conn: psycopg.Connection) -> None:
    conn.execute("SET ROLE runpool_api")
    try:
        (run_id,) = many(conn, [{"tenant": "acme", "handler": "noop"}])
    finally:
        conn.execute("RESET ROLE")
    assert run_row(conn, run_id)["tenant"] == "acme"


def test_enqueue_many_python__carries_every_field_of_a_run_spec(conn: psycopg.Connection) -> None:
    from datetime import UTC, datetime, timedelta

    later = datetime.now(UTC) + timedelta(hours=1)
    (run_id,) = runpool.enqueue_many(conn, [runpool.RunSpec(
        "acme", "noop", {"deep": [1, {"x": None}]}, priority=-3, idempotency_key="ik",
        run_at=later, max_attempts=7, traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01",
        serial_key="sk", timeout=timedelta(minutes=2), deadline=later + timedelta(hours=1),
        budget={"max_turns": 4})])
    row = run_row(conn, run_id)
    assert (row["input"], row["priority"], row["idempotency_key"], row["available_at"],
            row["max_attempts"], row["traceparent"], row["serial_key"], row["attempt_timeout"],
            row["deadline"], row["budget"], row["deferred"]) == (
        {"deep": [1, {"x": None}]}, -3, "ik", later, 7, "00-" + "1" * 32 + "-" + "2" * 16 + "-01",
        "sk", timedelta(minutes=2), later + timedelta(hours=1), {"max_turns": 4}, True)
