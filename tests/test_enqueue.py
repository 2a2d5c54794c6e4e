from __future__ import annotations

import asyncio
import json
import threading
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

import runpool
from runpool.db import aconnect, connect
from tests.helpers import events, run_row, running_pool, scalar, wait_for


def test_enqueue__stores_the_run_and_joins_the_callers_transaction(dsn: str) -> None:
    with connect(dsn) as conn:
        run_id = runpool.enqueue(conn, "acme", "noop", {"q": "hello"}, priority=5)
        conn.rollback()
        assert conn.execute("SELECT count(*) FROM runpool.runs").fetchone() == (0,)
        run_id = runpool.enqueue(conn, "acme", "noop", {"q": "hello"}, priority=5)
        conn.commit()
        row = run_row(conn, run_id)
    assert isinstance(run_id, uuid.UUID)
    assert (row["tenant"], row["handler"], row["status"], row["priority"], row["input"],
            row["attempt"], row["max_attempts"]) == ("acme", "noop", "queued", 5,
                                                     {"q": "hello"}, 0, 3)


def test_enqueue__rings_the_doorbell_with_no_data_after_commit(dsn: str) -> None:
    with connect(dsn, autocommit=True) as listener, connect(dsn) as conn:
        listener.execute("LISTEN runpool_wakeup")
        runpool.enqueue(conn, "acme", "noop", {"secret": "s3cr3t"})
        assert list(listener.notifies(timeout=0.2)) == []
        conn.commit()
        notes = list(listener.notifies(timeout=2, stop_after=1))
    assert [(n.channel, n.payload) for n in notes] == [("runpool_wakeup", "")]


def test_enqueue__repeated_idempotency_key_returns_the_same_id(conn: psycopg.Connection) -> None:
    a = runpool.enqueue(conn, "acme", "noop", {"n": 1}, idempotency_key="k1")
    b = runpool.enqueue(conn, "acme", "noop", {"n": 2}, idempotency_key="k1")
    c = runpool.enqueue(conn, "other", "noop", {"n": 3}, idempotency_key="k1")
    assert a == b != c
    assert run_row(conn, a)["input"] == {"n": 1}


def test_enqueue__32_sessions_racing_one_key_make_one_row(dsn: str) -> None:
    barrier = threading.Barrier(32)
    ids: list[uuid.UUID] = []

    def one() -> None:
        with connect(dsn) as c:
            c.execute("SELECT 1")
            barrier.wait(timeout=30)
            ids.append(runpool.enqueue(c, "acme", "noop", idempotency_key="same"))
            c.commit()

    threads = [threading.Thread(target=one) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(ids) == 32 and len(set(ids)) == 1
    with connect(dsn) as c:
        assert c.execute("SELECT count(*) FROM runpool.runs").fetchone() == (1,)


def test_enqueue_async__works_like_enqueue(dsn: str) -> None:
    async def main() -> uuid.UUID:
        async with await aconnect(dsn) as aconn:
            run_id = await runpool.enqueue_async(aconn, "acme", "noop", [1, 2], priority=-3)
            await aconn.commit()
            return run_id

    run_id = asyncio.run(main())
    with connect(dsn) as conn:
        row = run_row(conn, run_id)
    assert (row["input"], row["priority"]) == ([1, 2], -3)


def test_enqueue_many__returns_ids_in_order(conn: psycopg.Connection) -> None:
    specs = [runpool.RunSpec("t", "noop", {"i": i}, priority=i % 3) for i in range(50)]
    ids = runpool.enqueue_many(conn, specs)
    got = {i: r for i, r in conn.execute("SELECT id, input FROM runpool.runs")}
    assert [got[i]["i"] for i in ids] == list(range(50))
    assert events(conn, ids[0]) == ["enqueued"]


BAD: list[tuple[dict[str, Any], str]] = [
    ({"tenant": ""}, "tenant must be 1 to 200 characters"),
    ({"tenant": "x" * 201}, "tenant must be 1 to 200 characters"),
    ({"handler": ""}, "handler must be 1 to 200 characters"),
    ({"priority": 101}, "priority must be between -100 and 100"),
    ({"priority": -101}, "priority must be between -100 and 100"),
    ({"max_attempts": 0}, "max_attempts must be between 1 and 1000"),
    ({"idempotency_key": ""}, "idempotency_key must be 1 to 200"),
    ({"input": {"text": "a\x00b"}}, "NUL"),
    ({"input": {"text": "\ud800"}}, "not JSON-serialisable"),
    ({"input": {"s": {1, 2}}}, "not JSON-serialisable"),
    ({"input": {"big": 2**70}}, "not JSON-serialisable"),
    ({"tenant": "a\x00b"}, "tenant contains a NUL"),
    ({"input": {"blob": "x" * (1024 * 1024)}}, "over the limit of 1048576 bytes"),
]


@pytest.mark.parametrize(("change", "message"), BAD, ids=[m for _, m in BAD])
def test_enqueue_bad_input__clear_error_nothing_written_transaction_usable(
    dsn: str, change: dict[str, Any], message: str
) -> None:
    args: dict[str, Any] = {"tenant": "acme", "handler": "noop", "input": {}}
    args.update(change)
    with connect(dsn) as conn:
        good = runpool.enqueue(conn, "acme", "noop")
        with pytest.raises(runpool.InvalidInput, match=message):
            runpool.enqueue(conn, args.pop("tenant"), args.pop("handler"), args.pop("input"),
                            **args)
        # The caller's transaction survived the refusal: its earlier write commits.
        conn.commit()
        assert [r for (r,) in conn.execute("SELECT id FROM runpool.runs")] == [good]


def test_enqueue_input_limit__is_configurable(conn: psycopg.Connection) -> None:
    conn.execute("UPDATE runpool.config SET max_input_bytes = 100")
    runpool.enqueue(conn, "acme", "noop", {"x": "y" * 50})
    with pytest.raises(runpool.InvalidInput, match="over the limit of 100 bytes"):
        runpool.enqueue(conn, "acme", "noop", {"x": "y" * 200})


def test_enqueue_sql__injection_in_tenant_is_just_data(conn: psycopg.Connection) -> None:
    tenant = "x'); DROP TABLE runpool.runs; --"
    run_id = scalar(conn, "SELECT runpool.enqueue(%s, 'noop')", tenant)
    assert run_row(conn, run_id)["tenant"] == tenant


def test_input_integers_beyond_64_bits__reach_the_handler_exact(conn: psycopg.Connection,
                                                                 dsn: str) -> None:
    # Through SQL (another language's client, a trigger): jsonb stores any integer exactly.
    big = {"big": 123456789012345678901234567890, "low": -9223372036854775809,
           "max": 18446744073709551615, "small": 7, "pi": 3.25, "text": "1234567890123456789012"}
    run_id = scalar(conn, "SELECT runpool.enqueue('acme', 'input_types', %s)",
                    Jsonb(big, dumps=json.dumps))
    long_text = scalar(conn, "SELECT runpool.enqueue('acme', 'input_types', %s)",
                       Jsonb({"n": 1, "text": "1234567890123456789012"}, dumps=json.dumps))
    with running_pool(dsn):
        wait_for(lambda: all(run_row(conn, r)["status"] == "succeeded"
                             for r in (run_id, long_text)), what="runs")
    assert run_row(conn, run_id)["result"] == {
        key: [type(value).__name__, str(value)] for key, value in big.items()}
    assert run_row(conn, long_text)["result"] == {"n": ["int", "1"],
                                                  "text": ["str", "1234567890123456789012"]}
    # runpool's Python API refuses what it could not give back exactly.
    with pytest.raises(runpool.InvalidInput, match="64-bit"):
        runpool.enqueue(conn, "acme", "input_types", {"big": 2**64})
