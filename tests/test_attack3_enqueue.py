"""Attack on the enqueue branch (0021 and enqueue.py's pipelined savepoint): a caller's
cancellation that lands after the server finished the call, a caller whose connection makes
dict rows, an enqueue racing an operator's unpause of its tenant, and enqueue_many accepting
what enqueue refuses."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

import runpool
from runpool.testing import wait_for

from .helpers import scalar, until

WAIT_EVENT = "SELECT coalesce(wait_event_type, '') FROM pg_stat_activity WHERE pid = %s"
STATE = "SELECT state FROM pg_stat_activity WHERE pid = %s"


def test_enqueue_async_cancelled_after_the_server_finished__nothing_is_enqueued(
        dsn: str) -> None:
    # The caller's task is cancelled (asyncio.timeout, a shutdown) once the server has done the
    # call but before the task has read the answer: enqueue_async raises CancelledError, so the
    # caller takes the run as not enqueued (and retries it). On main the savepoint was rolled
    # back on the way out; with the pipelined savepoint the run stays in the caller's
    # transaction and is committed with it.
    async def main() -> int:
        with psycopg.connect(dsn, autocommit=True) as observer, \
                psycopg.connect(dsn, autocommit=True) as hostile:
            async with await psycopg.AsyncConnection.connect(dsn) as conn:
                await conn.execute("SELECT 1")  # the caller's open transaction
                pid = conn.info.backend_pid
                # The key's lock held elsewhere: the call waits in the server until it is freed.
                hostile.execute("BEGIN")
                hostile.execute(
                    "SELECT pg_advisory_xact_lock(runpool.serial_key_lock('acme', 'k'))")
                task = asyncio.create_task(
                    runpool.enqueue_async(conn, "acme", "noop", serial_key="k"))
                await until(lambda: scalar(observer, WAIT_EVENT, pid) == "Lock",
                            "the enqueue to wait for the key's lock")
                hostile.execute("COMMIT")
                # The loop is blocked in this wait: the server finishes the call (and its
                # release) before the task can read the answer.
                wait_for(lambda: scalar(observer, STATE, pid) == "idle in transaction", 30,
                         what="the call to end in the server")
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await conn.commit()
            return scalar(observer, "SELECT count(*) FROM runpool.runs")  # type: ignore[no-any-return]

    assert asyncio.run(main()) == 0


@pytest.mark.parametrize("in_transaction", [False, True], ids=["autocommit", "in-transaction"])
def test_enqueue_on_a_dict_row_connection__returns_the_run_id(
        dsn: str, in_transaction: bool) -> None:
    # psycopg's dict_row is a common row factory for an application's connections. On main
    # enqueue failed loudly (KeyError); now `((run_id,),) = rows` unpacks the dict's one key
    # and enqueue returns the column name 'enqueue' as the run's id.
    with psycopg.connect(dsn, autocommit=not in_transaction, row_factory=dict_row) as conn:
        if in_transaction:
            conn.execute("SELECT 1")
        run_id = runpool.enqueue(conn, "acme", "noop")
        if in_transaction:
            conn.commit()
    with psycopg.connect(dsn) as check:
        stored = scalar(check, "SELECT id FROM runpool.runs")
    assert run_id == stored, (run_id, stored)


def test_enqueue_async_on_a_dict_row_connection__returns_the_run_id(dsn: str) -> None:
    async def main() -> Any:
        async with await psycopg.AsyncConnection.connect(
                dsn, autocommit=True, row_factory=dict_row) as conn:
            return await runpool.enqueue_async(conn, "acme", "noop")

    run_id = asyncio.run(main())
    with psycopg.connect(dsn) as check:
        assert isinstance(run_id, uuid.UUID), run_id
        assert run_id == scalar(check, "SELECT id FROM runpool.runs")


def _single(conn: psycopg.Connection[Any]) -> object:
    return runpool.enqueue(conn, "acme", "noop")


def _many(conn: psycopg.Connection[Any]) -> object:
    return runpool.enqueue_many(conn, [runpool.RunSpec("acme", "noop")])


@pytest.mark.parametrize("enqueue", [_single, _many], ids=["enqueue", "enqueue_many"])
def test_enqueue_racing_an_unpause__the_run_is_not_left_paused(
        dsn: str, enqueue: Callable[[psycopg.Connection[Any]], object]) -> None:
    # An operator raises a paused tenant's quota (set_tenant_quota unpauses the tenant's
    # queued runs) while an application enqueues for it. On main enqueue's upsert of the
    # tenant's row waited for the operator's transaction and then read the new quota. 0021
    # reads the row (enqueue) or skips the upsert for a known tenant (enqueue_many) without
    # waiting: the run is written paused after the unpause missed it, and stays out of the
    # claim's index until a pool's heal sweep finds it.
    with psycopg.connect(dsn, autocommit=True) as observer, \
            psycopg.connect(dsn, autocommit=True) as operator, \
            psycopg.connect(dsn, autocommit=True) as app:
        observer.execute("SELECT runpool.set_tenant_quota('acme', 0)")
        operator.execute("BEGIN")
        operator.execute("SELECT runpool.set_tenant_quota('acme', NULL)")
        done: list[object] = []
        worker = threading.Thread(target=lambda: done.append(enqueue(app)))
        worker.start()
        pid = app.info.backend_pid
        # Either the enqueue waits for the operator (main) or it is already done.
        wait_for(lambda: done or scalar(observer, WAIT_EVENT, pid) == "Lock", 30,
                 what="the enqueue to wait for the operator or to end")
        operator.execute("COMMIT")
        worker.join(60)
        assert done and not worker.is_alive()
        rows = observer.execute(
            "SELECT r.paused, t.max_running FROM runpool.runs r"
            " JOIN runpool.tenants t ON t.tenant = r.tenant").fetchall()
        assert rows == [(False, None)]


@pytest.mark.parametrize(("spec", "message"), [
    # Read back in any session east of UTC as the year 10000: psycopg cannot load it, and a
    # read of a list of runs holding it fails (test_cost.py: refused by enqueue, attack 2).
    ({"deadline": datetime.max.replace(tzinfo=UTC)}, "deadline must be a finite time from 1970"),
    ({"deadline": datetime(1960, 1, 1, tzinfo=UTC)}, "deadline must be a finite time from 1970"),
    ({"deadline": datetime.now(UTC) + timedelta(days=20 * 365)},
     "deadline must be a finite time from 1970"),
    # enqueue's "at most a year" is interval '1 year' (360 days); enqueue_many's is 366 days.
    ({"timeout": timedelta(days=365)}, "timeout must be"),
], ids=["deadline-year-9999", "deadline-1960", "deadline-20-years", "timeout-365-days"])
def test_enqueue_many_refuses_what_enqueue_refuses(
        conn: psycopg.Connection, spec: dict[str, Any], message: str) -> None:
    # 0021 rewrote enqueue_many's validation as "enqueue's checks in enqueue's words"; these
    # are refused by enqueue and written by enqueue_many (as already on main, 0016).
    with pytest.raises(runpool.InvalidInput, match=message):
        runpool.enqueue(conn, "acme", "noop", **spec)
    with pytest.raises(runpool.InvalidInput, match=message):
        runpool.enqueue_many(conn, [runpool.RunSpec("acme", "noop"),
                                    runpool.RunSpec("acme", "noop", **spec)])
    assert scalar(conn, "SELECT count(*) FROM runpool.runs") == 0


def test_enqueue_async_from_concurrent_tasks_on_one_connection_in_a_transaction(
        dsn: str) -> None:
    # An AsyncConnection is shared by an application's tasks (psycopg serialises their
    # statements): several enqueue_async calls gathered on it, in the caller's transaction.
    # On main each call's savepoint was a psycopg transaction() and all four committed; the
    # pipelined savepoints of concurrent calls interleave in one pipeline: AttributeError,
    # "another command is already in progress", and a connection that can no longer commit.
    async def main() -> list[uuid.UUID]:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            await conn.execute("SELECT 1")  # the caller's open transaction
            ids = await asyncio.wait_for(asyncio.gather(*(
                runpool.enqueue_async(conn, "acme", "noop", {"i": i}) for i in range(4))), 60)
            await conn.commit()
            return list(ids)

    ids = asyncio.run(main())
    with psycopg.connect(dsn) as check:
        stored = {r for (r,) in check.execute("SELECT id FROM runpool.runs")}
    assert len(set(ids)) == 4 and set(ids) == stored
