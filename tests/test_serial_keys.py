"""Per-key serialisation: one live lease per (tenant, serial_key), in enqueue order."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import uuid
from collections import defaultdict

import psycopg
import pytest

import runpool
from runpool.claiming import claim
from runpool.db import aconnect
from runpool.harness.throughput_workloads import ORDER_VIOLATIONS
from runpool.queries import QUERIES
from runpool.testing import Watch
from tests.helpers import (
    assert_invariants,
    events,
    finish_params,
    race_claimers,
    run_row,
    running_pool,
    scalar,
    wait_for,
)

# Keys with more than one live lease right now (must always be empty).
DOUBLE_LEASES = """
SELECT tenant, serial_key, count(*) FROM runpool.runs
WHERE serial_key IS NOT NULL AND status = 'running' AND lease_expires_at > now()
GROUP BY tenant, serial_key HAVING count(*) > 1
"""


def test_serial_keys__16_claimers_never_two_leases_per_key_and_start_in_order(
        conn: psycopg.Connection, dsn: str) -> None:
    keys = [f"k{i:03d}" for i in range(200)]
    specs = [runpool.RunSpec(f"t{i % 4}", "noop", {"n": n}, priority=random.randint(-5, 5),
                             serial_key=key)
             for n in range(20) for i, key in enumerate(keys)]
    runpool.enqueue_many(conn, specs)
    violations, samples = race_claimers(dsn, claimers=16, max_limit=8, probe=DOUBLE_LEASES)
    assert samples > 20
    assert violations == []
    assert scalar(conn, "SELECT count(*) FROM runpool.runs WHERE status = 'succeeded'") == 4000
    # Within each key, the start order (by claim event) is the enqueue order.
    starts: dict[str, list[int]] = defaultdict(list)
    for key, n in conn.execute(
            "SELECT r.serial_key, (r.input ->> 'n')::int FROM runpool.run_events e"
            " JOIN runpool.runs r ON r.id = e.run_id WHERE e.kind = 'claimed' ORDER BY e.id"):
        starts[key].append(n)
    assert all(order == list(range(20)) for order in starts.values()), starts


def test_serial_key__depth_behind_a_running_run_costs_the_claim_nothing(
        conn: psycopg.Connection, dsn: str) -> None:
    runpool.enqueue_many(conn, [runpool.RunSpec("t", "noop", serial_key="busy")
                                for _ in range(10_000)])
    other = runpool.enqueue(conn, "t", "noop", serial_key="other")

    async def claim_all() -> list[uuid.UUID]:
        async with await aconnect(dsn, autocommit=True) as c:
            return [r.id for r in await claim(c, worker_id=uuid.uuid4(), limit=50,
                                              lease_seconds=30)]

    first = asyncio.run(claim_all())
    assert len(first) == 2 and other in first  # one head per key, nothing more
    assert asyncio.run(claim_all()) == []
    assert scalar(conn, "SELECT count(*) FROM runpool.runs WHERE held") == 9_999


def test_serial_keys_through_real_workers__batched_release_keeps_one_lease_and_the_order(
        conn: psycopg.Connection, dsn: str) -> None:
    """The outcome writer releases the keys it ends itself, set-based (not the trigger)."""
    specs = [runpool.RunSpec("t", "noop", {"i": i}, serial_key=f"k{k}")
             for i in range(10) for k in range(30)]
    ids = runpool.enqueue_many(conn, specs)
    with Watch(dsn, interval=0.005) as watch, running_pool(dsn, workers=2, concurrency=8):
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM runpool.runs"
                                " WHERE status = 'succeeded'") == len(ids), timeout=60,
                 what="every run")
    assert scalar(conn, ORDER_VIOLATIONS) == 0
    assert_invariants(conn, watch=watch)


def test_serial_key__worker_killed_holding_a_key_blocks_it_until_reclaimed_and_finished(
        conn: psycopg.Connection, dsn: str) -> None:
    first = runpool.enqueue(conn, "t", "sleep", {"seconds": 1}, serial_key="conv")
    second = runpool.enqueue(conn, "t", "noop", serial_key="conv")
    with running_pool(dsn, workers=2, lease_seconds=1.5):
        wait_for(lambda: run_row(conn, first)["status"] == "running", what="claim")
        pid = scalar(conn, "SELECT w.pid FROM runpool.workers w JOIN runpool.runs r"
                     " ON r.worker_id = w.id WHERE r.id = %s", first)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: run_row(conn, second)["status"] == "succeeded", timeout=30,
                 what="second run")
    a, b = run_row(conn, first), run_row(conn, second)
    assert (a["status"], a["attempt"]) == ("succeeded", 2)
    # The second run started only after the first one's reclaimed attempt had finished.
    assert b["started_at"] >= a["finished_at"]
    assert events(conn, first) == ["enqueued", "claimed", "reclaimed", "claimed", "succeeded"]
    assert_invariants(conn)


def test_serial_key__cancelling_frees_the_key_and_keeps_the_rest_in_order(
        conn: psycopg.Connection, dsn: str) -> None:
    ids = [runpool.enqueue(conn, "t", "hold" if n == 0 else "noop", {"n": n},
                           serial_key="conv") for n in range(5)]
    with running_pool(dsn, workers=1, concurrency=4):
        wait_for(lambda: run_row(conn, ids[0])["status"] == "running", what="head running")
        assert scalar(conn, "SELECT runpool.cancel_run(%s)", ids[2]) == "cancelled"
        explained = scalar(conn, "SELECT runpool.explain_run(%s)", ids[1])
        assert explained["summary"] == (
            f"waiting for run {ids[0]} of the same serial key conv")
        assert scalar(conn, "SELECT runpool.cancel_run(%s)", ids[0]) == "cancelling"
        wait_for(lambda: run_row(conn, ids[4])["status"] == "succeeded", timeout=10,
                 what="rest of the key")
    statuses = [run_row(conn, i)["status"] for i in ids]
    assert statuses == ["cancelled", "succeeded", "cancelled", "succeeded", "succeeded"]
    started = [run_row(conn, i)["started_at"] for i in (ids[1], ids[3], ids[4])]
    assert started == sorted(started)
    assert_invariants(conn, cancel_bound=15)


def test_serial_key__existing_calls_work_and_bad_keys_are_refused(
        conn: psycopg.Connection) -> None:
    # The eight-argument call of the SQL API (before serial keys) still works.
    scalar(conn, "SELECT runpool.enqueue('t', 'noop', '{}', 0, NULL, NULL, NULL, NULL)")
    for bad in ("", "k" * 201):
        with pytest.raises(runpool.InvalidInput, match="serial_key must be 1 to 200"):
            runpool.enqueue(conn, "t", "noop", serial_key=bad)
    with pytest.raises(runpool.InvalidInput, match="serial_key contains a NUL"):
        runpool.enqueue(conn, "t", "noop", serial_key="a\x00b")
    assert scalar(conn, "SELECT count(*) FROM runpool.runs") == 1


def test_serial_key__retry_run_rejoins_the_key_at_the_back(conn: psycopg.Connection) -> None:
    a = runpool.enqueue(conn, "t", "noop", serial_key="k")
    b = runpool.enqueue(conn, "t", "noop", serial_key="k")
    conn.execute("UPDATE runpool.runs SET status = 'failed', finished_at = now(),"
                 " attempt = 1 WHERE id = %s", (a,))
    assert run_row(conn, b)["held"] is False  # a's end released b
    assert scalar(conn, "SELECT runpool.retry_run(%s)", a) == "queued"
    assert (run_row(conn, a)["held"], run_row(conn, b)["held"]) == (True, False)


@pytest.mark.parametrize("path", ["trigger", "batched"])
def test_cancel_of_the_next_waiting_run_racing_the_heads_end__the_one_after_is_released(
        conn: psycopg.Connection, dsn: str, path: str) -> None:
    """Found in review: cancel_run takes no key lock, so the release could pick the run being
    cancelled, release a cancelled run and leave the key with no head forever. The release
    passes over the run being cancelled (it never waits for a caller: issue 11)."""
    head, nxt, after = (runpool.enqueue(conn, "t", "noop", serial_key="k") for _ in range(3))
    ((_, attempt),) = asyncio.run(_claim_all(dsn))
    canceller = psycopg.connect(dsn)  # a transaction of its own, left open
    try:
        assert canceller.execute("SELECT runpool.cancel_run(%s, 'race')",
                                 (nxt,)).fetchone() == ("cancelled",)
        finish = threading.Thread(target=_finish, args=(dsn, head, attempt, path))
        finish.start()
        finish.join(timeout=15)
        assert not finish.is_alive()  # it did not wait for the canceller
        canceller.commit()
    finally:
        canceller.close()
    assert [run_row(conn, r)["status"] for r in (head, nxt, after)] == [
        "succeeded", "cancelled", "queued"]
    assert not run_row(conn, after)["held"]  # the key has its head again


async def _claim_all(dsn: str) -> list[tuple[uuid.UUID, int]]:
    async with await aconnect(dsn, autocommit=True) as c:
        got = await claim(c, worker_id=uuid.uuid4(), limit=10, lease_seconds=30)
    return [(r.id, r.attempt) for r in got]


def _finish(dsn: str, run_id: uuid.UUID, attempt: int, path: str) -> None:
    """End a run as the worker does: through the trigger, or the outcome writer's batch."""
    params = finish_params([(run_id, attempt)])
    with psycopg.connect(dsn, autocommit=path == "trigger") as c:
        if path == "batched":
            c.execute(QUERIES["defer_serial_release"])
        c.execute(QUERIES["finish_runs"], params)
        if path == "batched":
            c.execute(QUERIES["lock_ended_serial_keys"], params)
            c.execute(QUERIES["release_serial_keys"], params)
            c.commit()


@pytest.mark.parametrize("path", ["trigger", "batched"])
def test_a_heads_end__releases_exactly_the_next_run(
        conn: psycopg.Connection, dsn: str, path: str) -> None:
    """One release per ended head, whichever path makes it: the trigger must stand aside
    when the outcome writer releases set-based (a double release would make two heads)."""
    ids = [runpool.enqueue(conn, "t", "noop", serial_key="k") for _ in range(4)]
    ((head, attempt),) = asyncio.run(_claim_all(dsn))
    assert head == ids[0]
    _finish(dsn, head, attempt, path)
    assert [run_row(conn, r)["held"] for r in ids] == [False, False, True, True]
