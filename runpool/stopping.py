"""Stopping a run in a worker slot: cancelled, past its timeout or deadline, its lease lost,
or stuck on a thread that cannot be stopped. A stop first cancels the handler; past the cancel
grace a handler still going is recorded ended anyway (a forced end) and its slot freed, or,
on a thread, the worker exits so the thread ends with it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from . import metrics, outcomes
from .outcomes import Outcome, OutcomeWriter
from .settings import Settings
from .slot import Slot, Slots, StopReason

__all__ = ["ENDING", "Stops", "recorded"]

# The stops that end the run here (recorded by this worker), unlike a lost lease or a drain.
ENDING = frozenset({StopReason.CANCELLED, StopReason.TIMEOUT, StopReason.DEADLINE})
# An attempt's outcome as metrics name it: the status its outcome left the run in ('queued':
# a retry is due).
_RECORDED = {"succeeded": "succeeded", "failed": "failed", "cancelled": "cancelled",
             "queued": "retry"}

# The worker's logger: a slot's story is the worker's (operators filter on one name).
logger = logging.getLogger("runpool.worker")


def recorded(status: str | None) -> str:
    """An attempt's end as metrics.attempt_ended names it (None: not recorded)."""
    return _RECORDED.get(status or "", "not_recorded")


class Stops:
    """The stops of a worker's slots (SlotRunner's): `vacate(slot)` frees a slot, `current(slot)`
    says whether it still holds its run's newest attempt here, and `on_stuck(hurry)` makes the
    worker exit (a run's thread cannot be stopped; `hurry`: at once, its lease is lost)."""

    def __init__(self, *, settings: Settings, outcomes: OutcomeWriter, slots: Slots,
                 vacate: Callable[[Slot], None], current: Callable[[Slot], bool],
                 on_stuck: Callable[[bool], None]) -> None:
        self._settings = settings
        self._outcomes = outcomes
        self._slots = slots
        self._vacate = vacate
        self._current = current
        self._on_stuck = on_stuck
        # The forced ends being written (see _force), by slot: a drain waits for them as it
        # waits for the runs' own tasks (a forced slot's task may never end).
        self._forcing: dict[Slot, asyncio.Task[None]] = {}

    def cancel(self, slot: Slot) -> None:
        """A cancel of the run is confirmed: its task is cancelled; a handler still going
        after the cancel grace is recorded cancelled anyway (see `_force`)."""
        if not slot.request_cancel():
            return
        metrics.cancelled(slot.claimed.handler)
        logger.info("cancelling run %s", slot.claimed.id,
                    extra={"action": "run_cancelling", **slot.extra})
        asyncio.get_running_loop().call_later(
            self._settings.cancel_grace_seconds, self._force_later, slot)

    def overdue(self, slot: Slot, reason: str) -> None:
        """The database's clock says the attempt passed its timeout ('timeout') or the run its
        deadline ('deadline_exceeded'): stopped as a cancel is (the handler gets its
        cancellation and the cancel grace), then recorded as that failure."""
        if not slot.expire(StopReason(reason)):
            return
        logger.info("stopping run %s: %s", slot.claimed.id, reason,
                    extra={"action": "run_overdue", "reason": reason, **slot.extra})
        asyncio.get_running_loop().call_later(
            self._settings.cancel_grace_seconds, self._force_later, slot)

    def outcome(self, slot: Slot) -> Outcome:
        """What a run stopped by the worker (not lost, not released) amounts to."""
        c = slot.claimed
        if slot.stop_reason is StopReason.TIMEOUT:
            return outcomes.retry_after(
                c.id, c.attempt, c.attempts_used, self._settings.retry_backoff_seconds,
                outcomes.error_doc("timeout", "the attempt ran past its timeout"))
        if slot.stop_reason is StopReason.DEADLINE:
            return outcomes.failed(c.id, c.attempt, "deadline_exceeded",
                                   "the run ran past its deadline")
        return _cancelled_outcome(slot)

    def _force_later(self, slot: Slot) -> None:
        task = asyncio.get_running_loop().create_task(self._force(slot))
        self._forcing[slot] = task
        task.add_done_callback(lambda _: self._forcing.pop(slot, None))

    def ending(self, slot: Slot) -> asyncio.Task[None]:
        """What ends the slot's run here: the worker's write of its forced end, if one is
        under way, else the run's own task."""
        forcing = self._forcing.get(slot)
        # (Its entry goes a loop turn after it ends: an ended write is no longer the end.)
        return forcing if forcing is not None and not forcing.done() else slot.task

    async def _force(self, slot: Slot) -> None:
        """The handler ignored cancellation past its grace: record it cancelled and free the
        slot; whatever the handler does later is fenced. A thread cannot be stopped, though:
        while one of the run's threads runs, the worker exits instead (see `give_up`)."""
        if not self._current(slot) or slot.finishing:
            return
        if slot.threads_running:
            self.stuck_check(slot, "ignored its cancellation past the cancel grace")
            return
        slot.finish(forced=True)
        try:
            status = await self._outcomes.submit(self.outcome(slot),
                                                 serial=slot.claimed.serial_key is not None)
            metrics.attempt_ended(slot.claimed.handler,
                                  recorded(status),
                                  asyncio.get_running_loop().time() - slot.started)
        finally:
            # Not before: until the end is written the run holds its slot, and the handler's
            # task ending meanwhile must not free it (see _execute_traced).
            self._vacate(slot)

    def abandon(self, slot: Slot, why: str, *, cancel: bool = True) -> None:
        """Stop a run whose lease is (or may be) lost: every later write of it is fenced."""
        if not slot.abandon(cancel_task=cancel):
            return
        metrics.lease_lost(slot.claimed.handler)
        logger.warning("lease lost for run %s: %s", slot.claimed.id, why,
                       extra={"action": "lease_lost", **slot.extra})
        asyncio.get_running_loop().call_later(
            self._settings.cancel_grace_seconds, self.stuck_check, slot,
            "outlived the loss of its lease by the cancel grace", True)

    def stuck_check(self, slot: Slot, why: str, lost: bool = False) -> None:
        """Past a grace period: a run whose thread still runs makes this worker exit (`lost`:
        the run's lease is gone, so it exits at once, releasing its other runs)."""
        if not self._slots.holds(slot):
            return
        if slot.threads_running:
            self.give_up([slot], why, hurry=lost)
        elif lost and not slot.finishing:
            # An async handler that swallowed its cancellation: the run is someone else's now
            # and every write of this attempt is fenced, so the slot is freed (as a forced
            # cancel frees it) instead of being held forever; the task ends when it ends.
            logger.error("run %s: the handler %s; its slot is freed", slot.claimed.id, why,
                         extra={"action": "slot_forced_free", **slot.extra})
            self._vacate(slot)

    def give_up(self, slots: list[Slot], why: str, *, hurry: bool = False) -> None:
        """A thread cannot be stopped, and its run may not run anywhere else meanwhile: this
        worker stops claiming, drains its other runs, keeps renewing the stuck runs' leases,
        and exits (EXIT_STUCK) so their threads end with the process. Their leases then expire
        and the reaper reclaims them (or records them cancelled, if a cancel was requested)."""
        for slot in slots:
            slot.give_up()
            logger.error(
                "run %s: a handler thread %s and cannot be stopped; this worker exits when"
                " its other runs are done, and the run is reclaimed when its lease expires",
                slot.claimed.id, why, extra={"action": "thread_stuck", **slot.extra})
        self._on_stuck(hurry)


def _cancelled_outcome(slot: Slot) -> Outcome:
    return Outcome(slot.claimed.id, slot.claimed.attempt, "cancelled",
                   error=outcomes.error_doc("cancelled", "cancelled on request"))
