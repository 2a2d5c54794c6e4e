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

import importlib.util
import logging
import os
import uuid
from collections.abc import Iterator, Mapping
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

from .errors import InvalidInput

__all__ = [
    "Status",
    "StatusCode",
    "activate",
    "agent_span",
    "build_provider",
    "check_env",
    "enabled",
    "exporters",
    "process_span",
    "provider_from_env",
    "run_context",
    "shutdown_provider",
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


# OTEL_TRACES_EXPORTER values runpool builds (as the SDK's auto-configuration names them).
EXPORTERS: Final = ("otlp", "console", "none")
PROTOCOLS: Final = ("http/protobuf", "grpc")
# Our export timeout when OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT is unset (the SDK's is 10 s): a
# collector that is down or hangs must not hold up a worker's exit for long.
DEFAULT_EXPORT_TIMEOUT: Final = 3.0


def _env(environ: Mapping[str, str], *names: str) -> str | None:
    """The first of `names` set to something non-blank (signal-specific variables first)."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return value
    return None


def exporters(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The span exporters the OTEL_* variables ask for; () when tracing is off.

    OTEL_TRACES_EXPORTER is read as the SDK reads it (a comma-separated list, `none` for
    nothing). Unset, it is `otlp` once an OTLP endpoint is configured and nothing otherwise,
    so a pool started without any telemetry configuration does not retry exports to a
    collector nobody runs. Raises InvalidInput naming the variable for what it cannot build.
    """
    env = os.environ if environ is None else environ
    if (_env(env, "OTEL_SDK_DISABLED") or "").lower() == "true":
        return ()
    raw = _env(env, "OTEL_TRACES_EXPORTER")
    if raw is None:
        endpoint = _env(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
        return ("otlp",) if endpoint else ()
    names = tuple(dict.fromkeys(n.strip().lower() for n in raw.split(",") if n.strip()))
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise InvalidInput(f"OTEL_TRACES_EXPORTER: unknown exporter(s) {unknown}; runpool"
                           f" builds {', '.join(EXPORTERS)}")
    return tuple(n for n in names if n != "none")


def protocol(environ: Mapping[str, str] | None = None) -> str:
    """The OTLP protocol for traces (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, then
    OTEL_EXPORTER_OTLP_PROTOCOL, default http/protobuf); InvalidInput for another one, or for
    grpc without its exporter installed."""
    env = os.environ if environ is None else environ
    chosen = (_env(env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
              or "http/protobuf").lower()
    if chosen not in PROTOCOLS:
        raise InvalidInput(f"OTEL_EXPORTER_OTLP_PROTOCOL: {chosen!r} is not supported; use"
                           f" {' or '.join(PROTOCOLS)}")
    package = _EXPORTER_PACKAGES[chosen]
    if not _installed(package.replace("-", ".")):
        raise InvalidInput(f"OTEL_EXPORTER_OTLP_PROTOCOL={chosen} needs the {package} package:"
                           " pip install 'runpool[otlp]'")
    return chosen


_EXPORTER_PACKAGES: Final = {"grpc": "opentelemetry-exporter-otlp-proto-grpc",
                             "http/protobuf": "opentelemetry-exporter-otlp-proto-http"}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def check_env(environ: Mapping[str, str] | None = None) -> None:
    """Refuse OTEL_* settings no worker could build, before any worker is forked (the
    supervisor imports nothing of the exporters: checking never starts a thread)."""
    if "otlp" in exporters(environ):
        protocol(environ)


def _span_exporter(name: str, env: Mapping[str, str]) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    # The SDK reads the endpoint, headers, certificates, compression and timeout from the
    # environment itself; runpool only shortens the timeout when none is configured.
    timeout = (None if _env(env, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
               else DEFAULT_EXPORT_TIMEOUT)
    if protocol(env) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(timeout=timeout)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(timeout=timeout)


def build_provider(worker_id: uuid.UUID) -> Any:
    """An SDK tracer provider for one worker process, built from the OTEL_* variables as the
    SDK defines them; None when tracing is off. Not installed (see provider_from_env)."""
    env = os.environ
    names = exporters(env)
    if not names:
        return None
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME, then OTEL_RESOURCE_ATTRIBUTES' service.name (the SDK's detector
    # applies that order), then "runpool"; what the operator set is never overridden.
    given = OTELResourceDetector().detect().attributes
    ours: dict[str, Any] = {"service.name": "runpool", "service.instance.id": str(worker_id),
                            "process.pid": os.getpid()}
    resource = Resource.create({k: v for k, v in ours.items() if k not in given})
    # shutdown_on_exit=False: we flush explicitly, bounded, and os._exit skips atexit anyway.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_span_exporter(name, env)))
    return provider


def provider_from_env(worker_id: uuid.UUID) -> Any:
    """For a worker process that owns its process: build_provider's provider, installed
    globally (so spans the handlers start themselves go to the same exporters); else None.
    A setting it cannot build is logged and tracing stays off: the supervisor refused it
    already (check_env), so this only happens to a process started some other way."""
    try:
        provider = build_provider(worker_id)
    except InvalidInput as exc:
        logger.error("tracing is off: %s", exc, extra={"action": "tracing_unavailable"})
        return None
    if provider is not None:
        trace.set_tracer_provider(provider)
    return provider


def shutdown_provider(provider: Any, timeout_seconds: float = 5.0) -> None:
    """Flush and shut down a provider built by provider_from_env (bounded)."""
    if provider is None:
        return
    try:
        provider.force_flush(timeout_millis=int(timeout_seconds * 1000))
        provider.shutdown()
    except Exception as exc:  # never let telemetry break an exit
        logger.warning("tracing shutdown: %s", exc, extra={"action": "tracing_shutdown_failed"})


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
