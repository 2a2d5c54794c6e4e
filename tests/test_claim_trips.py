"""A claim costs one round trip (BEGIN, the reap, the tenant locks, the claim and COMMIT behind
one Sync: W2's wake-up path), and a claim that fails leaves its connection out of any
transaction, ready for the next."""

from __future__ import annotations

import asyncio
import itertools
import tempfile
import uuid

import psycopg
import pytest

import runpool
from runpool.claiming import claim
from runpool.db import aconnect


async def _claim_traced(dsn: str) -> tuple[int, int]:
    """Runs claimed and protocol round trips of one claim of one queued run, on a pooled
    (autocommit) connection: the times the server's messages follow the client's (one: the
    client sent the whole claim before it heard anything back)."""
    async with await aconnect(dsn, autocommit=True) as conn:
        with tempfile.TemporaryFile("w+") as trace:
            conn.pgconn.trace(trace.fileno())
            got = await claim(conn, limit=5, worker_id=uuid.uuid4(), lease_seconds=30,
                              handlers=["noop"])
            conn.pgconn.untrace()
            trace.seek(0)
            fields = [line.split("\t") for line in trace.read().splitlines()]
    sides = [f[1] for f in fields if len(f) > 1 and f[1] in ("F", "B")]
    return len(got), sum(1 for pair in itertools.pairwise(sides) if pair == ("F", "B"))


def test_claim__is_one_round_trip(conn: psycopg.Connection, dsn: str) -> None:
    runpool.enqueue(conn, "acme", "noop")
    assert asyncio.run(_claim_traced(dsn)) == (1, 1)


def test_claim__a_failed_claim_rolls_back_and_leaves_the_connection_idle(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")

    async def main() -> tuple[psycopg.pq.TransactionStatus, int]:
        async with await aconnect(dsn, autocommit=True) as c:
            # The claim itself fails (the lease's interval overflows) after the locks.
            with pytest.raises(psycopg.DataError):
                await claim(c, limit=1, worker_id=uuid.uuid4(), lease_seconds=1e300,
                            handlers=["noop"])
            status = c.info.transaction_status
            return status, len(await claim(c, limit=1, worker_id=uuid.uuid4(),
                                           lease_seconds=30, handlers=["noop"]))

    assert asyncio.run(main()) == (psycopg.pq.TransactionStatus.IDLE, 1)
    assert conn.execute("SELECT status FROM runpool.runs WHERE id = %s",
                        (run_id,)).fetchone() == ("running",)
