"""The lifecycle of a run in a worker slot: start it, run its handler (resuming what earlier
attempts committed), record its outcome, and stop it — cancelled, lease lost, or stuck on a
thread that cannot be stopped — freeing its slot."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from psycopg_pool import AsyncConnectionPool

import checkpoints

from . import costs, metrics, outcomes, telemetry
from .app import App
from .claiming import ClaimedRun
from .commits import CommitGroup
from .context import Run
from .control import RunControl
from .deadlines import again, bounded
from .doorbells import Doorbells
from .errors import (
    CODE_ERRORS,
    Fail,
    InvalidInput,
    LeaseLost,
    ToolOutcomeUnknown,
    WaitTimeout,
    describe,
    type_name,
)
from .logs import run_log_context
from .outcomes import Outcome, OutcomeWriter
from .pooled import Route
from .progress import Publisher
from .settings import Settings
from .slot import Slot, Slots
from .stopping import ENDING, Stops, recorded
from .waits import Suspended

__all__ = ["SlotRunner"]

# The worker's logger: a slot's story is the worker's (operators filter on one name).
logger = logging.getLogger("runpool.worker")


class SlotRunner:
    """Runs the worker's slots, on its event loop. What it needs of the worker is narrow:
    `wake()` (a slot freed, or a retry is due: look for work), and `on_stuck(hurry)` (a run's
    thread cannot be stopped: the worker must exit; `hurry`: at once, the run's lease is
    lost)."""

    def __init__(self, *, settings: Settings, app: App, pool: AsyncConnectionPool,
                 outcomes: OutcomeWriter, slots: Slots, log: dict[str, str],
                 wake: Callable[[], None], on_stuck: Callable[[bool], None],
                 progress: Publisher | None = None, route: Route | None = None) -> None:
        self._settings = settings
        self._app = app
        self._pool = pool
        self._outcomes = outcomes
        self._slots = slots
        self._log = log
        self._wake = wake
        self._progress = progress
        # Cancels, overdue runs, lost leases and stuck threads.
        self.stops = Stops(settings=settings, outcomes=outcomes, slots=slots,
                           vacate=self._vacate, current=self._current, on_stuck=on_stuck)
        # The linger checks of suspended attempts whose slot is not vacated yet (see
        # _after_suspend): cancelled at the vacate, so 10,000 runs starting to wait keep no
        # slot alive for the grace.
        self._lingering: dict[Slot, asyncio.TimerHandle] = {}
        # Checkpoint writes of all this worker's runs share commits under load.
        # Rings the runs of the checkpoint batches once committed (see runpool.doorbells).
        self.doorbells = Doorbells(pool, log=log)
        self._commits = CommitGroup(pool, via=route or (
            "pipeline" if settings.stateless else "prepared"), doorbells=self.doorbells)
        # The worker's loop, taken at the first start (each asyncio.get_running_loop() asks
        # the OS for the process id on Python 3.11: ~0.6 us, six times per run).
        self._loop: asyncio.AbstractEventLoop | None = None
        # Whether each handler is a coroutine function (inspect's answer, asked once).
        self._is_async: dict[str, bool] = {}

    def start(self, c: ClaimedRun, sent: float) -> None:
        """Run a claimed attempt in a slot of its own (`sent`: when its claim was sent)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        run_id = str(c.id)
        control = RunControl(loop, f"runpool-run-{run_id}")
        slot = Slot(c, control, deadline=sent + self._settings.lease_seconds,
                    extra={"run_id": run_id, "tenant": c.tenant, **self._log})
        if c.due_in is not None:
            slot.due = sent + max(c.due_in, 0.0)
        control.on_suspend = functools.partial(self._after_suspend, slot)
        earlier = self._slots.get(c.id)
        if earlier is not None:
            # This worker claimed the run again while an earlier attempt of it still ends here:
            # that attempt's lease is gone for sure, whatever its own checks saw so far (the
            # heartbeat answers by run id: it would renew the earlier one from this one's row).
            self.stops.abandon(earlier, "this worker claimed the run again")
        self._slots.add(slot)
        slot.start(self._execute(slot))

    def _vacate(self, slot: Slot) -> None:
        if self._slots.vacate(slot) and slot.cancel_seen is not None:
            # The run's end as its cancel's requester sees it: the slot is free (the outcome
            # written, or the run forced cancelled after the grace).
            metrics.cancel_ended(slot.claimed.handler, time.monotonic() - slot.cancel_seen)
        slot.control.on_suspend = None  # (it refers to the slot: no cycle left behind)
        timer = self._lingering.pop(slot, None)
        if timer is not None:
            timer.cancel()
        if self._progress is not None and slot.claimed.id not in self._slots:
            # (A later attempt of the run, claimed here again, keeps its progress.)
            self._progress.ended(slot.claimed.id)
        self._wake()

    # -- executing ---------------------------------------------------------------------------

    async def _execute(self, slot: Slot) -> None:
        c = slot.claimed
        metrics.attempt_started(c.handler, waited=c.waited, reclaimed=c.reclaimed)
        # Every record made in this run's task and threads (the handler's own loggers' too)
        # says which run it belongs to (see runpool.logs).
        with run_log_context(**slot.extra, attempt=c.attempt, handler=c.handler,
                             trace_id=telemetry.trace_id_of(c.id, c.traceparent)):
            if not telemetry.enabled():
                await self._execute_traced(slot, None)
                return
            with telemetry.process_span(c.id, c.tenant, c.handler, c.attempt,
                                        c.traceparent) as span:
                await self._execute_traced(slot, span)

    async def _execute_traced(self, slot: Slot, span: Any) -> None:
        loop = slot.task.get_loop()
        try:
            try:
                outcome = await self._call(slot, traced=span is not None)
            except Exception as exc:
                # A bug of ours must end the run visibly, not leave it to a lease expiry.
                logger.exception("internal error running %s", slot.claimed.id,
                                 extra={"action": "run_internal_error", **slot.extra})
                outcome = outcomes.failed(slot.claimed.id, slot.claimed.attempt,
                                          "internal_error", f"{type_name(exc)}: {describe(exc)}")
            # Whatever ended the handler's coroutine (return, cancel, lease loss, drain), a
            # thread of the run may still run: until it returns, the run keeps its slot, its
            # lease and its status (never released, never recorded ended).
            await self._threads_finished(slot)
            if outcome is not None and not (self._current(slot) and slot.finish()):
                # The attempt's end is written without it: forced after the cancel grace
                # (see `Stops._force`), or fenced (its lease lost, the handler outlived the
                # grace, and the slot was freed or the run claimed here again). Writing this
                # one too would count the slot freed a second time for the outcome writer's
                # refill (one slot, two runs).
                logger.info("run %s attempt %d: the handler returned after its end was"
                            " written; its %s is not recorded", slot.claimed.id,
                            slot.claimed.attempt, outcome.kind,
                            extra={"action": "late_outcome_dropped", **slot.extra})
                outcome = None
            if span is not None:
                stop = ("waiting" if slot.control.suspended else slot.stop_reason.value
                        if slot.stop_reason else "abandoned")
                telemetry.finish(span, *((stop, None) if outcome is None
                                         else (outcome.kind, outcome.reason)))
            if outcome is not None:
                status = await self._outcomes.submit(
                    outcome, serial=slot.claimed.serial_key is not None)
                metrics.attempt_ended(
                    slot.claimed.handler, recorded(status),
                    loop.time() - slot.started)
                if status == "queued":
                    # Our own retry is due after its backoff: look again then, not at the poll.
                    loop.call_later(outcome.retry_delay, self._wake)
                # Per-run success is DEBUG (run_events has every run's story); anything
                # else is worth an operator's eye. (Its fields are gathered only when the
                # record is made.)
                level = logging.DEBUG if status == "succeeded" else logging.INFO
                if logger.isEnabledFor(level):
                    logger.log(
                        level, "run %s attempt %d: %s", slot.claimed.id, slot.claimed.attempt,
                        status or "not recorded (the lease was lost, or the database stayed"
                                  " unreachable; the run is reclaimed when its lease expires)",
                        extra={"action": "run_finished" if status else "outcome_not_recorded",
                               **slot.extra},
                    )
        finally:
            if not slot.forced:  # (a forced end frees the slot once it is written)
                self._vacate(slot)

    def _current(self, slot: Slot) -> bool:
        """The slot holds its run's newest attempt here (not freed, not claimed again)."""
        return self._slots.get(slot.claimed.id) is slot

    async def _threads_finished(self, slot: Slot) -> None:
        threads = slot.control.threads
        while threads.running:
            try:
                await threads.finished()
            except asyncio.CancelledError:
                # Only a worker that exits may stop waiting: the threads die with it.
                if slot.given_up:
                    raise

    async def _call(self, slot: Slot, *, traced: bool) -> Outcome | None:
        c, s = slot.claimed, self._settings
        handler = self._app.get(c.handler)
        if handler is None:
            return outcomes.failed(
                c.id, c.attempt, "unknown_handler",
                f"no handler named {c.handler!r} is registered on this worker"
                f" (known: {', '.join(self._app.names) or 'none'})")
        try:
            run_input = c.decode_input()
        except InvalidInput as exc:
            return outcomes.failed(c.id, c.attempt, "invalid_input", str(exc))
        try:
            messages, calls = await self._resume(slot) if c.attempt > 1 else ([], {})
            run = Run(id=c.id, tenant=c.tenant, handler=c.handler, attempt=c.attempt,
                      input=run_input, pool=self._pool, max_message_bytes=s.max_message_bytes,
                      write_timeout=s.lease_seconds / 2, messages=messages, tool_calls=calls,
                      control=slot.control,
                      progress=self._progress.offer if self._progress is not None else None,
                      budget=costs.decode(c.budget), usage=costs.decode(c.usage),
                      traceparent=c.traceparent, short_sleep=s.lease_seconds / 3,
                      commits=self._commits)
            is_async = self._is_async.get(c.handler)
            if is_async is None:
                is_async = self._is_async[c.handler] = handler.is_async
            if not traced:  # (the span machinery costs a generator per run even when off)
                result = await (handler.fn(run) if is_async
                                else slot.control.threads.call(handler.fn, run))
            else:
                with telemetry.agent_span(c.id, c.handler):
                    result = await (handler.fn(run) if is_async
                                    else slot.control.threads.call(handler.fn, run))
        except Suspended as exc:
            if slot.control.suspended:
                return self._suspended(slot)
            # Raised by the handler's own code, no wait committed: an exception like any other.
            return self._raised(slot, exc, handler.no_retry)
        except asyncio.CancelledError as exc:
            if slot.control.suspended:
                return self._suspended(slot)
            if slot.stop_reason in ENDING:
                return self.stops.outcome(slot)
            # lease_lost: another attempt may own the run now; shutdown: released by the drain.
            if slot.stop_reason is None:
                task = asyncio.current_task()
                if task is not None and not task.cancelling():
                    # Nobody cancelled this task: the handler's code raised it itself.
                    return self._raised(slot, exc, handler.no_retry)
                raise
            return None
        except LeaseLost:
            if slot.control.suspended:
                return self._suspended(slot)
            # The run is someone else's now; nothing of this attempt may be written.
            self.stops.abandon(slot, "a checkpoint write found the lease taken", cancel=False)
            return None
        except CODE_ERRORS as exc:
            if slot.control.suspended:
                return self._suspended(slot)
            if slot.stop_reason in ENDING:
                # E.g. a plain handler's tool_sync refusing to start a call after the cancel.
                return self.stops.outcome(slot)
            return self._raised(slot, exc, handler.no_retry)
        if slot.control.suspended:
            return self._suspended(slot)
        if slot.control.cancelled:
            return self.stops.outcome(slot)
        return outcomes.from_result(c.id, c.attempt, result, max_bytes=s.max_result_bytes)

    def _raised(self, slot: Slot, exc: BaseException,
                no_retry: tuple[type[BaseException], ...]) -> Outcome:
        """The outcome of the handler's exception (its kind decides: see from_exception)."""
        c, s = slot.claimed, self._settings
        try:
            if not isinstance(exc, Fail | InvalidInput | ToolOutcomeUnknown | WaitTimeout):
                logger.warning("run %s raised %s", c.id, type_name(exc),
                               extra={"action": "run_raised", **slot.extra})
            return outcomes.from_exception(
                c.id, c.attempt, exc, attempts_used=c.attempts_used,
                backoff=s.retry_backoff_seconds, no_retry=no_retry)
        except BaseException:  # an exception that defeats even isinstance
            # (a __class__ that raises): retried as any other exception, said as it can be.
            return outcomes.retry_after(
                c.id, c.attempt, c.attempts_used, s.retry_backoff_seconds,
                outcomes.error_doc("exception", "<an exception that cannot be read>",
                                   type=type_name(exc)))

    def _after_suspend(self, slot: Slot) -> None:
        self._lingering[slot] = asyncio.get_running_loop().call_later(
            self._settings.cancel_grace_seconds, self._linger_check, slot)

    def _linger_check(self, slot: Slot) -> None:
        """The cancel grace after the attempt committed a wait: a handler still going (it
        caught Suspended, say in a bare `except:` retry loop) is cancelled and its slot freed,
        as for a handler outliving a lost lease: the run is 'waiting' (or queued again, or
        another worker's), every write of this attempt is fenced, and the heartbeat passes a
        suspended slot by, so nothing else would ever free it."""
        self._lingering.pop(slot, None)
        if not self._slots.holds(slot) or slot.threads_running:
            return  # ended as it should; a thread cannot be stopped (a plain handler's)
        logger.error("run %s: the handler went on after its wait was committed (it caught"
                     " runpool.waits.Suspended); cancelled, its slot is freed",
                     slot.claimed.id, extra={"action": "slot_forced_free", **slot.extra})
        slot.abandon(cancel_task=True)
        self._vacate(slot)

    def _suspended(self, slot: Slot) -> Outcome | None:
        """The handler committed a durable wait: the run is 'waiting' in the database (or,
        its cancel requested, 'cancelled'), and whatever the handler did after it (caught
        Suspended, returned) is not recorded."""
        logger.debug("run %s attempt %d waits", slot.claimed.id, slot.claimed.attempt,
                     extra={"action": "run_waiting", **slot.extra})
        return None

    async def _resume(self, slot: Slot) -> tuple[list[checkpoints.Message],
                                                 dict[str, checkpoints.ToolCall]]:
        """What earlier attempts committed: resuming reads rows, it replays nothing."""
        pool, page_seconds = self._pool, self._settings.lease_seconds / 2
        try:
            # Paged, each page under its own deadline: a long run's history (20,000 messages
            # and calls) is many short reads, not one read that must beat one deadline. A
            # read: repeated when a connection broke under it.
            return await again(
                lambda _: checkpoints.load_paged(lambda: bounded(pool, page_seconds),
                                                 slot.claimed.id),
                page_seconds, what="resume read", log=slot.extra)
        except ValueError as exc:
            # jsonb holds values the decoder refuses (nesting past 1,024 levels): every
            # attempt would meet them, so the run fails now instead of retrying.
            raise InvalidInput(f"the run's history cannot be decoded: {exc}") from None
