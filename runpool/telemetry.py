"""Tracing: one trace per run across all its attempts, exported over OTLP/HTTP.

Configured only by the standard OTEL_* variables; with no OTLP endpoint set, tracing is off
and the worker's hot path creates no spans at all. Each worker builds its provider after the
fork (the supervisor never builds one) and flushes it, bounded, before it exits.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

__all__ = [
    "Status",
    "StatusCode",
    "enabled",
    "process_span",
    "run_context",
    "setup_tracing",
    "shutdown_tracing",
    "tracer",
]

logger = logging.getLogger("runpool.telemetry")

# Attribute keys (runpool's own, and the GenAI semantic conventions').
RUN_ID: Final = "runpool.run.id"
TENANT: Final = "runpool.tenant"
ATTEMPT: Final = "runpool.run.attempt"
HANDLER: Final = "runpool.handler"
OUTCOME: Final = "runpool.run.outcome"
GENAI_OPERATION: Final = "gen_ai.operation.name"
GENAI_TOOL_NAME: Final = "gen_ai.tool.name"
GENAI_TOOL_CALL_ID: Final = "gen_ai.tool.call.id"
GENAI_REQUEST_MODEL: Final = "gen_ai.request.model"

_provider: Any = None


def enabled() -> bool:
    """True in a worker whose tracing is configured (checked on the hot path: off is free)."""
    return _provider is not None


def tracer() -> trace.Tracer:
    return trace.get_tracer("runpool")


def setup_tracing(worker_id: uuid.UUID) -> None:
    """Build this process's tracer provider if an OTLP endpoint is configured."""
    global _provider
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return
    if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        logger.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but the exporter is not installed:"
                       " pip install 'runpool[otlp]'", extra={"action": "tracing_unavailable"})
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({
        "service.name": os.environ.get("OTEL_SERVICE_NAME", "runpool"),
        "service.instance.id": str(worker_id),
        "process.pid": os.getpid(),
    })
    # shutdown_on_exit=False: we flush explicitly, bounded, and os._exit skips atexit anyway.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    # A short export timeout: a collector that is down or hangs must not hold up shutdown.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(timeout=3)))
    trace.set_tracer_provider(provider)
    _provider = provider


def shutdown_tracing(timeout_seconds: float = 5.0) -> None:
    global _provider
    if _provider is None:
        return
    try:
        _provider.force_flush(timeout_millis=int(timeout_seconds * 1000))
        _provider.shutdown()
    except Exception as exc:  # never let telemetry break an exit
        logger.warning("tracing shutdown: %s", exc, extra={"action": "tracing_shutdown_failed"})
    _provider = None


def run_context(run_id: uuid.UUID, traceparent: str | None) -> otel_context.Context:
    """The parent of every attempt's span: the enqueue span's context when the run carries a
    traceparent, else a context derived from the run id, so a run enqueued without any trace
    context still gets one trace (its id is the run id) for all its attempts."""
    if traceparent:
        ctx = propagate.extract({"traceparent": traceparent})
        if trace.get_current_span(ctx).get_span_context().is_valid:
            return ctx
    span_id = (run_id.int >> 64) or 1
    parent = SpanContext(trace_id=run_id.int, span_id=span_id, is_remote=True,
                         trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return trace.set_span_in_context(NonRecordingSpan(parent))


@contextmanager
def process_span(run_id: uuid.UUID, tenant: str, handler: str, attempt: int,
                 traceparent: str | None) -> Iterator[Span | None]:
    """The span of one attempt, current while the handler runs (None when tracing is off)."""
    if _provider is None:
        yield None
        return
    span = tracer().start_span(
        f"process {handler}", context=run_context(run_id, traceparent), kind=SpanKind.CONSUMER,
        attributes={RUN_ID: str(run_id), TENANT: tenant, HANDLER: handler, ATTEMPT: attempt})
    with trace.use_span(span, end_on_exit=True):
        yield span


def finish(span: Span | None, outcome: str, error: str | None = None) -> None:
    if span is None:
        return
    span.set_attribute(OUTCOME, outcome)
    if outcome in ("failed", "retry"):
        span.set_status(Status(StatusCode.ERROR, error))
    if outcome in ("retry", "cancelled", "lease_lost"):
        span.add_event(f"runpool.{outcome}", {"reason": error or outcome})


def event(name: str, **attributes: Any) -> None:
    """An event on the current span (a checkpoint hit, say); nothing when tracing is off."""
    if _provider is not None:
        trace.get_current_span().add_event(name, attributes)


@contextmanager
def tool_span(name: str, call_id: str) -> Iterator[Span | None]:
    if _provider is None:
        yield None
        return
    with tracer().start_as_current_span(
            f"execute_tool {name}", kind=SpanKind.INTERNAL,
            attributes={GENAI_OPERATION: "execute_tool", GENAI_TOOL_NAME: name,
                        GENAI_TOOL_CALL_ID: call_id}) as span:
        yield span


@contextmanager
def model_span(model: str) -> Iterator[Span | None]:
    if _provider is None:
        yield None
        return
    with tracer().start_as_current_span(
            f"chat {model}", kind=SpanKind.CLIENT,
            attributes={GENAI_OPERATION: "chat", GENAI_REQUEST_MODEL: model}) as span:
        yield span


def enqueue_traceparent(handler: str, tenant: str) -> tuple[Any, str | None]:
    """Start the enqueue span in the caller's process (its own tracer provider, if any) and
    return it with the traceparent to store; (None, None) when nothing is recording."""
    span = trace.get_tracer("runpool").start_span(
        f"enqueue {handler}", kind=SpanKind.PRODUCER, attributes={TENANT: tenant,
                                                                  HANDLER: handler})
    if not span.get_span_context().is_valid:
        return None, None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return span, carrier.get("traceparent")
