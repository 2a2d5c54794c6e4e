"""The OpenTelemetry providers of a worker process, built from the standard OTEL_* variables as
the SDK defines them: a tracer provider (OTEL_TRACES_EXPORTER) and a meter provider
(OTEL_METRICS_EXPORTER), exporting over OTLP (http/protobuf or grpc) or to the console.

Only a process that is the pool's own builds them (a worker of `python -m runpool worker`,
after the fork); an embedded Pool uses what its host installed. The supervisor only checks the
variables (check_env) before it forks, importing none of the exporters.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from opentelemetry import metrics, trace

from .errors import InvalidInput

__all__ = ["DEFAULT_EXPORT_TIMEOUT", "Providers", "build_meter_provider", "build_provider",
           "check_env", "exporters", "from_env", "protocol"]

logger = logging.getLogger("runpool.telemetry")

Signal = Literal["traces", "metrics"]
# OTEL_{TRACES,METRICS}_EXPORTER values runpool builds (as the SDK's auto-configuration names
# them).
EXPORTERS: Final = ("otlp", "console", "none")
PROTOCOLS: Final = ("http/protobuf", "grpc")
# Our export timeout when OTEL_EXPORTER_OTLP_(<SIGNAL>_)TIMEOUT is unset (the SDK's is 10 s):
# a collector that is down or hangs must not hold up a worker's exit for long.
DEFAULT_EXPORT_TIMEOUT: Final = 3.0
_EXPORTER_PACKAGES: Final = {"grpc": "opentelemetry-exporter-otlp-proto-grpc",
                             "http/protobuf": "opentelemetry-exporter-otlp-proto-http"}


def _env(environ: Mapping[str, str], *names: str) -> str | None:
    """The first of `names` set to something non-blank (signal-specific variables first)."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return value
    return None


def exporters(environ: Mapping[str, str] | None = None,
              signal: Signal = "traces") -> tuple[str, ...]:
    """The exporters OTEL_<SIGNAL>_EXPORTER asks for; () when the signal is off.

    Read as the SDK reads it (a comma-separated list, `none` for nothing). Unset, it is `otlp`
    once an OTLP endpoint is configured and nothing otherwise, so a pool started without any
    telemetry configuration does not retry exports to a collector nobody runs. Raises
    InvalidInput naming the variable for what it cannot build.
    """
    env = os.environ if environ is None else environ
    if (_env(env, "OTEL_SDK_DISABLED") or "").lower() == "true":
        return ()
    variable = f"OTEL_{signal.upper()}_EXPORTER"
    raw = _env(env, variable)
    if raw is None:
        endpoint = _env(env, f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT",
                        "OTEL_EXPORTER_OTLP_ENDPOINT")
        return ("otlp",) if endpoint else ()
    names = tuple(dict.fromkeys(n.strip().lower() for n in raw.split(",") if n.strip()))
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise InvalidInput(f"{variable}: unknown exporter(s) {unknown}; runpool builds"
                           f" {', '.join(EXPORTERS)}")
    return tuple(n for n in names if n != "none")


def protocol(environ: Mapping[str, str] | None = None, signal: Signal = "traces") -> str:
    """The OTLP protocol of a signal (OTEL_EXPORTER_OTLP_<SIGNAL>_PROTOCOL, then
    OTEL_EXPORTER_OTLP_PROTOCOL, default http/protobuf); InvalidInput for another one, or for
    grpc without its exporter installed."""
    env = os.environ if environ is None else environ
    chosen = (_env(env, f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL",
                   "OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").lower()
    if chosen not in PROTOCOLS:
        raise InvalidInput(f"OTEL_EXPORTER_OTLP_PROTOCOL: {chosen!r} is not supported; use"
                           f" {' or '.join(PROTOCOLS)}")
    package = _EXPORTER_PACKAGES[chosen]
    if not _installed(package.replace("-", ".")):
        raise InvalidInput(f"OTEL_EXPORTER_OTLP_PROTOCOL={chosen} needs the {package} package:"
                           " pip install 'runpool[otlp]'")
    return chosen


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def check_env(environ: Mapping[str, str] | None = None) -> None:
    """Refuse OTEL_* settings no worker could build, before any worker is forked (checking
    imports no exporter and starts no thread)."""
    signals: tuple[Signal, ...] = ("traces", "metrics")
    for signal in signals:
        if "otlp" in exporters(environ, signal):
            protocol(environ, signal)


def _timeout(env: Mapping[str, str], signal: Signal) -> float | None:
    """None (the SDK reads the variable itself) when one is set, else our short default."""
    given = _env(env, f"OTEL_EXPORTER_OTLP_{signal.upper()}_TIMEOUT",
                 "OTEL_EXPORTER_OTLP_TIMEOUT")
    return None if given else DEFAULT_EXPORT_TIMEOUT


def _span_exporter(name: str, env: Mapping[str, str]) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    # The SDK reads the endpoint, headers, certificates, compression and timeout from the
    # environment itself; runpool only shortens the timeout when none is configured.
    if protocol(env) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )

        return GrpcSpanExporter(timeout=_timeout(env, "traces"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(timeout=_timeout(env, "traces"))


def _metric_exporter(name: str, env: Mapping[str, str]) -> Any:
    if name == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

        return ConsoleMetricExporter()
    if protocol(env, "metrics") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcMetricExporter,
        )

        return GrpcMetricExporter(timeout=_timeout(env, "metrics"))
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter(timeout=_timeout(env, "metrics"))


def _resource(worker_id: uuid.UUID) -> Any:
    """OTEL_SERVICE_NAME, then OTEL_RESOURCE_ATTRIBUTES' service.name (the SDK's detector
    applies that order), then "runpool"; what the operator set is never overridden."""
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    given = OTELResourceDetector().detect().attributes
    ours: dict[str, Any] = {"service.name": "runpool", "service.instance.id": str(worker_id),
                            "process.pid": os.getpid()}
    return Resource.create({k: v for k, v in ours.items() if k not in given})


def build_provider(worker_id: uuid.UUID) -> Any:
    """An SDK tracer provider from the OTEL_* variables; None when tracing is off."""
    names = exporters(os.environ)
    if not names:
        return None
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # shutdown_on_exit=False: we flush explicitly, bounded, and os._exit skips atexit anyway.
    provider = TracerProvider(resource=_resource(worker_id), shutdown_on_exit=False)
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_span_exporter(name, os.environ)))
    return provider


def build_meter_provider(worker_id: uuid.UUID) -> Any:
    """An SDK meter provider from the OTEL_* variables (exported every
    OTEL_METRIC_EXPORT_INTERVAL ms, the SDK's 60 s by default); None when metrics are off."""
    names = exporters(os.environ, "metrics")
    if not names:
        return None
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    readers = [PeriodicExportingMetricReader(_metric_exporter(name, os.environ))
               for name in names]
    return MeterProvider(metric_readers=readers, resource=_resource(worker_id),
                         shutdown_on_exit=False)


@dataclass(frozen=True, slots=True)
class Providers:
    """What a worker process built (either may be None)."""

    tracer: Any = None
    meter: Any = None

    def shutdown(self, timeout_seconds: float = 5.0) -> None:
        """Flush and shut down, both within `timeout_seconds`; telemetry never breaks an
        exit."""
        deadline = time.monotonic() + timeout_seconds
        for provider in (self.tracer, self.meter):
            if provider is None:
                continue
            left = max(deadline - time.monotonic(), 0.1)
            try:
                provider.force_flush(timeout_millis=int(left * 1000))
                provider.shutdown()
            except Exception as exc:
                logger.warning("telemetry shutdown: %s", exc,
                               extra={"action": "tracing_shutdown_failed"})


def from_env(worker_id: uuid.UUID) -> Providers:
    """For a worker process that owns its process: the providers the variables ask for,
    installed globally (so spans and metrics the handlers make themselves go to the same
    exporters). A setting that cannot be built is logged and that signal stays off: the
    supervisor refused it already (check_env), so this only happens to a process started
    some other way."""
    built: dict[str, Any] = {}
    for key, build in (("tracer", build_provider), ("meter", build_meter_provider)):
        try:
            built[key] = build(worker_id)
        except InvalidInput as exc:
            logger.error("telemetry is off: %s", exc, extra={"action": "tracing_unavailable"})
    providers = Providers(**built)
    if providers.tracer is not None:
        trace.set_tracer_provider(providers.tracer)
    if providers.meter is not None:
        metrics.set_meter_provider(providers.meter)
    return providers
