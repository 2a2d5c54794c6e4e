"""Tracing: one trace per run across all its attempts.

A pool traces through the tracer provider it is given, else the global one its host set; with
neither (no SDK provider anywhere) tracing is off and the hot path creates no spans at all.
An embedded pool (runpool.Pool) never builds or installs a provider: that is the host
application's business. A worker process of `python -m runpool worker` is its own host: it
builds a provider from the standard OTEL_* variables (OTLP/HTTP export) after the fork (the
supervisor never builds one) and flushes it, bounded, before it exits.

The tracer in use is a context variable set when a worker starts: every task the worker starts
(and every thread a handler runs in) inherits it, so two pools in one process do not mix.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
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
    "activate",
    "agent_span",
    "enabled",
    "process_span",
    "run_context",
    "trace_id_of",
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
GENAI_PROVIDER: Final = "gen_ai.provider.name"
GENAI_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GENAI_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
GENAI_AGENT_NAME: Final = "gen_ai.agent.name"
GENAI_CONVERSATION_ID: Final = "gen_ai.conversation.id"
# The messaging semantic conventions' consumer attributes: a run is a message, its handler the
# destination it was sent to (the span's name is "process {destination}" as they ask).
MESSAGING_SYSTEM: Final = "messaging.system"
MESSAGING_OPERATION_TYPE: Final = "messaging.operation.type"
MESSAGING_OPERATION_NAME: Final = "messaging.operation.name"
MESSAGING_DESTINATION: Final = "messaging.destination.name"
MESSAGING_MESSAGE_ID: Final = "messaging.message.id"

# The tracer of the worker this code runs under; None: tracing is off.
_tracer: ContextVar[trace.Tracer | None] = ContextVar("runpool_tracer", default=None)
# The model call (`chat {model}` span) in progress in this task, which usage is reported on.
_chat: ContextVar[Span | None] = ContextVar("runpool_chat_span", default=None)


def enabled() -> bool:
    """True under a worker whose tracing is on (checked on the hot path: off is free)."""
    return _tracer.get() is not None


def activate(provider: trace.TracerProvider | None) -> None:
    """Trace the calling task (and what it starts) through `provider`, else the global
    provider; off when that is the API's default (no SDK provider was ever installed)."""
    chosen = provider or trace.get_tracer_provider()
    if isinstance(chosen, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        _tracer.set(None)
        return
    _tracer.set(chosen.get_tracer("runpool"))


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


def trace_id_of(run_id: uuid.UUID, traceparent: str | None) -> str:
    """The run's trace id as 32 hex digits (its logs carry it even with tracing off)."""
    if not traceparent:
        return run_id.hex  # run_context's derived trace (the common case, kept cheap)
    span = trace.get_current_span(run_context(run_id, traceparent)).get_span_context()
    return format(span.trace_id, "032x")


@contextmanager
def process_span(run_id: uuid.UUID, tenant: str, handler: str, attempt: int,
                 traceparent: str | None) -> Iterator[Span | None]:
    """The span of one attempt, current while the handler runs (None when tracing is off)."""
    tracer = _tracer.get()
    if tracer is None:
        yield None
        return
    span = tracer.start_span(
        f"process {handler}", context=run_context(run_id, traceparent), kind=SpanKind.CONSUMER,
        attributes={RUN_ID: str(run_id), TENANT: tenant, HANDLER: handler, ATTEMPT: attempt,
                    MESSAGING_SYSTEM: "runpool", MESSAGING_OPERATION_TYPE: "process",
                    MESSAGING_OPERATION_NAME: "process", MESSAGING_DESTINATION: handler,
                    MESSAGING_MESSAGE_ID: str(run_id)})
    with trace.use_span(span, end_on_exit=True):
        yield span


@contextmanager
def agent_span(run_id: uuid.UUID, handler: str) -> Iterator[Span | None]:
    """The GenAI conventions' `invoke_agent {name}` span around the handler (the agent), in
    the process span: its model turns and tool calls are its children. The run is the
    conversation (its id is the conversation id across every attempt). What ends the handler
    (its outcome, its error) is recorded on the process span only: an exception escaping here
    may be control flow (a durable wait suspending the attempt, a cancellation), not a
    failure."""
    tracer = _tracer.get()
    if tracer is None:
        yield None
        return
    with tracer.start_as_current_span(
            f"invoke_agent {handler}", kind=SpanKind.INTERNAL,
            attributes={GENAI_OPERATION: "invoke_agent", GENAI_AGENT_NAME: handler,
                        GENAI_CONVERSATION_ID: str(run_id)},
            record_exception=False, set_status_on_exception=False) as span:
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
    if _tracer.get() is not None:
        trace.get_current_span().add_event(name, attributes)


@contextmanager
def tool_span(name: str, call_id: str) -> Iterator[Span | None]:
    tracer = _tracer.get()
    if tracer is None:
        yield None
        return
    with tracer.start_as_current_span(
            f"execute_tool {name}", kind=SpanKind.INTERNAL,
            attributes={GENAI_OPERATION: "execute_tool", GENAI_TOOL_NAME: name,
                        GENAI_TOOL_CALL_ID: call_id}) as span:
        yield span


@contextmanager
def model_span(model: str, provider: str | None = None) -> Iterator[Span | None]:
    tracer = _tracer.get()
    if tracer is None:
        yield None
        return
    attributes = {GENAI_OPERATION: "chat", GENAI_REQUEST_MODEL: model}
    if provider:
        attributes[GENAI_PROVIDER] = provider
    with tracer.start_as_current_span(f"chat {model}", kind=SpanKind.CLIENT,
                                      attributes=attributes) as span:
        token = _chat.set(span)
        try:
            yield span
        finally:
            _chat.reset(token)


def usage(input_tokens: int, output_tokens: int, provider: str | None) -> None:
    """Report a model call's usage on the `chat` span in progress (GenAI conventions); nothing
    outside a model call, or when tracing is off."""
    span = _chat.get()
    if span is None:
        return
    span.set_attribute(GENAI_INPUT_TOKENS, input_tokens)
    span.set_attribute(GENAI_OUTPUT_TOKENS, output_tokens)
    if provider:
        span.set_attribute(GENAI_PROVIDER, provider)


def child_traceparent(run_id: uuid.UUID, traceparent: str | None) -> str | None:
    """The traceparent a run's child carries: the attempt's span while tracing, else the run's
    own trace context (see run_context), so a parent and its children share one trace."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=None if _tracer.get() is not None
                     else run_context(run_id, traceparent))
    return carrier.get("traceparent")


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
