"""A slot's state has one owner: its transitions decide each stop once, and the worker's table
gives a slot up in one place, only that very slot. Real tasks on a real loop; no database is
needed (the pool paths are covered by test_worker, test_cancellation and test_plaindef)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import pytest

import runpool
from runpool.claiming import ClaimedRun
from runpool.control import RunControl
from runpool.slot import Slot, Slots, StopReason


def claimed(run_id: uuid.UUID | None = None, attempt: int = 1) -> ClaimedRun:
    return ClaimedRun(id=run_id or uuid.uuid4(), tenant="acme", handler="h", attempt=attempt,
                      attempts_used=attempt, max_attempts=3, input=b"{}", traceparent=None,
                      created_at=datetime.now(UTC))


def started(c: ClaimedRun | None = None) -> Slot:
    """A slot whose task waits forever (until cancelled)."""
    c = c or claimed()
    slot = Slot(c, RunControl(asyncio.get_running_loop(), "test"), deadline=100.0,
                extra={"run_id": str(c.id)})
    slot.start(asyncio.sleep(3600))
    return slot


def state(slot: Slot) -> tuple[StopReason | None, bool, bool, str | None]:
    """What the slot decided, and what its Run sees: stop reason, cancelled, lost, closed."""
    c = slot.control
    return slot.stop_reason, c.cancelled, c.lost, c.closed


async def settle(slot: Slot) -> None:
    await asyncio.wait([slot.task], timeout=5)


def test_cancel__decided_once_then_only_a_lost_lease_overrides_it() -> None:
    async def main() -> None:
        slot = started()
        assert state(slot) == (None, False, False, None)
        assert slot.request_cancel()
        await settle(slot)
        assert slot.task.cancelled()
        assert state(slot) == (StopReason.CANCELLED, True, False, None)
        assert not slot.request_cancel()
        assert not slot.shut_down()  # a drain releases nothing that is being cancelled
        assert state(slot) == (StopReason.CANCELLED, True, False, None)
        assert slot.abandon()
        assert state(slot) == (StopReason.LEASE_LOST, True, True, None)
        assert not slot.abandon()  # logged and timed once

    asyncio.run(main())


def test_finishing__no_cancel_or_drain_applies_to_an_outcome_being_written() -> None:
    async def main() -> None:
        slot = started()
        assert slot.finish(forced=True) and slot.forced
        assert not slot.finish()  # one writer: the handler's late outcome is dropped
        assert not slot.request_cancel() and not slot.shut_down()
        assert state(slot) == (None, False, False, None) and not slot.task.cancelled()
        slot.task.cancel()
        await settle(slot)

    asyncio.run(main())


def test_shut_down__closes_the_plain_methods_and_cancels_the_task() -> None:
    async def main() -> None:
        slot = started()
        assert slot.shut_down()
        await settle(slot)
        assert slot.task.cancelled()
        assert state(slot) == (StopReason.SHUTDOWN, False, False, "the worker is shutting down")
        assert not slot.request_cancel()
        run = runpool.Run(id=slot.claimed.id, tenant="acme", handler="h", attempt=1,
                          input=None, control=slot.control)
        with pytest.raises(asyncio.CancelledError, match="the worker is shutting down"):
            await asyncio.to_thread(run.add_message_sync, "assistant", "late")

    asyncio.run(main())


def test_lease_loss__fences_the_runs_writes_and_may_leave_its_task_running() -> None:
    async def main() -> None:
        slot = started()
        run = runpool.Run(id=slot.claimed.id, tenant="acme", handler="h", attempt=1,
                          input=None, control=slot.control)
        assert slot.abandon(cancel_task=False)  # the task is ending by itself (LeaseLost)
        await asyncio.sleep(0)
        assert not slot.task.done()
        with pytest.raises(runpool.LeaseLost):
            await run.add_message("assistant", "after the loss")
        assert not slot.request_cancel()
        slot.task.cancel()
        await settle(slot)

    asyncio.run(main())


def test_give_up__the_plain_methods_refuse_with_the_reason() -> None:
    async def main() -> None:
        slot = started()
        slot.give_up()
        assert slot.given_up
        run = runpool.Run(id=slot.claimed.id, tenant="acme", handler="h", attempt=1,
                          input=None, control=slot.control)
        with pytest.raises(asyncio.CancelledError, match="its worker is exiting"):
            await asyncio.to_thread(run.tool_sync, "c1", "t", {}, lambda a, k: None)
        slot.task.cancel()
        await settle(slot)

    asyncio.run(main())


def test_started_twice__refused() -> None:
    async def main() -> None:
        slot = started()
        coro = asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="started already"):
            slot.start(coro)
        slot.task.cancel()
        await settle(slot)

    asyncio.run(main())


def test_slots__an_earlier_attempt_of_a_run_claimed_again_keeps_its_place_until_it_ends(
) -> None:
    async def main() -> None:
        table = Slots()
        run_id = uuid.uuid4()
        old = started(claimed(run_id, attempt=1))
        table.add(old)
        # The old attempt lost its lease and is still ending; this worker claims the run again.
        new = started(claimed(run_id, attempt=2))
        table.add(new)
        # Both take a place until each ends (the old one's task, or thread, still runs: it
        # counts against the concurrency, and the heartbeat and stuck checks still see it);
        # the run's notices go to the new one.
        assert table.holds(old) and table.holds(new) and len(table) == 2
        assert set(table) == {old, new} and table.get(run_id) is new and run_id in table
        assert table.vacate(old) and not table.vacate(old)
        assert table.get(run_id) is new and len(table) == 1 and not table.holds(old)
        assert table.vacate(new) and not table.vacate(new)
        assert len(table) == 0 and table.get(run_id) is None and run_id not in table
        for slot in (old, new):
            slot.task.cancel()
            await settle(slot)

    asyncio.run(main())
