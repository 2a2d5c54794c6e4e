"""One worker process: an asyncio loop with `concurrency` run slots, fed by claims.

It wakes on a doorbell NOTIFY, when a slot frees, and on a jittered poll timer (the fallback
for lost notifications); it holds every run under a lease it renews in one statement per beat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
import uuid
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

import checkpoints

from . import outcomes, telemetry
from .app import App
from .cancellation import Canceller
from .claiming import ClaimedRun, claim, claim_statements
from .context import Run
from .db import again, bounded, open_pool
from .errors import Fail, InvalidInput, LeaseLost, ToolOutcomeUnknown, WorkerFailed
from .listener import ClaimBudget, Listener
from .outcomes import Outcome, OutcomeWriter
from .queries import QUERIES
from .settings import Settings
from .slot import Slot
from .supervisor import EXIT_STUCK

__all__ = ["Worker"]

logger = logging.getLogger("runpool.worker")

# Seconds between reaps of expired leases by one busy worker (every claim when idle-polling).
REAP_INTERVAL = 1.0


async def _cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel tasks and wait until every one has ended. A cancellation can be swallowed:
    Python 3.11's wait_for (psycopg_pool's open and waits use it) returns a result that
    completed at the same moment instead of raising, so a task cancelled once may go on
    (a worker orphaned at its start hung on its heartbeat's pool opening). Cancel again."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=1.0)


class Worker:
    def __init__(self, settings: Settings, app: App, dsn: str, *,
                 tracer_provider: Any = None) -> None:
        self.id = uuid.uuid4()
        # None: the global provider, if its host installed one (see telemetry).
        self.tracer_provider = tracer_provider
        # Set once the worker is registered and claiming (what an embedded Pool waits for).
        self.ready = asyncio.Event()
        self.settings = settings
        self.app = app
        self.dsn = dsn
        self.slots: dict[uuid.UUID, Slot] = {}
        # Set by the listener, a freed slot and stop requests; the loop re-checks everything.
        self._attention = asyncio.Event()
        self._pool: AsyncConnectionPool | None = None
        self._outcomes: OutcomeWriter | None = None
        self._last_touch = 0.0
        self._last_reap = 0.0
        # Bound on one claim transaction (normally milliseconds): a silent server must not
        # stall the loop for longer than a fraction of a lease.
        self._db_timeout = max(2.0, min(10.0, settings.lease_seconds / 3))
        self.cancels = Canceller(self)
        self._side_failure: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._reserved = 0
        self.listener: Listener | None = None
        self._claim_budget = ClaimBudget()
        self._log = {"worker_id": str(self.id)}
        # 0, or EXIT_STUCK once a run's thread outlived its grace: the process must end it.
        self.exit_code = 0
        # Set when a stuck thread's run may already run elsewhere (its lease is lost): the
        # drain skips its grace, so the thread dies as soon as possible.
        self._hurry = asyncio.Event()

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, abort: asyncio.Event) -> None:
        """Work until `stop` (drain: finish or release in-flight runs) or `abort` (release now)."""
        s = self.settings
        telemetry.activate(self.tracer_provider)
        self._pool = await open_pool(self.dsn, size=s.connections, name=f"runpool-{os.getpid()}")
        side: list[asyncio.Task[None]] = []
        try:
            await self._register()
            self._stop = stop
            self._outcomes = OutcomeWriter(self._pool, worker_id=self.id, refill=self)
            side.append(asyncio.create_task(self._outcomes.run(), name="outcomes"))
            side.append(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))
            side.append(asyncio.create_task(self._lease_watchdog(), name="lease-watchdog"))
            if s.listen:
                self.listener = Listener(
                    self.dsn, self._attention, self.cancels.on_notice, worker_id=self.id
                )
                side.append(asyncio.create_task(self.listener.run(), name="listener"))
            for task in side:
                # A worker that lost its heartbeat or its outcome writer must not go on
                # half-alive: it stops, and the supervisor starts a fresh one.
                task.add_done_callback(lambda t: self._side_task_done(t, stop, abort))
            logger.info(
                "worker started: concurrency %d, handlers %s", s.concurrency, self.app.names,
                extra={"action": "worker_started", **self._log},
            )
            self.ready.set()
            stopper = asyncio.create_task(self._relay(stop))
            try:
                await self._loop(stop)
            finally:
                stopper.cancel()
                # Even when the loop died (a bug of ours): the runs in flight end or are
                # released now, not left to cost their attempts at lease expiry.
                await self._drain(abort)
        finally:
            await _cancel_all(side)
            await self._unregister()
            await self._pool.close()
            logger.info("worker stopped", extra={"action": "worker_stopped", **self._log})
        if self._side_failure is not None:
            raise WorkerFailed(f"worker {self.id} stopped: its side task failed:"
                               f" {self._side_failure!r}") from self._side_failure

    async def _relay(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._attention.set()

    def _side_task_done(self, task: asyncio.Task[None], stop: asyncio.Event,
                        abort: asyncio.Event) -> None:
        if task.cancelled() or task.exception() is None:
            return
        self._side_failure = task.exception()
        logger.error("side task %s failed: %r; stopping this worker", task.get_name(),
                     self._side_failure, extra={"action": "side_task_failed", **self._log})
        stop.set()
        abort.set()

    async def _register(self) -> None:
        s = self.settings
        assert self._pool is not None
        async with bounded(self._pool, 30) as conn:
            await conn.execute(
                QUERIES["register_worker"],
                {"worker_id": self.id, "host": socket.gethostname(), "pid": os.getpid(),
                 "concurrency": s.concurrency, "handlers": self.app.names},
            )
            await conn.execute(
                QUERIES["update_config"],
                {"aging_seconds": s.aging_seconds, "max_attempts": s.max_attempts,
                 "set_quota": s.tenant_quota is not None, "default_quota": s.tenant_quota,
                 "max_input_bytes": s.max_input_bytes},
            )
        self._last_touch = time.monotonic()

    async def _unregister(self) -> None:
        assert self._pool is not None
        try:
            async with bounded(self._pool, 5) as conn:
                await conn.execute(QUERIES["stop_worker"], {"worker_id": self.id})
        except Exception as exc:  # best effort: the row only informs `status`
            logger.warning("could not mark worker stopped: %s", exc,
                           extra={"action": "worker_unregister_failed", **self._log})

    # -- claiming ----------------------------------------------------------------------------

    def _poll_delay(self) -> float:
        # Jitter spreads the polls of many workers so they do not arrive together; upwards
        # only, so an idle pool never polls more often than RUNPOOL_POLL_SECONDS says.
        return self.settings.poll_seconds * random.uniform(1.0, 1.25)

    async def _loop(self, stop: asyncio.Event) -> None:
        next_poll = time.monotonic() + self._poll_delay()
        backoff = 0.1
        while not stop.is_set():
            free = self.settings.concurrency - len(self.slots)
            self._attention.clear()
            if free > 0:
                try:
                    claimed = await self._claim(free)
                    backoff = 0.1
                except (psycopg.OperationalError, TimeoutError) as exc:
                    logger.warning("claim failed: %r", exc,
                                   extra={"action": "claim_failed", **self._log})
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.settings.poll_seconds)
                    continue
                next_poll = time.monotonic() + self._poll_delay()
                if claimed:
                    self._claim_budget.found_work()
                else:
                    self._claim_budget.spend()
                for c, sent in claimed:
                    self._start(c, sent)
                if len(claimed) == free:
                    continue
            timeout = max(next_poll - time.monotonic(), 0)
            try:
                await asyncio.wait_for(self._attention.wait(), timeout)
            except TimeoutError:
                next_poll = time.monotonic() + self._poll_delay()
            else:
                # A burst of wake-ups (forged, or many workers racing for one run) waits here;
                # the wake-ups meanwhile fold into one claim.
                if (pause := self._claim_budget.delay()) > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), pause)

    def _claim_options(self) -> dict[str, Any]:
        now = time.monotonic()
        touch = now - self._last_touch > self.settings.heartbeat_seconds
        # Reclaiming within a second of expiry is plenty; a claim every few ms need not reap.
        reap = now - self._last_reap > REAP_INTERVAL
        # Marked done when sent: a failed claim is simply repeated at the next one.
        if touch:
            self._last_touch = now
        if reap:
            self._last_reap = now
        return {"worker_id": self.id, "lease_seconds": self.settings.lease_seconds,
                "touch": touch, "reap_expired": reap, "handlers": self.app.names}

    async def _claim(self, limit: int) -> list[tuple[ClaimedRun, float]]:
        """Claimed runs, each with the local time the claim was sent: the lease started no
        earlier, so deadlines counted from it are on the safe side."""
        assert self._pool is not None
        sent = time.monotonic()
        # Slots this claim may fill: the outcome writer's refill must not count them as free.
        self._reserved += limit
        try:
            async with bounded(self._pool, self._db_timeout) as conn:
                claimed = await claim(conn, limit=limit, **self._claim_options())
        finally:
            self._reserved -= limit
        return [(c, sent) for c in claimed]

    # -- refill: claims riding on the outcome writer's transaction (see OutcomeWriter) ---------

    def capacity(self, freed: int) -> int:
        if self._stop is None or self._stop.is_set():
            return 0
        return max(self.settings.concurrency - len(self.slots) - self._reserved + freed, 0)

    async def statements(self, conn: psycopg.AsyncConnection[Any], limit: int
                         ) -> psycopg.AsyncCursor[dict[str, Any]] | None:
        return await claim_statements(conn, limit=limit, **self._claim_options())

    def started(self, claimed: list[ClaimedRun], sent: float) -> None:
        for c in claimed:
            self._start(c, sent)

    def _start(self, c: ClaimedRun, sent: float) -> None:
        # The input is decoded in the slot (_call): a value that cannot be fails this run only.
        run = Run(id=c.id, tenant=c.tenant, handler=c.handler, attempt=c.attempt, input=None,
                  pool=self._pool, max_message_bytes=self.settings.max_message_bytes,
                  write_timeout=self.settings.lease_seconds / 2)
        slot = Slot(c, run, deadline=sent + self.settings.lease_seconds,
                     extra={"run_id": str(c.id), "tenant": c.tenant, **self._log})
        self.slots[c.id] = slot
        slot.task = asyncio.create_task(self._execute(slot), name=f"run-{c.id}")
        self.cancels.on_start(c.id)

    # -- executing ---------------------------------------------------------------------------

    async def _execute(self, slot: Slot) -> None:
        if not telemetry.enabled():
            await self._execute_traced(slot, None)
            return
        c = slot.claimed
        with telemetry.process_span(c.id, c.tenant, c.handler, c.attempt, c.traceparent) as span:
            await self._execute_traced(slot, span)

    async def _execute_traced(self, slot: Slot, span: Any) -> None:
        try:
            try:
                outcome = await self._call(slot)
            except Exception as exc:
                # A bug of ours must end the run visibly, not leave it to a lease expiry.
                logger.exception("internal error running %s", slot.claimed.id,
                                 extra={"action": "run_internal_error", **slot.extra})
                outcome = outcomes.failed(slot.claimed.id, slot.claimed.attempt,
                                          "internal_error", repr(exc))
            # Whatever ended the handler's coroutine (return, cancel, lease loss, drain), a
            # thread of the run may still run: until it returns, the run keeps its slot, its
            # lease and its status (never released, never recorded ended).
            await self._threads_finished(slot)
            if span is not None:
                telemetry.finish(span, *((slot.stop_reason or "abandoned", None)
                                         if outcome is None else (outcome.kind, outcome.reason)))
            if outcome is not None:
                slot.finishing = True
                assert self._outcomes is not None
                status = await self._outcomes.submit(
                    outcome, serial=slot.claimed.serial_key is not None)
                if status == "queued":
                    # Our own retry is due after its backoff: look again then, not at the poll.
                    asyncio.get_running_loop().call_later(
                        outcome.retry_delay, self._attention.set)
                # Per-run success is DEBUG (run_events has every run's story); anything
                # else is worth an operator's eye.
                logger.log(
                    logging.DEBUG if status == "succeeded" else logging.INFO,
                    "run %s attempt %d: %s", slot.claimed.id, slot.claimed.attempt,
                    status or "not recorded (the lease was lost, or the database stayed"
                              " unreachable; the run is reclaimed when its lease expires)",
                    extra={"action": "run_finished" if status else "outcome_not_recorded",
                           **slot.extra},
                )
        finally:
            if self.slots.get(slot.claimed.id) is slot:
                del self.slots[slot.claimed.id]
            self._attention.set()

    async def _threads_finished(self, slot: Slot) -> None:
        while slot.run._threads.running:
            try:
                await slot.run._threads.finished()
            except asyncio.CancelledError:
                # Only a worker that exits may stop waiting: the threads die with it.
                if slot.abandoned:
                    raise

    async def _call(self, slot: Slot) -> Outcome | None:
        c, run = slot.claimed, slot.run
        handler = self.app.get(c.handler)
        if handler is None:
            return outcomes.failed(
                c.id, c.attempt, "unknown_handler",
                f"no handler named {c.handler!r} is registered on this worker"
                f" (known: {', '.join(self.app.names) or 'none'})")
        try:
            run.input = c.decode_input()
        except InvalidInput as exc:
            return outcomes.failed(c.id, c.attempt, "invalid_input", str(exc))
        try:
            if c.attempt > 1:
                await self._resume(slot)
            if handler.is_async:
                result = await handler.fn(run)
            else:
                result = await run._threads.call(handler.fn, run)
        except asyncio.CancelledError:
            if slot.stop_reason == "cancelled":
                return self._cancelled_outcome(slot)
            # lease_lost: another attempt may own the run now; shutdown: released by _drain.
            if slot.stop_reason is None:
                raise
            return None
        except LeaseLost:
            # The run is someone else's now; nothing of this attempt may be written.
            self._abandon(slot, "a checkpoint write found the lease taken", cancel=False)
            return None
        except Exception as exc:
            if slot.stop_reason == "cancelled":
                # E.g. a plain handler's tool_sync refusing to start a call after the cancel.
                return self._cancelled_outcome(slot)
            if not isinstance(exc, Fail | InvalidInput | ToolOutcomeUnknown):
                logger.warning("run %s raised %s", c.id, type(exc).__name__,
                               extra={"action": "run_raised", **slot.extra})
            return outcomes.from_exception(
                c.id, c.attempt, exc, attempts_used=c.attempt - c.attempt_offset,
                backoff=self.settings.retry_backoff_seconds, no_retry=handler.no_retry)
        if run.cancelled:
            return self._cancelled_outcome(slot)
        return outcomes.from_result(c.id, c.attempt, result,
                                    max_bytes=self.settings.max_result_bytes)

    async def _resume(self, slot: Slot) -> None:
        """Restore what earlier attempts committed: resuming reads rows, it replays nothing."""
        assert self._pool is not None
        pool, page_seconds = self._pool, self.settings.lease_seconds / 2
        try:
            # Paged, each page under its own deadline: a long run's history (20,000 messages
            # and calls) is many short reads, not one read that must beat one deadline. A
            # read: repeated when a connection broke under it.
            messages, calls = await again(
                lambda _: checkpoints.load_paged(lambda: bounded(pool, page_seconds),
                                                 slot.claimed.id),
                page_seconds, what="resume read", log=slot.extra)
        except ValueError as exc:
            # jsonb holds values the decoder refuses (nesting past 1,024 levels): every
            # attempt would meet them, so the run fails now instead of retrying.
            raise InvalidInput(f"the run's history cannot be decoded: {exc}") from None
        slot.run._restore(messages, calls)

    def _cancelled_outcome(self, slot: Slot) -> Outcome:
        return Outcome(slot.claimed.id, slot.claimed.attempt, "cancelled",
                       error=outcomes.error_doc("cancelled", "cancelled on request"))

    # -- leases ------------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        # A connection of its own: with every pooled connection busy writing checkpoints (or
        # waiting for one), a heartbeat queued behind them would cost leases.
        beat_pool = await open_pool(self.dsn, size=1, name=f"runpool-beat-{os.getpid()}",
                                    connect_timeout=max(2, int(self.settings.heartbeat_seconds)))
        try:
            interval = self.settings.heartbeat_seconds
            while True:
                await asyncio.sleep(interval)
                # While its connection is being replaced (after a cut, or a silent network),
                # the heartbeat borrows from the shared pool rather than wait for it.
                pool = beat_pool if beat_pool.get_stats().get("pool_available", 0) else self._pool
                assert pool is not None
                try:
                    await self._beat(pool)
                    interval = self.settings.heartbeat_seconds
                except (psycopg.OperationalError, TimeoutError) as exc:
                    logger.warning("heartbeat failed: %r", exc,
                                   extra={"action": "heartbeat_failed", **self._log})
                    # Retry sooner, so a short outage costs no lease.
                    interval = min(1.0, self.settings.heartbeat_seconds)
        finally:
            await beat_pool.close()

    async def _lease_watchdog(self) -> None:
        """Abandon runs whose lease may have run out, on the local clock alone: a heartbeat
        stuck on a dead connection (its cancellation can itself take seconds) must not keep a
        run going past its lease."""
        while True:
            await asyncio.sleep(min(0.5, self.settings.heartbeat_seconds / 2))
            self._abandon_expired()

    async def _beat(self, pool: AsyncConnectionPool) -> None:
        # A cancelled or draining run may have a thread still running: its lease is renewed
        # until the thread returns (or the worker exits with it).
        slots = [s for s in self.slots.values() if s.stop_reason != "lease_lost"]
        if not slots:
            return  # an idle worker shows it is alive through its polls
        sent = time.monotonic()
        async with bounded(pool, self.settings.heartbeat_seconds) as conn:
            cur = await conn.execute(QUERIES["heartbeat"], {
                "ids": [s.claimed.id for s in slots],
                "attempts": [s.claimed.attempt for s in slots],
                "lease_seconds": self.settings.lease_seconds,
                "worker_id": self.id,
            })
            held = {run_id: cancel for run_id, cancel in await cur.fetchall()}
        self._last_touch = sent
        for slot in slots:
            if slot.claimed.id in held:
                cancel = held[slot.claimed.id]
                if cancel is None:
                    # Busy: someone holds the row (an API session's open cancel, say). The
                    # lease is neither renewed nor lost; the next beat tries again, and the
                    # watchdog still stops the run if its lease runs out meanwhile.
                    logger.debug("lease of run %s not renewed: its row is locked",
                                 slot.claimed.id, extra={"action": "lease_busy", **slot.extra})
                    continue
                slot.renew(sent + self.settings.lease_seconds)
                if cancel:
                    self.cancels.cancel(slot)
            elif not slot.finishing and self.slots.get(slot.claimed.id) is slot:
                self._abandon(slot, "the database no longer shows this attempt's lease")

    def _abandon_expired(self) -> None:
        now = time.monotonic()
        for slot in list(self.slots.values()):
            if slot.deadline < now and slot.stop_reason != "lease_lost" and not slot.finishing:
                self._abandon(slot, "the lease could not be renewed before it expired")

    def _abandon(self, slot: Slot, why: str, *, cancel: bool = True) -> None:
        """Stop a run whose lease is (or may be) lost: every later write of it is fenced."""
        if slot.stop_reason == "lease_lost":
            return
        slot.stop_reason = "lease_lost"
        slot.run._mark_lost()
        logger.warning("lease lost for run %s: %s", slot.claimed.id, why,
                       extra={"action": "lease_lost", **slot.extra})
        assert slot.task is not None
        if cancel:
            slot.task.cancel()
        asyncio.get_running_loop().call_later(
            self.settings.cancel_grace_seconds, self.stuck_check, slot,
            "outlived the loss of its lease by the cancel grace", True)

    # -- threads that cannot be stopped --------------------------------------------------------

    def stuck_check(self, slot: Slot, why: str, lost: bool = False) -> None:
        """Past a grace period: a run whose thread still runs makes this worker exit (`lost`:
        the run's lease is gone, so it exits at once, releasing its other runs)."""
        if self.slots.get(slot.claimed.id) is not slot:
            return
        if slot.run._threads.running:
            self._stuck([slot], why)
            if lost:
                self._hurry.set()
        elif lost and not slot.finishing:
            # An async handler that swallowed its cancellation: the run is someone else's now
            # and every write of this attempt is fenced, so the slot is freed (as a forced
            # cancel frees it) instead of being held forever; the task ends when it ends.
            del self.slots[slot.claimed.id]
            logger.error("run %s: the handler %s; its slot is freed", slot.claimed.id, why,
                         extra={"action": "slot_forced_free", **slot.extra})
            self._attention.set()

    def _stuck(self, slots: list[Slot], why: str) -> None:
        """A thread cannot be stopped, and its run may not run anywhere else meanwhile: this
        worker stops claiming, drains its other runs, keeps renewing the stuck runs' leases,
        and exits (EXIT_STUCK) so their threads end with the process. Their leases then expire
        and the reaper reclaims them (or records them cancelled, if a cancel was requested)."""
        for slot in slots:
            slot.run._close("its worker is exiting")
            slot.abandoned = True
            logger.error(
                "run %s: a handler thread %s and cannot be stopped; this worker exits when"
                " its other runs are done, and the run is reclaimed when its lease expires",
                slot.claimed.id, why, extra={"action": "thread_stuck", **slot.extra})
        self.exit_code = EXIT_STUCK
        if self._stop is not None:
            self._stop.set()

    # -- shutdown ----------------------------------------------------------------------------

    async def _drain(self, abort: asyncio.Event) -> None:
        tasks = {s.task for s in self.slots.values() if s.task is not None}
        hurry = (abort, self._hurry)
        if tasks and not any(e.is_set() for e in hurry):
            logger.info("draining %d runs for up to %.1fs", len(tasks),
                        self.settings.grace_seconds, extra={"action": "drain", **self._log})
            deadline = time.monotonic() + self.settings.grace_seconds
            aborted = [asyncio.ensure_future(e.wait()) for e in hurry]
            while (tasks and not any(e.is_set() for e in hurry)
                   and (left := deadline - time.monotonic()) > 0):
                done, _ = await asyncio.wait(
                    [*tasks, *aborted], timeout=left, return_when=asyncio.FIRST_COMPLETED)
                tasks -= done
            for waiter in aborted:
                waiter.cancel()
        unfinished = [s for s in self.slots.values() if not s.finishing]
        for slot in unfinished:
            if slot.stop_reason is None:
                slot.stop_reason = "shutdown"
                # A plain handler gets no CancelledError: its next *_sync call refuses.
                slot.run._close("the worker is shutting down")
                assert slot.task is not None
                slot.task.cancel()
        pending = [s.task for s in self.slots.values() if s.task is not None and not s.abandoned]
        if pending:
            await asyncio.wait(pending, timeout=5)
        # Decided once: a thread ending after this is left to its lease too (safe either way).
        stuck = [s for s in self.slots.values() if s.run._threads.running]
        if stuck:
            self._stuck([s for s in stuck if not s.abandoned], "outlived the drain")
        held = {s.claimed.id for s in stuck}
        await self._release([s for s in unfinished
                             if s.stop_reason == "shutdown" and s.claimed.id not in held])
        # The stuck runs' tasks stay (their leases renewed) until the worker's last moment;
        # asyncio.run cancels them then, and they no longer wait for their threads.

    async def _release(self, slots: list[Slot]) -> None:
        if not slots or self._pool is None:
            return
        try:
            async with bounded(self._pool, 5) as conn:
                await conn.execute(QUERIES["release_runs"], {
                    "ids": [s.claimed.id for s in slots],
                    "attempts": [s.claimed.attempt for s in slots],
                    "worker_id": self.id,
                })
            logger.info("released %d runs", len(slots),
                        extra={"action": "runs_released", **self._log})
        except Exception as exc:
            logger.warning("could not release %d runs (their leases will expire): %s",
                           len(slots), exc, extra={"action": "release_failed", **self._log})
