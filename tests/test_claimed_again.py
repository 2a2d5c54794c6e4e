"""A run this worker claims again while an earlier attempt of it still ends here (its lease
expired in the database, the reaper queued it, and this worker's claim took it): the earlier
attempt keeps its slot until it ends, is given up as lost at once (the heartbeat answers by run
id, so it would otherwise be renewed from the new attempt's row), and what it returns at last is
not written (its slot was already counted free).
The worker's own SlotRunner on a real pool; the attempts are built here, not claimed."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

import runpool
from runpool import outcomes
from runpool.db import aconnect, connect
from runpool.enqueue import enqueue
from runpool.outcomes import OutcomeWriter
from runpool.pools import open_pool
from runpool.runner import SlotRunner
from runpool.settings import Settings
from runpool.slot import Slots, StopReason
from tests.helpers import until
from tests.test_slot import claimed


def test_claimed_again__the_earlier_attempt_keeps_its_slot_is_lost_and_writes_nothing(
        dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    app = runpool.App()
    returned, entered = asyncio.Event(), asyncio.Event()

    @app.handler("h")
    async def stubborn(run: runpool.Run) -> Any:
        # Ignores its cancellation; the first attempt returns when the test says so.
        entered.set()
        while run.attempt == 1 and not returned.is_set():
            try:
                await returned.wait()
            except asyncio.CancelledError:
                continue
        if run.attempt == 1:
            return "late"
        await asyncio.sleep(3600)

    async def main() -> None:
        async with _slot_runner(dsn, app) as (slots, runner, writer):
            run_id = uuid.uuid4()
            loop = asyncio.get_running_loop()
            runner.start(claimed(run_id, attempt=1), loop.time())
            (old,) = slots
            await asyncio.wait_for(entered.wait(), 10)
            runner.start(claimed(run_id, attempt=2), loop.time())
            new = slots.get(run_id)
            assert new is not old and new is not None
            assert old.stop_reason is StopReason.LEASE_LOST and new.stop_reason is None
            assert len(slots) == 2 and slots.holds(old)
            submitted: list[Any] = []
            real_submit = writer.submit

            async def spy(outcome: Any, **kwargs: Any) -> str | None:
                submitted.append(outcome)
                return await real_submit(outcome, **kwargs)

            writer.submit = spy  # type: ignore[method-assign]
            returned.set()
            await asyncio.wait_for(old.task, 10)
            assert submitted == []  # dropped, not written beside the new attempt's
            assert len(slots) == 1 and not slots.holds(old) and slots.get(run_id) is new
            new.task.cancel()
            await asyncio.gather(new.task, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="runpool.worker"):
        asyncio.run(main())
    actions = [getattr(r, "action", "") for r in caplog.records]
    assert "lease_lost" in actions and "late_outcome_dropped" in actions


def test_two_attempts_outcomes_in_one_batch__each_is_told_its_own(dsn: str) -> None:
    """An earlier attempt's outcome, submitted before its lease was lost, and the outcome of
    the attempt that holds the run now, written in one batch: the earlier one is fenced (told
    None), the current one told its status. (finish_runs answered by run id: both were told
    the current attempt's status, and the earlier one's metrics and log said it succeeded.)"""
    with connect(dsn, autocommit=True) as conn:
        run_id = enqueue(conn, "acme", "noop")
        conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 2,"
                     " started_at = now(), lease_expires_at = now() + interval '1 hour'"
                     " WHERE id = %s", (run_id,))

    async def main() -> list[str | None]:
        pool = await open_pool(dsn, size=2, name="test-two-attempts")
        writer = OutcomeWriter(pool, worker_id=uuid.uuid4())
        try:
            # Both queued before the writer runs: they go in its first batch.
            told = [asyncio.create_task(writer.submit(outcomes.from_result(
                run_id, attempt, f"attempt {attempt}", max_bytes=1 << 20)))
                for attempt in (1, 2)]
            await asyncio.sleep(0)
            writing = asyncio.create_task(writer.run())
            try:
                return await asyncio.wait_for(asyncio.gather(*told), 20)
            finally:
                writing.cancel()
                await asyncio.gather(writing, return_exceptions=True)
        finally:
            await pool.close()

    assert asyncio.run(main()) == [None, "succeeded"]
    with connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT status, result FROM runpool.runs WHERE id = %s",
                            (run_id,)).fetchone() == ("succeeded", "attempt 2")


def test_claimed_again_while_the_earlier_outcome_is_written__its_slot_waits_for_the_write(
        dsn: str) -> None:
    """The earlier attempt returned and its outcome's write is in flight (held by a lock on
    the run's event counter row, which the write's counter bump waits for) when the run is
    claimed here again: the earlier attempt is lost, but its task is not cancelled; its slot
    is freed once, when the write (fenced) ends. Cancelled, it freed the slot at once, while
    the writer's batch had counted it freed for its refill already."""
    app = runpool.App()

    @app.handler("h")
    async def quick(run: runpool.Run) -> Any:
        if run.attempt == 1:
            return "done"
        await asyncio.sleep(3600)

    with connect(dsn, autocommit=True) as conn:
        run_id = enqueue(conn, "acme", "noop")
        conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1,"
                     " started_at = now(), lease_expires_at = now() + interval '1 hour'"
                     " WHERE id = %s", (run_id,))
        conn.execute("INSERT INTO runpool.event_seqs (run_id, seq)"
                     " SELECT id, event_seq FROM runpool.runs WHERE id = %s", (run_id,))

    async def main() -> None:
        async with _slot_runner(dsn, app) as (slots, runner, _), \
                await aconnect(dsn) as locker:
            await locker.execute("SELECT 1 FROM runpool.event_seqs WHERE run_id = %s"
                                 " FOR UPDATE", (run_id,))
            loop = asyncio.get_running_loop()
            runner.start(claimed(run_id, attempt=1), loop.time())
            (old,) = slots
            await until(lambda: old.finishing and _waiting_for_a_lock(dsn),
                        "the outcome's write held in flight")
            runner.start(claimed(run_id, attempt=2), loop.time())
            new = slots.get(run_id)
            assert new is not old and old.stop_reason is StopReason.LEASE_LOST
            assert not old.task.cancelling()  # (abandon cancels synchronously, if at all)
            assert not old.task.done() and slots.holds(old) and len(slots) == 2
            await locker.rollback()
            await asyncio.wait_for(old.task, 10)
            assert not old.task.cancelled()
            assert len(slots) == 1 and not slots.holds(old) and slots.get(run_id) is new
            assert new is not None
            new.task.cancel()
            await asyncio.gather(new.task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(main(), 60))


@asynccontextmanager
async def _slot_runner(dsn: str, app: runpool.App
                       ) -> AsyncIterator[tuple[Slots, SlotRunner, OutcomeWriter]]:
    """The worker's own SlotRunner on a real pool, its outcome writer running."""
    pool = await open_pool(dsn, size=2, name="test-claimed-again")
    writer = OutcomeWriter(pool, worker_id=uuid.uuid4())
    slots = Slots()
    runner = SlotRunner(settings=Settings(dsn=dsn, cancel_grace_seconds=60), app=app, pool=pool,
                        outcomes=writer, slots=slots, log={}, wake=lambda: None,
                        on_stuck=lambda hurry: None)
    writing = asyncio.create_task(writer.run())
    try:
        yield slots, runner, writer
    finally:
        writing.cancel()
        await asyncio.gather(writing, return_exceptions=True)
        await pool.close()


def _waiting_for_a_lock(dsn: str) -> bool:
    with connect(dsn, autocommit=True) as conn:
        return bool(conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock'").fetchone() == (1,))
