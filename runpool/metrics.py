"""Worker metrics through OpenTelemetry (exported over OTLP by a worker process, see
runpool.otel_setup): what each worker itself sees, beside the console's /metrics, which counts
from the database.

- runpool.run.attempts.started (counter): attempts this worker claimed, by handler;
- runpool.run.wait (histogram, s): a claimed attempt's queue wait, by handler: from the run's
  available_at (its creation, or the end of its retry backoff, delay or wait) to the claim, by
  the database's clock (one clock: the workers' may differ from it);
- runpool.runs.reclaimed (counter): attempts this worker claimed whose previous attempt's
  lease had expired (the run's latest event was the reaper's 'reclaimed'; a retry after a
  failure, a release by a draining worker or a wake-up is not a reclaim), by handler;
- runpool.lease.lost (counter): runs this worker gave up because their lease was, or may have
  been, lost (heartbeat, lease watchdog, or a fenced write), by handler;
- runpool.cancels (counter): cancel requests this worker acted on (a confirmed notice or the
  heartbeat's flag, for a run not already stopping), by handler;
- runpool.cancel.latency (histogram, s): from the moment this worker learnt of a cancel to
  its slot being freed (the outcome written, or the run forced cancelled after the grace), by
  handler;
- runpool.runs.finished (counter): attempts ended, by handler and outcome (succeeded, failed,
  cancelled, retry; the run's status as recorded);
- runpool.run.duration (histogram, s): an attempt's time in its slot, by handler and outcome;
- runpool.claim.duration (histogram, s): one claim transaction of the claim loop;
- runpool.worker.slots.busy / runpool.worker.slots (gauges): slots in use, and all of them.

Attributes are the handler and outcome (and the worker's id on the gauges), never the tenant:
tenants come from callers, and a label per tenant would let them grow the metric without
bound (and a worker's figures would not add up to a tenant's anyway: the per-tenant figures
are the console's /metrics, counted from the database). Like tracing, the meter is a context
variable set when a worker starts: off (None, the global provider being the API's no-op) costs
the hot path one lookup.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Final

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Observation

__all__ = ["activate", "attempt_ended", "attempt_started", "cancel_ended", "cancelled",
           "claimed", "lease_lost"]

HANDLER: Final = "runpool.handler"
OUTCOME: Final = "runpool.run.outcome"
WORKER: Final = "runpool.worker.id"


@dataclass(frozen=True, slots=True)
class _Instruments:
    started: Counter
    finished: Counter
    duration: Histogram
    claim: Histogram
    wait: Histogram
    reclaimed: Counter
    lease_lost: Counter
    cancels: Counter
    cancel_latency: Histogram


_instruments: ContextVar[_Instruments | None] = ContextVar("runpool_meter", default=None)


def activate(provider: Any, *, worker_id: uuid.UUID, busy: Callable[[], int],
             capacity: int) -> None:
    """Record the calling task's (and what it starts) metrics through `provider`, else the
    global provider; off when that is the API's default (no SDK provider installed)."""
    chosen = provider or metrics.get_meter_provider()
    # The SDK, only if someone loaded it (no provider can be its otherwise): importing it
    # cost every worker process ~70 ms of CPU at start (python -X importtime).
    sdk = sys.modules.get("opentelemetry.sdk.metrics")
    if sdk is None or not isinstance(chosen, sdk.MeterProvider):
        # The API's own (a proxy or no-op): nothing would be recorded anyway.
        _instruments.set(None)
        return
    meter = chosen.get_meter("runpool")
    attributes = {WORKER: str(worker_id)}

    def slots_busy(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(busy(), attributes)]

    def slots(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(capacity, attributes)]

    meter.create_observable_gauge("runpool.worker.slots.busy", [slots_busy], unit="{slot}",
                                  description="Run slots in use")
    meter.create_observable_gauge("runpool.worker.slots", [slots], unit="{slot}",
                                  description="Run slots of the worker")
    _instruments.set(_Instruments(
        started=meter.create_counter("runpool.run.attempts.started", unit="{attempt}",
                                     description="Attempts claimed by this worker"),
        finished=meter.create_counter("runpool.runs.finished", unit="{attempt}",
                                      description="Attempts ended, by outcome"),
        duration=meter.create_histogram("runpool.run.duration", unit="s",
                                        description="An attempt's time in its slot"),
        claim=meter.create_histogram("runpool.claim.duration", unit="s",
                                     description="One claim transaction"),
        wait=meter.create_histogram("runpool.run.wait", unit="s",
                                    description="A claimed attempt's wait in the queue"),
        reclaimed=meter.create_counter(
            "runpool.runs.reclaimed", unit="{attempt}",
            description="Attempts claimed after the previous one's lease expired"),
        lease_lost=meter.create_counter("runpool.lease.lost", unit="{attempt}",
                                        description="Attempts given up on a lost lease"),
        cancels=meter.create_counter("runpool.cancels", unit="{attempt}",
                                     description="Cancel requests acted on"),
        cancel_latency=meter.create_histogram(
            "runpool.cancel.latency", unit="s",
            description="A cancel learnt of, to the run's slot freed")))


def attempt_started(handler: str, *, waited: float, reclaimed: bool) -> None:
    if (m := _instruments.get()) is not None:
        attributes = {HANDLER: handler}
        m.started.add(1, attributes)
        m.wait.record(waited, attributes)
        if reclaimed:
            m.reclaimed.add(1, attributes)


def attempt_ended(handler: str, outcome: str, seconds: float) -> None:
    if (m := _instruments.get()) is not None:
        attributes = {HANDLER: handler, OUTCOME: outcome}
        m.finished.add(1, attributes)
        m.duration.record(seconds, attributes)


def lease_lost(handler: str) -> None:
    if (m := _instruments.get()) is not None:
        m.lease_lost.add(1, {HANDLER: handler})


def cancelled(handler: str) -> None:
    if (m := _instruments.get()) is not None:
        m.cancels.add(1, {HANDLER: handler})


def cancel_ended(handler: str, seconds: float) -> None:
    if (m := _instruments.get()) is not None:
        m.cancel_latency.record(seconds, {HANDLER: handler})


def claimed(seconds: float) -> None:
    if (m := _instruments.get()) is not None:
        m.claim.record(seconds)
