"""A real OTLP receiver for tests (``from tests.support_otlp import OtlpReceiver``): the
collector's trace and metrics services over gRPC (port 4317's protocol) and over HTTP with
protobuf bodies (4318's: ``POST /v1/traces``, ``/v1/metrics``), both on loopback, recording the
span and metric names each transport received."""

from __future__ import annotations

import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_pb
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as metrics_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as trace_grpc


def _spans(request: trace_pb.ExportTraceServiceRequest) -> list:
    return [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]


def _metric_names(request: metrics_pb.ExportMetricsServiceRequest) -> list[str]:
    return [m.name for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]


def _record_metrics(receiver: OtlpReceiver, transport: str, request: metrics_pb.ExportMetricsServiceRequest) -> None:
    receiver.record(transport, metrics=_metric_names(request), resource_metrics=list(request.resource_metrics))


class OtlpReceiver:
    """Both OTLP transports on free loopback ports: ``grpc_endpoint`` (``http://127.0.0.1:P``, what
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` takes for grpc) and ``http_endpoint`` (the base URL the HTTP
    exporters append ``/v1/<signal>`` to). ``spans[transport]`` and ``metrics[transport]``
    (transport ``"grpc"`` or ``"http/protobuf"``) list the names received, in order;
    ``received[transport]`` the spans themselves (``opentelemetry.proto.trace.v1.Span``),
    ``resource_metrics[transport]`` the metrics (``opentelemetry.proto.metrics.v1.ResourceMetrics``)."""

    __test__ = False

    def __init__(self) -> None:
        self.spans: dict[str, list[str]] = {"grpc": [], "http/protobuf": []}
        self.metrics: dict[str, list[str]] = {"grpc": [], "http/protobuf": []}
        self.received: dict[str, list] = {"grpc": [], "http/protobuf": []}
        self.resource_metrics: dict[str, list] = {"grpc": [], "http/protobuf": []}
        self._lock = threading.Lock()
        self._grpc = grpc.server(futures.ThreadPoolExecutor(4))
        trace_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._grpc)
        metrics_grpc.add_MetricsServiceServicer_to_server(_MetricsService(self), self._grpc)
        port = self._grpc.add_insecure_port("127.0.0.1:0")
        self.grpc_endpoint = f"http://127.0.0.1:{port}"
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.http_endpoint = f"http://127.0.0.1:{self._http.server_address[1]}"

    def record(self, transport: str, spans: list = (), metrics: list[str] = (), resource_metrics: list = ()) -> None:
        with self._lock:
            self.received[transport] += spans
            self.resource_metrics[transport] += resource_metrics
            self.spans[transport] += [s.name for s in spans]
            self.metrics[transport] += metrics

    def __enter__(self) -> OtlpReceiver:
        self._grpc.start()
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._grpc.stop(None)
        self._http.shutdown()
        self._http.server_close()


class _TraceService(trace_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request, context):  # noqa: N802 - the service's method name
        self.receiver.record("grpc", spans=_spans(request))
        return trace_pb.ExportTraceServiceResponse()


class _MetricsService(metrics_grpc.MetricsServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request, context):  # noqa: N802 - the service's method name
        _record_metrics(self.receiver, "grpc", request)
        return metrics_pb.ExportMetricsServiceResponse()


def _handler(receiver: OtlpReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.headers.get("content-type") != "application/x-protobuf":
                self.send_error(415, "OTLP/HTTP here takes application/x-protobuf")
                return
            if self.path == "/v1/traces":
                receiver.record("http/protobuf", spans=_spans(trace_pb.ExportTraceServiceRequest.FromString(body)))
                answer = trace_pb.ExportTraceServiceResponse()
            elif self.path == "/v1/metrics":
                _record_metrics(receiver, "http/protobuf", metrics_pb.ExportMetricsServiceRequest.FromString(body))
                answer = metrics_pb.ExportMetricsServiceResponse()
            else:
                self.send_error(404)
                return
            data = answer.SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    return Handler
