"""Worker metrics through OpenTelemetry (exported over OTLP by a worker process, see
runpool.otel_setup): what each worker itself sees, beside the console's /metrics, which counts
from the database.

- runpool.run.attempts.started (counter): attempts this worker claimed, by handler;
- runpool.runs.finished (counter): attempts ended, by handler and outcome (succeeded, failed,
  cancelled, retry; the run's status as recorded);
- runpool.run.duration (histogram, s): an attempt's time in its slot, by handler and outcome;
- runpool.claim.duration (histogram, s): one claim transaction of the claim loop;
- runpool.worker.slots.busy / runpool.worker.slots (gauges): slots in use, and all of them.

Attributes are the handler and outcome (and the worker's id on the gauges), never the tenant:
tenants come from callers, and a label per tenant would let them grow the metric without
bound. Like tracing, the meter is a context variable set when a worker starts: off (None, the
global provider being the API's no-op) costs the hot path one lookup.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Final

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Observation
from opentelemetry.sdk.metrics import MeterProvider

__all__ = ["activate", "attempt_ended", "attempt_started", "claimed"]

HANDLER: Final = "runpool.handler"
OUTCOME: Final = "runpool.run.outcome"
WORKER: Final = "runpool.worker.id"


@dataclass(frozen=True, slots=True)
class _Instruments:
    started: Counter
    finished: Counter
    duration: Histogram
    claim: Histogram


_instruments: ContextVar[_Instruments | None] = ContextVar("runpool_meter", default=None)


def activate(provider: Any, *, worker_id: uuid.UUID, busy: Callable[[], int],
             capacity: int) -> None:
    """Record the calling task's (and what it starts) metrics through `provider`, else the
    global provider; off when that is the API's default (no SDK provider installed)."""
    chosen = provider or metrics.get_meter_provider()
    if not isinstance(chosen, MeterProvider):
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
                                     description="One claim transaction")))


def attempt_started(handler: str) -> None:
    if (m := _instruments.get()) is not None:
        m.started.add(1, {HANDLER: handler})


def attempt_ended(handler: str, outcome: str, seconds: float) -> None:
    if (m := _instruments.get()) is not None:
        attributes = {HANDLER: handler, OUTCOME: outcome}
        m.finished.add(1, attributes)
        m.duration.record(seconds, attributes)


def claimed(seconds: float) -> None:
    if (m := _instruments.get()) is not None:
        m.claim.record(seconds)
