"""OTLP export as the OpenTelemetry variables say (kvroute.telemetry): ``OTEL_EXPORTER_OTLP_PROTOCOL``
and its per-signal variants pick gRPC or HTTP/protobuf, checked against a real receiver of both
(tests.support_otlp); an unsupported value is refused naming the variable; a collector that
accepts connections and never answers does not hold the process's stop."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvroute.telemetry import SHUTDOWN_WAIT_S, otlp_protocol, setup_telemetry
from tests.support import wait_for
from tests.support_otlp import OtlpReceiver

VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
             "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
             "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")


@pytest.fixture
def env(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def receiver():
    with OtlpReceiver() as r:
        yield r


def export_one_of_each(name: str) -> None:
    telemetry = setup_telemetry(f"kvroute-{name}", otlp=True)
    telemetry.meter("kvroute.test").create_counter(f"kvroute_{name}_requests").add(1)
    with telemetry.tracer("kvroute.test").start_as_current_span(f"{name}-span"):
        pass
    telemetry.shutdown(wait_s=10.0)  # flushes both signals


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_both_signals_go_over_the_protocol_the_variable_names(env, receiver, protocol):
    env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint)
    export_one_of_each("both")
    other = "http/protobuf" if protocol == "grpc" else "grpc"
    assert receiver.spans[protocol] == ["both-span"] and "kvroute_both_requests" in receiver.metrics[protocol]
    assert receiver.spans[other] == [] and receiver.metrics[other] == []


def test_a_signals_own_variable_wins_over_the_general_one(env, receiver):
    env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.grpc_endpoint)
    env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"{receiver.http_endpoint}/v1/traces")
    export_one_of_each("split")
    assert receiver.spans == {"grpc": [], "http/protobuf": ["split-span"]}
    assert "kvroute_split_requests" in receiver.metrics["grpc"] and receiver.metrics["http/protobuf"] == []


def test_the_default_is_grpc_and_an_unsupported_protocol_is_an_error_naming_the_variable():
    assert otlp_protocol("traces", {}) == "grpc"
    assert otlp_protocol("metrics", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == "http/protobuf"
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_METRICS_PROTOCOL: 'http/json' is not supported"):
        otlp_protocol("metrics", {"OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/json"})


@pytest.mark.parametrize("main", ["router", "replica"])
def test_a_server_with_an_unsupported_protocol_exits_2_naming_the_variable(env, capsys, main):
    import replica.server
    import router.server

    env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    assert {"router": router.server, "replica": replica.server}[main].main([]) == 2
    assert "OTEL_EXPORTER_OTLP_PROTOCOL: 'http/json' is not supported" in capsys.readouterr().err


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_collector_that_never_answers_does_not_hold_the_stop(env, protocol):
    """The exporters' own timeout is 10 s per export: the stop gives the last one SHUTDOWN_WAIT_S."""
    silent = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.extend(silent.accept() for _ in range(8)), daemon=True).start()
    try:
        env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        telemetry = setup_telemetry("kvroute-silent", otlp=True)
        with telemetry.tracer("kvroute.test").start_as_current_span("never-delivered"):
            pass
        started = time.monotonic()
        telemetry.shutdown()
        # Bounded by the wait, not by the exporters' 10 s (a generous margin for a loaded machine).
        assert time.monotonic() - started < SHUTDOWN_WAIT_S + 4.0
        wait_for(lambda: accepted, what="the exporter connected to the silent collector", timeout=5)
    finally:
        silent.close()


@pytest.mark.parametrize(("sampler", "arg", "kept"), [
    ("parentbased_always_on", "", 20), ("always_off", "", 0), ("traceidratio", "0", 0), ("traceidratio", "1", 20),
])
def test_the_sampler_variables_take_effect(env, sampler, arg, kept):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    env.setenv("OTEL_TRACES_SAMPLER", sampler)
    if arg:
        env.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    else:
        env.delenv("OTEL_TRACES_SAMPLER_ARG", raising=False)
    spans = InMemorySpanExporter()
    telemetry = setup_telemetry("kvroute-sampled", otlp=False, span_exporters=[spans])
    for i in range(20):
        with telemetry.tracer("kvroute.test").start_as_current_span(f"request-{i}"):
            pass
    telemetry.shutdown()
    assert len(spans.get_finished_spans()) == kept
