"""One worker process: an asyncio loop with `concurrency` run slots, fed by claims.

It wakes on a doorbell NOTIFY, when a slot frees, and on a jittered poll timer (the fallback
for lost notifications); it holds every run under a lease it renews in one statement per beat.
The parts: this module claims; runpool.runner runs each slot (runpool.slot holds its state),
runpool.leases keeps the leases, runpool.cancellation confirms cancel notices, runpool.drain
finishes or releases the runs in flight at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import socket
import time
import uuid
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from . import metrics, pooled, telemetry
from .alerts import AlertSender
from .app import App
from .cancellation import Canceller
from .claim_times import ClaimTimes
from .claiming import ClaimedRun, PendingClaim, Statements, claim, claim_statements
from .db import SET_LOCK_TIMEOUT, application_name
from .deadlines import bounded
from .drain import drain
from .errors import WorkerFailed
from .exits import EXIT_STUCK
from .leases import Cadence, LeaseKeeper
from .listener import ClaimBudget, Listener
from .outcomes import OutcomeWriter
from .pools import open_pool
from .progress import Publisher
from .queries import QUERIES
from .relay import RelayReader
from .retention import Purger
from .runner import SlotRunner
from .scheduler import Scheduler, upsert_schedules
from .settings import Settings
from .slot import Slot, Slots
from .tasks import cancel_all
from .trips import FunctionsUnusable
from .wakeups import Wakeups
from .warmup import plan_ahead

__all__ = ["Worker"]

logger = logging.getLogger("runpool.worker")

# Seconds between reaps of expired leases by one busy worker (every claim when idle-polling).
REAP_INTERVAL = 1.0
# Seconds a starting worker waits for the claims in flight at its registration (see _fence):
# normally milliseconds; past this, one has hung, and the worker goes on rather than not start.
FENCE_SECONDS = 10.0


class Worker:
    """One worker: claims runs into `concurrency` slots, runs them, keeps their leases, and
    drains when told to stop. Its parts see it only through the callables it hands them."""

    def __init__(self, settings: Settings, app: App, dsn: str, *,
                 tracer_provider: Any = None, notices_fd: int | None = None) -> None:
        self.id = uuid.uuid4()
        # The worker end of the host's notice relay (see runpool.relay); None: a LISTEN
        # connection of its own.
        self._notices_fd = notices_fd
        # None: the global provider, if its host installed one (see telemetry).
        self.tracer_provider = tracer_provider
        # Set once the worker is registered and claiming (what an embedded Pool waits for).
        self.ready = asyncio.Event()
        self.settings = settings
        self.app = app
        self.dsn = dsn
        self.slots = Slots()
        # Set by the listener, a freed slot and stop requests; the loop re-checks everything.
        self._attention = asyncio.Event()
        self._pool: AsyncConnectionPool | None = None
        # Made once the pool is open (see run).
        self._runner: SlotRunner | None = None
        self._leases: LeaseKeeper | None = None
        # Showing the database this worker is alive: a heartbeat does, else an idle claim.
        self._touch = Cadence(settings.heartbeat_seconds)
        self._reap = Cadence(REAP_INTERVAL)
        # Bound on one claim transaction (normally milliseconds): a silent server must not
        # stall the loop for longer than a fraction of a lease.
        self._db_timeout = max(2.0, min(10.0, settings.lease_seconds / 3))
        # How the claims' and outcome batches' statements travel (runpool.pooled.route).
        self._route = pooled.Route("pipeline")
        self.cancels = Canceller(lookup=self.slots.get, slots=lambda: self.slots,
                                 pool=lambda: self._pool, on_cancel=self._cancel)
        self._side_failure: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._reserved = 0
        # Whether this worker's slots are in runpool.quota_margin and every claim that judged
        # without them has ended (see _fence): its claims may then pass roomy tenants' locks.
        self._roomy = False
        self.listener: Listener | RelayReader | None = None
        self.scheduler: Scheduler | None = None
        self._claim_budget = ClaimBudget()
        # A freed slot's, the poll's and a skipped tenant's wake-ups (see runpool.wakeups).
        self._wakeups = Wakeups(self._attention)
        # Every claim's duration, told on the worker's last log line (see claim_times).
        self.claim_times = ClaimTimes()
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
        metrics.activate(None, worker_id=self.id, busy=lambda: len(self.slots),
                         capacity=s.concurrency)
        self._pool = await open_pool(
            self.dsn, size=s.connections, name=application_name(f"runpool-{os.getpid()}"),
            stateless=s.stateless,
            prepare=functools.partial(plan_ahead, worker_id=self.id,
                                      lease_seconds=s.lease_seconds, handlers=self.app.names))
        side: list[asyncio.Task[None]] = []
        try:
            self._route = await pooled.route(self._pool, stateless=s.stateless, log=self._log)
            await self._register()
            # The app's schedules are in the database before the pool says it is ready.
            await upsert_schedules(self._pool, self.app, self._log)
            self.scheduler = Scheduler(self._pool, catch_up_max=s.schedule_catchup_max,
                                       poll_seconds=s.poll_seconds, worker_id=self.id)
            self._stop = stop
            writer = OutcomeWriter(self._pool, worker_id=self.id, refill=self, via=self._route)
            progress = Publisher(self._pool, log=self._log)
            self._runner = SlotRunner(
                settings=s, app=self.app, pool=self._pool, outcomes=writer, slots=self.slots,
                log=self._log, wake=self._wakeups.slot_freed, on_stuck=self._exit_stuck,
                progress=progress, route=self._route)
            self._leases = LeaseKeeper(
                settings=s, dsn=self.dsn, worker_id=self.id, pool=self._pool, slots=self.slots,
                touch=self._touch, on_cancel=self._cancel, on_lost=self._runner.stops.abandon,
                on_overdue=self._runner.stops.overdue)
            side.append(asyncio.create_task(writer.run(), name="outcomes"))
            side.append(asyncio.create_task(progress.run(), name="progress"))
            side.append(asyncio.create_task(self.scheduler.run(), name="scheduler"))
            side.append(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))
            side.append(asyncio.create_task(self._lease_watchdog(), name="lease-watchdog"))
            if self._route.lacking:
                side.append(asyncio.create_task(
                    self._route.watch(self._pool, s.poll_seconds), name="hot-functions"))
            if s.alert_webhook:
                sender = AlertSender(self._pool, s.alert_webhook, log=self._log)
                side.append(asyncio.create_task(sender.run(), name="alerts"))
            if s.retention_seconds > 0:
                purger = Purger(self._pool, retention_seconds=s.retention_seconds, log=self._log)
                side.append(asyncio.create_task(purger.run(), name="purger"))
            if s.listen and self._notices_fd is not None:
                self.listener = RelayReader(
                    self._notices_fd, self._attention, self.cancels.on_confirmed,
                    worker_id=self.id, on_schedules=self.scheduler.poke,
                    on_listening=self.cancels.on_listening)
                side.append(asyncio.create_task(self.listener.run(), name="relay-reader"))
            elif s.listen:
                self.listener = Listener(
                    s.listen_dsn or self.dsn, self._attention, self.cancels.on_notice,
                    worker_id=self.id,
                    on_schedules=self.scheduler.poke,
                    on_connect=self.cancels.on_listening,
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
            await cancel_all(side)
            await self._unregister()
            await self._pool.close()
            logger.info("worker stopped", extra={"action": "worker_stopped", **self._log,
                                                 "claims": self.claim_times.summary()})
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
        self._touch.done(time.monotonic())
        await self._fence()

    async def _fence(self) -> None:
        """Take the fleet fence in exclusive mode, once: it waits out every claim in flight,
        any of which may have judged a tenant roomy by a fleet without this worker's slots
        (queries.sql, "Roomy tenants"); every claim after it counts them."""
        assert self._pool is not None
        try:
            async with bounded(self._pool, FENCE_SECONDS + 5) as conn, conn.transaction():
                await conn.execute(SET_LOCK_TIMEOUT, {"timeout": f"{FENCE_SECONDS:g}s"})
                await conn.execute(QUERIES["fence_fleet"])
        except psycopg.errors.LockNotAvailable:
            # A claim (or a session) has held the fence's share mode that long: a claim
            # that hung before judging could still take a roomy tenant's runs as if this
            # worker's slots did not exist. Starting anyway is the lesser harm.
            logger.warning("the fleet fence stayed held for %gs; starting without it",
                           FENCE_SECONDS, extra={"action": "fence_timeout", **self._log})
        self._roomy = True

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
            if not await self._attend(max(next_poll - time.monotonic(), 0)):
                next_poll = time.monotonic() + self._poll_delay()
                self._wakeups.polled()
            else:
                # A burst of wake-ups (forged, or many workers racing for one run) waits here;
                # the wake-ups meanwhile fold into one claim.
                if (pause := self._claim_budget.delay()) > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), pause)

    async def _attend(self, seconds: float) -> bool:
        """Wait for attention (True) or until `seconds` pass (False: a poll is due). A timer
        on the event, not asyncio.wait_for: that wraps each wait in a task of its own, two
        more loop turns on every wake-up's path."""
        polled = False

        def poll() -> None:
            nonlocal polled
            polled = True
            self._attention.set()

        timer = asyncio.get_running_loop().call_later(seconds, poll)
        try:
            await self._attention.wait()
        finally:
            timer.cancel()
        return not polled

    def _claim_options(self, *, refill: bool) -> dict[str, Any]:
        now = time.monotonic()
        # Marked done when sent: a failed claim is simply repeated at the next one. Reclaiming
        # within a second of expiry is plenty; a claim every few ms need not reap.
        return {"worker_id": self.id, "lease_seconds": self.settings.lease_seconds,
                "touch": self._touch.due(now), "reap_expired": self._reap.due(now),
                "promote": self._wakeups.promote(now, refill=refill),
                "handlers": self.app.names,
                "on_schedules": self.scheduler.observe if self.scheduler else None,
                "on_skipped": self._wakeups.skipped, "roomy": self._roomy}

    async def _claim(self, limit: int) -> list[tuple[ClaimedRun, float]]:
        """Claimed runs, each with the local time the claim was sent: the lease started no
        earlier, so deadlines counted from it are on the safe side."""
        assert self._pool is not None
        sent = time.monotonic()
        # Slots this claim may fill: the outcome writer's refill must not count them as free.
        self._reserved += limit
        try:
            async with bounded(self._pool, self._db_timeout) as conn:
                try:
                    claimed = await claim(conn, limit=limit, via=self._route.via,
                                          **self._claim_options(refill=False))
                except FunctionsUnusable as exc:
                    self._route.fall_back(exc)  # rolled back whole: claim the other way
                    claimed = await claim(conn, limit=limit, via=self._route.via,
                                          **self._claim_options(refill=False))
        finally:
            self._reserved -= limit
        took = time.monotonic() - sent
        metrics.claimed(took)
        self.claim_times.record(took, len(claimed))
        return [(c, sent) for c in claimed]

    # -- refill: claims riding on the outcome writer's transaction (see OutcomeWriter) ---------

    def capacity(self, freed: int) -> int:
        if self._stop is None or self._stop.is_set():
            return 0
        # Only the slots the batch frees: those are still in the table, where the claim loop
        # does not count them. The empty ones are the loop's: when the refill took them too,
        # the loop, woken meanwhile (a slot freed, an enqueue's doorbell), counted them as
        # well, and a worker held its concurrency plus its empty slots with no fault at all
        # (10 runs at 8); reserving them for the refill instead left them empty while a slow
        # refill's trip lasted.
        return min(freed, max(
            self.settings.concurrency - len(self.slots) - self._reserved + freed, 0))

    async def statements(self, conn: Statements, limit: int) -> PendingClaim:
        return await claim_statements(conn, limit=limit, **self._claim_options(refill=True))

    def started(self, claimed: list[ClaimedRun], sent: float) -> None:
        self.claim_times.record(time.monotonic() - sent, len(claimed))
        for c in claimed:
            self._start(c, sent)

    def _start(self, c: ClaimedRun, sent: float) -> None:
        # The input is decoded in the slot: a value that cannot be fails this run only.
        assert self._runner is not None
        self._runner.start(c, sent)
        self.cancels.on_start(c.id, sent)

    # -- what the slots' other owners may ask of the worker -----------------------------------

    def _cancel(self, slot: Slot) -> None:
        """A cancel of the slot's run is confirmed (a notice checked, or the heartbeat's flag)."""
        assert self._runner is not None  # a slot exists only once the runner does
        self._runner.stops.cancel(slot)

    async def _heartbeat_loop(self) -> None:
        assert self._leases is not None
        await self._leases.heartbeat_loop()

    async def _lease_watchdog(self) -> None:
        assert self._leases is not None
        await self._leases.watchdog()

    def _exit_stuck(self, hurry: bool) -> None:
        """A run's thread cannot be stopped: this worker stops claiming, and exits with
        EXIT_STUCK once drained so the thread ends with the process (`hurry`: the run's lease
        is lost and it may run elsewhere, so the drain skips its grace)."""
        self.exit_code = EXIT_STUCK
        if self._stop is not None:
            self._stop.set()
        if hurry:
            self._hurry.set()

    async def _drain(self, abort: asyncio.Event) -> None:
        await drain(self.slots, self._runner, self._pool, hurry=(abort, self._hurry),
                    grace=self.settings.grace_seconds, worker_id=self.id, log=self._log)
        if self._runner is not None and not (abort.is_set() or self._hurry.is_set()):
            # The last writes' doorbells, rung before the pool closes under them (not by a
            # worker told to hurry: a lost ring only leaves its followers to their poll).
            await self._runner.doorbells.close()
