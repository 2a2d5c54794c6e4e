"""In-test OTLP trace receivers (HTTP/protobuf and gRPC) that decode what real workers export."""

from __future__ import annotations

import select
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    resource: dict[str, Any] = field(default_factory=dict)
    kind: int = 0


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@dataclass
class Receiver:
    """mode: 'ok' (200), 'unavailable' (503), or 'hang' (never answers until closed)."""

    mode: str = "ok"
    spans: list[ReceivedSpan] = field(default_factory=list)
    # Trace export requests (metrics are counted apart, in metric_requests).
    requests: int = 0
    metric_requests: int = 0
    # (metric name, data point attributes, value) in arrival order; a histogram's value is
    # its count.
    points: list[tuple[str, dict[str, Any], float]] = field(default_factory=list)
    # mode 'hang': how long each client waited before it gave up (closed its connection).
    waited: list[float] = field(default_factory=list)
    _closing: threading.Event = field(default_factory=threading.Event)

    def start(self) -> str:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path.endswith("/v1/metrics"):
                    receiver.decode_metrics(ExportMetricsServiceRequest.FromString(body))
                    reply = ExportMetricsServiceResponse().SerializeToString()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                    return
                receiver.requests += 1
                if receiver.mode == "hang":
                    receiver._hang(self.connection)
                    return
                if receiver.mode == "unavailable":
                    self.send_response(503)
                    self.end_headers()
                    return
                receiver._decode(body)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _hang(self, connection: socket.socket) -> None:
        """Never answer; note when the client gives up on the request (closes its end)."""
        started = time.monotonic()
        while not self._closing.is_set():
            readable, _, _ = select.select([connection], [], [], 0.05)
            if readable and not connection.recv(1, socket.MSG_PEEK):
                self.waited.append(time.monotonic() - started)
                return

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()

    def _decode(self, body: bytes) -> None:
        self.decode(ExportTraceServiceRequest.FromString(body))

    def decode_metrics(self, request: ExportMetricsServiceRequest) -> None:
        self.metric_requests += 1
        for resource_metrics in request.resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for m in scope_metrics.metrics:
                    kind = m.WhichOneof("data")
                    for p in getattr(m, kind).data_points:
                        attributes = {a.key: _value(a.value) for a in p.attributes}
                        value = (p.count if kind == "histogram"
                                 else p.as_int if p.WhichOneof("value") == "as_int"
                                 else p.as_double)
                        self.points.append((m.name, attributes, float(value)))

    def latest(self, name: str) -> dict[tuple[tuple[str, Any], ...], float]:
        """Each attribute set's last value of a metric (cumulative temporality: the total)."""
        return {tuple(sorted(a.items())): v for n, a, v in self.points if n == name}

    def decode(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    self.spans.append(ReceivedSpan(
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(), name=s.name,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        events=[(e.name, {a.key: _value(a.value) for a in e.attributes})
                                for e in s.events], resource=resource, kind=s.kind))


class GrpcReceiver(Receiver):
    """The same receiver behind a real gRPC server (OTEL_EXPORTER_OTLP_PROTOCOL=grpc)."""

    def start(self) -> str:
        from concurrent import futures

        import grpc  # type: ignore[import-untyped]
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        receiver = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: ExportTraceServiceRequest, context: Any
                       ) -> ExportTraceServiceResponse:
                receiver.requests += 1
                receiver.decode(request)
                return ExportTraceServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            Servicer(), self._grpc)
        port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()
        return f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self._grpc.stop(grace=None)
