"""Enqueue's round trips: one in autocommit; inside the caller's open transaction three (its
savepoint, the call and the release: psycopg's transaction(), kept over a pipelined one because
that one could neither be rolled back after a cancellation nor be shared by concurrent tasks,
tests/test_attack3_enqueue.py), and a refusal still leaves that transaction usable with its
earlier writes."""

from __future__ import annotations

import asyncio
import itertools
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

import runpool
from tests.helpers import scalar


@contextmanager
def _trips(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]
           ) -> Iterator[Callable[[], int]]:
    """Round trips on conn inside the block: the times the server's messages follow the
    client's, in a protocol trace."""
    counted: list[int] = []
    with tempfile.TemporaryFile("w+") as trace:
        conn.pgconn.trace(trace.fileno())
        try:
            yield lambda: counted[0]
        finally:
            conn.pgconn.untrace()
            trace.seek(0)
            sides = [f[1] for f in (line.split("\t") for line in trace.read().splitlines())
                     if len(f) > 1 and f[1] in ("F", "B")]
            counted.append(sum(1 for pair in itertools.pairwise(sides) if pair == ("F", "B")))


def test_enqueue_in_autocommit__one_round_trip(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        with _trips(conn) as trips:
            runpool.enqueue(conn, "acme", "noop")
        assert trips() == 1
        with _trips(conn) as trips:
            many = runpool.enqueue_many(conn, [runpool.RunSpec("acme", "noop")] * 3)
        assert (trips(), len(many)) == (1, 3)


def test_enqueue_async_in_autocommit__one_round_trip(dsn: str) -> None:
    async def main() -> int:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            with _trips(conn) as trips:
                await runpool.enqueue_async(conn, "acme", "noop")
            return trips()

    assert asyncio.run(main()) == 1


def test_enqueue_in_a_transaction__three_round_trips_and_a_refusal_keeps_it_usable(
        dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1")  # the caller's open transaction
        with _trips(conn) as trips:
            first = runpool.enqueue(conn, "acme", "noop")
        assert trips() == 3
        with _trips(conn) as trips:
            many = runpool.enqueue_many(conn, [runpool.RunSpec("acme", "noop")] * 3)
        assert (trips(), len(many)) == (3, 3)
        with pytest.raises(runpool.InvalidInput, match="priority"):
            runpool.enqueue(conn, "acme", "noop", priority=500)
        with pytest.raises(runpool.InvalidInput, match=r"runs\[1\]"):
            runpool.enqueue_many(conn, [runpool.RunSpec("acme", "noop"),
                                        runpool.RunSpec("acme", "noop", priority=500)])
        # Usable, nothing of the refused calls written, no savepoint of enqueue's left.
        second = runpool.enqueue(conn, "acme", "noop")
        conn.commit()
        assert scalar(conn, "SELECT count(*) FROM runpool.runs") == 5
        assert {first, second} <= {r for (r,) in conn.execute("SELECT id FROM runpool.runs")}
        conn.commit()


def test_enqueue_async_in_a_transaction__three_round_trips_and_a_refusal_keeps_it_usable(
        dsn: str) -> None:
    async def main() -> int:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            await conn.execute("SELECT 1")
            with _trips(conn) as trips:
                await runpool.enqueue_async(conn, "acme", "noop")
            with pytest.raises(runpool.InvalidInput, match="handler"):
                await runpool.enqueue_async(conn, "acme", "")
            await runpool.enqueue_async(conn, "acme", "noop")
            await conn.commit()
            return trips()

    assert asyncio.run(main()) == 3
    with psycopg.connect(dsn) as conn:
        assert scalar(conn, "SELECT count(*) FROM runpool.runs") == 2


def test_enqueue_async_from_concurrent_tasks__a_refusal_costs_only_its_own_call(
        dsn: str) -> None:
    # Tasks sharing one connection in the caller's transaction, one of them refused: each call
    # in a savepoint of its own, so the others' runs stay and the transaction commits. With
    # every task checking the connection's status unserialised, the later tasks saw it busy
    # (ACTIVE), ran with no savepoint, and the refusal aborted them all.
    async def main() -> list[object]:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            await conn.execute("SELECT 1")
            results = await asyncio.gather(*(
                runpool.enqueue_async(conn, "acme", "" if i == 1 else "noop", {"i": i})
                for i in range(4)), return_exceptions=True)
            await conn.commit()
            return list(results)

    results = asyncio.run(main())
    assert [type(r).__name__ for r in results] == ["UUID", "InvalidInput", "UUID", "UUID"]
    with psycopg.connect(dsn) as conn:
        assert {r for (r,) in conn.execute("SELECT id FROM runpool.runs")} == \
            {results[0], results[2], results[3]}
