"""OpenTelemetry setup shared by the replica and the router (DESIGN.md §6).

One call per process, :func:`setup_telemetry`, builds the two providers and their exporters::

    MeterProvider ──▶ PrometheusMetricReader ──▶ own CollectorRegistry ──▶ HTTP :metrics_port/metrics
                  └─▶ PeriodicExportingMetricReader(OTLPMetricExporter)   (when OTLP is on)
                  └─▶ extra readers (tests: InMemoryMetricReader)
    TracerProvider ─▶ BatchSpanProcessor(OTLPSpanExporter)                 (when OTLP is on)
                   └▶ SimpleSpanProcessor(each extra exporter)              (tests: InMemorySpanExporter)

OTLP is on when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or its ``_TRACES_`` / ``_METRICS_`` variant) is
set: the ``OTEL_*`` variables belong to the OpenTelemetry contract, and the OTLP exporters read
endpoint, headers and TLS options from them themselves. The transport is
``OTEL_EXPORTER_OTLP_PROTOCOL`` (or its per-signal variant): ``grpc`` (the default, port 4317) or
``http/protobuf`` (port 4318), as the specification names them (:func:`otlp_protocol`). Pass
``otlp=True/False`` to decide explicitly instead.

Stopping never waits on a collector for long: :meth:`Telemetry.shutdown` gives the last export
``SHUTDOWN_WAIT_S`` and then lets it go (a daemon thread), so a process whose collector is down
still stops at once.

Processes instrument through the returned :class:`Telemetry` handle (``meter()``, ``tracer()``),
never through the global providers, so that tests can build several independent stacks in one
process. ``set_global=True`` (what the server processes do) additionally installs the providers as
the OpenTelemetry globals -- the only module-level mutable state the house rules allow.

Context propagation across gRPC hops uses W3C ``traceparent`` / ``tracestate`` in the call
metadata: :func:`extract_context` on the server side, :func:`inject_metadata` on the client side.

The attribute names (``ATTR_*``) and histogram bucket boundaries (``*_BUCKETS``) both processes
record with are defined here, once: the GenAI semantic conventions' (``gen_ai.*``, ``error.type``)
and kvroute's own ``kvroute.request_id``. :func:`start_server_span` and :func:`set_span_error` are
the span steps both servers take.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvroute.tls import ServerTlsFiles

log = logging.getLogger(__name__)

OTLP_ENDPOINT_VARIABLES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
)
OTLP_PROTOCOLS = ("grpc", "http/protobuf")  # the specification's names; http/json has no Python exporter
SHUTDOWN_WAIT_S = 0.5  # what stopping gives the last export to a collector (one on the node answers in ms)

Metadata = Sequence[tuple[str, str | bytes]]

# Span and metric attributes: the GenAI semantic conventions' names, and kvroute's request id and
# replica id (the replica a router metric is about, or the replica that exports a replica metric:
# Prometheus label ``kvroute_replica_id`` on both sides, so one dashboard variable selects both).
ATTR_REQUEST_ID = "kvroute.request_id"
ATTR_REPLICA = "kvroute.replica_id"
ATTR_OPERATION = "gen_ai.operation.name"
ATTR_MODEL = "gen_ai.request.model"
ATTR_TOKEN_TYPE = "gen_ai.token.type"
ATTR_INPUT_TOKENS = "gen_ai.usage.input_tokens"
ATTR_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ATTR_CACHED_TOKENS = "gen_ai.usage.cache_read.input_tokens"
ATTR_FINISH_REASONS = "gen_ai.response.finish_reasons"
ATTR_ERROR_TYPE = "error.type"
# Which part measured a latency point ("router": what a client sees; "replica"): a data-point
# attribute, so it survives every path to Prometheus (scrape, OTLP receiver, collector), unlike
# the scope name.
ATTR_COMPONENT = "kvroute.component"

# GenAI semantic conventions, "gen-ai-metrics": ExplicitBucketBoundaries of each histogram.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TOKEN_USAGE_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)


@dataclass
class Telemetry:
    """The providers of one process and what serves them.

    ``metrics_port`` is the bound Prometheus port (``None`` when the endpoint is off); ``registry``
    is the prometheus_client registry the endpoint serves (also usable with
    ``prometheus_client.generate_latest`` in tests).
    """

    service_name: str
    meter_provider: MeterProvider
    tracer_provider: TracerProvider
    registry: Any = None  # prometheus_client.CollectorRegistry | None
    metrics_port: int | None = None
    otlp: bool = False
    tracing: bool = False  # some span processor exports: OTLP or an extra exporter
    _http_server: Any = field(default=None, repr=False)

    def meter(self, name: str) -> metrics.Meter:
        return self.meter_provider.get_meter(name)

    def tracer(self, name: str) -> trace.Tracer:
        return self.tracer_provider.get_tracer(name)

    def prometheus_text(self) -> str:
        """What the Prometheus endpoint would serve now (empty when it is off)."""
        if self.registry is None:
            return ""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def shutdown(self, wait_s: float = SHUTDOWN_WAIT_S) -> None:
        """Stop the HTTP endpoint, flush and stop the exporters (idempotent). The flush gets
        ``wait_s`` seconds: past that it goes on in a daemon thread and is given up with the
        process (an unreachable collector would otherwise hold the stop for its export timeout)."""
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None

        def flush() -> None:
            self.tracer_provider.shutdown()
            self.meter_provider.shutdown()

        thread = threading.Thread(target=flush, name=f"{self.service_name} telemetry shutdown", daemon=True)
        thread.start()
        thread.join(wait_s)
        if thread.is_alive():
            log.warning("telemetry: the last export did not finish within %.1f s (collector unreachable?);"
                        " given up", wait_s)


def otlp_protocol(signal: str, env: Mapping[str, str] | None = None) -> str:
    """The OTLP transport of ``signal`` (``traces`` or ``metrics``):
    ``OTEL_EXPORTER_OTLP_<SIGNAL>_PROTOCOL``, else ``OTEL_EXPORTER_OTLP_PROTOCOL``, else ``grpc``.

    Raises:
        ValueError: a value other than ``grpc`` or ``http/protobuf`` (the message names the variable).
    """
    env = os.environ if env is None else env
    for name in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = env.get(name, "").strip()
        if value:
            if value not in OTLP_PROTOCOLS:
                raise ValueError(f"{name}: {value!r} is not supported (use {' or '.join(OTLP_PROTOCOLS)})")
            return value
    return "grpc"


def _otlp_exporters() -> tuple[Any, Any]:
    """(span exporter, metric exporter) for each signal's :func:`otlp_protocol`."""
    if otlp_protocol("traces") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    if otlp_protocol("metrics") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    return OTLPSpanExporter(), OTLPMetricExporter()


def otlp_configured(env: Mapping[str, str] | None = None) -> bool:
    """True when an ``OTEL_EXPORTER_OTLP_*ENDPOINT`` variable is set (the OpenTelemetry convention)."""
    env = os.environ if env is None else env
    return any(env.get(v) for v in OTLP_ENDPOINT_VARIABLES)


def setup_telemetry(
    service_name: str,
    metrics_port: int | None = None,
    *,
    metrics_host: str = "127.0.0.1",
    metrics_tls: ServerTlsFiles | None = None,
    otlp: bool | None = None,
    span_exporters: Iterable[SpanExporter] = (),
    metric_readers: Iterable[MetricReader] = (),
    resource_attributes: Mapping[str, str] | None = None,
    set_global: bool = False,
) -> Telemetry:
    """Build the MeterProvider and TracerProvider of a process.

    Args:
        service_name: the ``service.name`` resource attribute (``kvroute-replica``, ``kvroute-router``).
        metrics_port: serve Prometheus text on this port (0 = a free one, read back from
            ``Telemetry.metrics_port``); ``None`` or negative = no endpoint.
        metrics_host: the endpoint's listen address (``0.0.0.0`` = every interface).
        metrics_tls: serve the endpoint over https with these files (kvroute.tls.server_tls_files;
            a client CA = scrapers must present a certificate of it); None = plain HTTP.
        otlp: export metrics and traces with OTLP (over :func:`otlp_protocol`'s transport);
            ``None`` = when ``otlp_configured()``.
        span_exporters: extra span exporters, each behind a ``SimpleSpanProcessor`` (tests).
        metric_readers: extra metric readers (tests pass an ``InMemoryMetricReader``).
        resource_attributes: more resource attributes (``service.instance.id``, ...).
        set_global: also install the providers as the OpenTelemetry globals.

    Raises:
        OSError: ``metrics_port`` cannot be bound.
        ValueError: an unsupported ``OTEL_EXPORTER_OTLP_*PROTOCOL`` with OTLP on.
    """
    resource = Resource.create({SERVICE_NAME: service_name, **(resource_attributes or {})})
    otlp = otlp_configured() if otlp is None else otlp
    readers: list[MetricReader] = list(metric_readers)
    registry = None
    http_server = None
    bound_port = None
    if metrics_port is not None and metrics_port >= 0:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.process_collector import ProcessCollector

        # A registry of our own rather than prometheus_client's global one: two stacks in one
        # process (tests) must not collide on collector registration.
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        readers.append(PrometheusMetricReader(registry=registry))
        tls = {} if metrics_tls is None else {
            "certfile": metrics_tls.cert_file, "keyfile": metrics_tls.key_file,
            "client_cafile": metrics_tls.client_ca_file or None, "client_auth_required": bool(metrics_tls.client_ca_file)}
        http_server, _thread = start_http_server(metrics_port, addr=metrics_host, registry=registry, **tls)
        bound_port = http_server.server_port
    # No exit hook of the SDK's own: Telemetry.shutdown bounds the last export, an atexit one would not.
    tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    if otlp:
        span_exporter, metric_exporter = _otlp_exporters()
        readers.append(PeriodicExportingMetricReader(metric_exporter))
        tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    span_exporters = list(span_exporters)
    for exporter in span_exporters:
        tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    meter_provider = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)
    if set_global:
        metrics.set_meter_provider(meter_provider)
        trace.set_tracer_provider(tracer_provider)
    log.info(
        "telemetry: service %s, prometheus %s, otlp %s",
        service_name, f":{bound_port}" if bound_port is not None else "off",
        f"on (traces {otlp_protocol('traces')}, metrics {otlp_protocol('metrics')})" if otlp else "off",
    )
    return Telemetry(
        service_name, meter_provider, tracer_provider, registry, bound_port, otlp, otlp or bool(span_exporters),
        http_server,
    )


def extract_context(metadata: Metadata | None) -> otel_context.Context:
    """The trace context a caller sent in gRPC metadata (W3C ``traceparent``), or an empty one.

    ``metadata`` is what ``ServicerContext.invocation_metadata()`` returns.
    """
    carrier: dict[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, bytes):  # binary ("-bin") headers carry no trace context
            continue
        carrier[key.lower()] = value
    return propagate.extract(carrier)


def inject_metadata(metadata: Sequence[tuple[str, str]] = (), ctx: otel_context.Context | None = None) -> list[tuple[str, str]]:
    """``metadata`` plus the W3C trace headers of ``ctx`` (default: the current context)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return [*metadata, *carrier.items()]


def call_context(context: Any) -> otel_context.Context:
    """The trace context a request path continues: the span an in-process front opened for the
    call (``context.trace_context``, set by the HTTP front), else what the caller sent in the gRPC
    metadata (:func:`extract_context`)."""
    local = getattr(context, "trace_context", None)
    return local if local is not None else extract_context(context.invocation_metadata())


def start_server_span(
    tracer: trace.Tracer, name: str, parent: otel_context.Context | None, attributes: Mapping[str, Any]
) -> trace.Span:
    """Open the SERVER span of one call ``name`` (e.g. ``kvroute.v1.ReplicaService/GenerateStream``),
    continuing ``parent`` (what :func:`call_context` returned; None = a new trace). Under a span of
    this process (the HTTP front's SERVER span) it is an INTERNAL span instead, without the
    ``rpc.*`` attributes: the call did not come over gRPC."""
    attributes = dict(attributes)
    kind = SpanKind.SERVER
    local = trace.get_current_span(parent).get_span_context() if parent is not None else None
    if local is not None and local.is_valid and not local.is_remote:
        kind = SpanKind.INTERNAL
        attributes = {k: v for k, v in attributes.items() if not k.startswith("rpc.")}
    return tracer.start_span(name, context=parent, kind=kind, attributes=attributes)


def start_http_span(tracer: trace.Tracer, method: str, route: str, scheme: str, headers: Mapping[str, str],
                    client_address: str = "") -> trace.Span:
    """The SERVER span of one HTTP request, as OpenTelemetry's HTTP semantic conventions name and
    attribute it: ``"{method} {route}"``, ``http.request.method``, ``http.route``, ``url.path``,
    ``url.scheme``, ``user_agent.original``, ``client.address``; continuing the W3C trace context
    of the request headers. End it with :func:`end_http_span`."""
    carrier = {k.lower(): v for k, v in headers.items()}
    attributes: dict[str, Any] = {"http.request.method": method, "http.route": route, "url.path": route,
                                  "url.scheme": scheme}
    if "user-agent" in carrier:
        attributes["user_agent.original"] = carrier["user-agent"]
    if client_address:
        attributes["client.address"] = client_address
    return tracer.start_span(f"{method} {route}", context=propagate.extract(carrier), kind=SpanKind.SERVER,
                             attributes=attributes)


def end_http_span(span: trace.Span, status: int) -> None:
    """End an HTTP SERVER span with ``http.response.status_code``. Per the conventions a 5xx is an
    error (``error.type`` the status code, span status ERROR); a 4xx is the client's and leaves the
    status unset."""
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_attribute(ATTR_ERROR_TYPE, str(status))
        span.set_status(Status(StatusCode.ERROR, str(status)))
    span.end()


def set_span_error(span: trace.Span, error: tuple[str, str]) -> None:
    """Mark ``span`` failed: ``error.type`` = the code name, status ERROR ``"CODE: message"``;
    ``error`` is (gRPC status code name, message)."""
    span.set_attribute(ATTR_ERROR_TYPE, error[0])
    span.set_status(Status(StatusCode.ERROR, f"{error[0]}: {error[1]}"))


__all__ = [
    "ATTR_CACHED_TOKENS",
    "ATTR_COMPONENT",
    "ATTR_ERROR_TYPE",
    "ATTR_FINISH_REASONS",
    "ATTR_INPUT_TOKENS",
    "ATTR_MODEL",
    "ATTR_OPERATION",
    "ATTR_OUTPUT_TOKENS",
    "ATTR_REPLICA",
    "ATTR_REQUEST_ID",
    "ATTR_TOKEN_TYPE",
    "REQUEST_DURATION_BUCKETS",
    "TOKEN_USAGE_BUCKETS",
    "TPOT_BUCKETS",
    "TTFT_BUCKETS",
    "Telemetry",
    "call_context",
    "end_http_span",
    "extract_context",
    "inject_metadata",
    "otlp_configured",
    "otlp_protocol",
    "set_span_error",
    "setup_telemetry",
    "start_http_span",
    "start_server_span",
]
