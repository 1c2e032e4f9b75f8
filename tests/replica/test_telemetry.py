"""The replica's metrics (Prometheus endpoint) and spans after a known workload (DESIGN.md §6).

Workload: the same prompt of 3 full blocks + 5 tokens (53 tokens), twice, 4 output tokens each.
The first is a miss; the second hits the 3 full blocks (48 tokens; the partial block is never
looked up). So prefix cache queries = 106 tokens, hits = 48.
"""

from __future__ import annotations

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kvroute.telemetry import extract_context, inject_metadata, setup_telemetry
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import replica_pb2 as rep_pb
from kvroute.v1 import replica_pb2_grpc as rep_grpc
from replica.server import BackgroundReplica
from replica.settings import ReplicaSettings
from replica.telemetry import REQUEST_DURATION_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
from tests.support import scrape_metrics, wait_for

BLOCK = 16
PROMPT = [(11 * i + 5) % 500 for i in range(3 * BLOCK + 5)]
TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_SPAN_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_SPAN_ID:016x}-01"
METHOD = "kvroute.v1.ReplicaService/GenerateStream"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    spans = InMemorySpanExporter()
    telemetry = setup_telemetry("kvroute-replica-test", metrics_port=0, metrics_host="127.0.0.1", otlp=False,
                                span_exporters=[spans])
    settings = ReplicaSettings(
        host="127.0.0.1", port=0, model_cache_dir=str(tmp_path_factory.mktemp("models")), num_blocks=128,
        torch_threads=1, max_num_seqs=4, replica_id="telemetry-replica",
        engine_process=True,  # pins the phase spans on admissions reported by the engine process
    )
    with BackgroundReplica(settings, telemetry=telemetry) as replica:
        channel = grpc.insecure_channel(replica.target)
        stub = rep_grpc.ReplicaServiceStub(channel)
        sampling = gen_pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        first = list(stub.GenerateStream(rep_pb.ReplicaGenerateRequest(request_id="m-1", token_ids=PROMPT,
                                                                      sampling=sampling)))
        second = list(stub.GenerateStream(
            rep_pb.ReplicaGenerateRequest(request_id="m-2", token_ids=PROMPT, sampling=sampling),
            metadata=[("traceparent", TRACEPARENT)],
        ))
        wait_for(lambda: rep_load_idle(stub))
        yield {"telemetry": telemetry, "spans": spans, "replica": replica, "stub": stub,
               "responses": (first, second)}
        channel.close()
    telemetry.shutdown()


def rep_load_idle(stub) -> bool:
    load = stub.GetLoad(rep_pb.GetLoadRequest())
    return load.running == 0 and load.waiting == 0 and load.kv_usage == 0.0


def scrape(port: int) -> dict[str, list]:
    """Prometheus text from the HTTP endpoint -> {sample name: [(labels, value), ...]}."""
    return scrape_metrics(f"http://127.0.0.1:{port}/metrics")


def total(samples: dict[str, list], name: str, **labels: str | None) -> float:
    """Sum of the samples of ``name`` whose labels match (a label given as None must be absent)."""
    assert name in samples, f"{name} not exported; have {sorted(samples)}"
    return sum(v for lab, v in samples[name] if all(lab.get(k) == x for k, x in labels.items()))


def test_workload_usage_is_reported_to_the_client(stack):
    first, second = stack["responses"]
    assert first[-1].usage.cached_tokens == 0
    assert second[-1].usage.cached_tokens == 3 * BLOCK
    assert second[-1].usage.prompt_tokens == len(PROMPT) == 53


def test_prometheus_endpoint_shows_the_design_names_with_the_workload_values(stack):
    m = scrape(stack["telemetry"].metrics_port)
    assert total(m, "kvroute_replica_prefix_cache_queries_total") == 106
    assert total(m, "kvroute_replica_prefix_cache_hits_total") == 48
    assert total(m, "kvroute_replica_prompt_tokens_total") == 106
    assert total(m, "kvroute_replica_generation_tokens_total") == 8
    assert total(m, "kvroute_replica_requests_finished_total", finish_reason="length") == 2
    assert total(m, "kvroute_replica_preemptions_total") == 0
    assert total(m, "kvroute_replica_kv_cache_usage_ratio") == 0.0
    assert total(m, "kvroute_replica_requests_running") == 0
    assert total(m, "kvroute_replica_requests_waiting") == 0
    for name in ("gen_ai_server_time_to_first_token_seconds", "gen_ai_server_time_per_output_token_seconds",
                 "gen_ai_server_request_duration_seconds"):
        assert total(m, f"{name}_count", gen_ai_request_model="kvroute-tiny-llama", error_type=None) == 2, name


def test_a_replica_without_redis_exports_no_event_counters(stack):
    m = scrape(stack["telemetry"].metrics_port)
    assert not [name for name in m if name.startswith("kvroute_replica_events_")]


def test_genai_histograms_use_the_semantic_convention_buckets(stack):
    m = scrape(stack["telemetry"].metrics_port)
    for name, buckets in (("gen_ai_server_time_to_first_token_seconds", TTFT_BUCKETS),
                          ("gen_ai_server_time_per_output_token_seconds", TPOT_BUCKETS),
                          ("gen_ai_server_request_duration_seconds", REQUEST_DURATION_BUCKETS)):
        bounds = [float(lab["le"]) for lab, _ in m[f"{name}_bucket"] if lab["le"] != "+Inf"]
        assert bounds == list(buckets), name
    assert TTFT_BUCKETS[:3] == (0.001, 0.005, 0.01) and REQUEST_DURATION_BUCKETS[-1] == 81.92


def _server_span(spans, request_id):
    found = [s for s in spans.get_finished_spans()
             if s.kind == SpanKind.SERVER and s.attributes.get("kvroute.request_id") == request_id]
    return found[0] if found else None


def test_server_spans_carry_request_id_and_token_counts(stack):
    spans = stack["spans"]
    for rid, cached in (("m-1", 0), ("m-2", 48)):
        span = wait_for(lambda rid=rid: _server_span(spans, rid))
        assert span.name == METHOD
        assert span.attributes["gen_ai.usage.input_tokens"] == 53
        assert span.attributes["gen_ai.usage.output_tokens"] == 4
        assert span.attributes["gen_ai.usage.cache_read.input_tokens"] == cached
        assert span.attributes["rpc.system"] == "grpc"
        assert span.status.status_code != StatusCode.ERROR


def test_phase_spans_are_children_in_order_queue_prefill_decode(stack):
    spans = stack["spans"]
    server = wait_for(lambda: _server_span(spans, "m-2"))
    children = {s.name: s for s in spans.get_finished_spans()
                if s.parent is not None and s.parent.span_id == server.context.span_id}
    assert set(children) == {"queue", "prefill", "decode"}
    q, p, d = children["queue"], children["prefill"], children["decode"]
    assert server.start_time <= q.start_time <= q.end_time <= p.start_time <= p.end_time <= d.start_time
    assert d.end_time <= server.end_time
    assert all(s.attributes["kvroute.request_id"] == "m-2" for s in (q, p, d))
    assert p.attributes["gen_ai.usage.cache_read.input_tokens"] == 48
    assert d.attributes["gen_ai.usage.output_tokens"] == 4


def test_server_span_continues_the_callers_w3c_trace(stack):
    server = wait_for(lambda: _server_span(stack["spans"], "m-2"))
    assert server.context.trace_id == TRACE_ID
    assert server.parent.span_id == PARENT_SPAN_ID
    untraced = wait_for(lambda: _server_span(stack["spans"], "m-1"))
    assert untraced.context.trace_id != TRACE_ID and untraced.parent is None


def test_refused_call_span_has_error_status_and_type(stack):
    with pytest.raises(grpc.RpcError):
        stack["stub"].Generate(rep_pb.ReplicaGenerateRequest(token_ids=[], request_id="bad-1"))

    def refused():
        return [s for s in stack["spans"].get_finished_spans()
                if s.name == "kvroute.v1.ReplicaService/Generate" and s.status.status_code == StatusCode.ERROR]

    (span,) = wait_for(refused)
    assert span.attributes["error.type"] == "INVALID_ARGUMENT"
    assert "prompt" in span.status.description
    m = scrape(stack["telemetry"].metrics_port)
    assert total(m, "gen_ai_server_request_duration_seconds_count", error_type="INVALID_ARGUMENT") == 1
    assert total(m, "kvroute_replica_requests_finished_total", finish_reason="error") == 1


def test_traceparent_helpers_round_trip():
    telemetry = setup_telemetry("roundtrip", None, otlp=False, span_exporters=[InMemorySpanExporter()])
    try:
        with telemetry.tracer("t").start_as_current_span("client") as span:
            md = inject_metadata([("x-other", "1")])
        assert md[0] == ("x-other", "1") and any(k == "traceparent" for k, _ in md)
        ctx = extract_context(md)
        from opentelemetry import trace

        assert trace.get_current_span(ctx).get_span_context().trace_id == span.get_span_context().trace_id
    finally:
        telemetry.shutdown()


def test_replica_metrics_read_the_latest_engine_sample_and_count_cancels_as_abort():
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from kvroute.telemetry import otlp_configured
    from replica.telemetry import EngineSample, ReplicaMetrics

    reader = InMemoryMetricReader()
    telemetry = setup_telemetry("unit", None, otlp=False, metric_readers=[reader])
    try:
        sample = EngineSample(running=3, waiting=2, kv_usage=0.25, prefix_cache_queries=106, prefix_cache_hits=48,
                              preemptions=1)
        metrics = ReplicaMetrics(telemetry.meter("kvroute.replica"), model="m", replica_id="r-7", sample=lambda: sample)
        metrics.record_request(operation="text_completion", prompt_tokens=10, completion_tokens=0, ttft_s=None,
                               duration_s=0.5, finish_reason=None, error_type="CANCELLED")
        points = {}
        for rm in reader.get_metrics_data().resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    for dp in metric.data.data_points:
                        points[(metric.name, tuple(sorted(dp.attributes.items())))] = dp
        values = {name: dp for (name, _), dp in points.items()}
        assert values["kvroute.replica.prefix_cache.queries"].value == 106
        assert values["kvroute.replica.prefix_cache.hits"].value == 48
        assert values["kvroute.replica.kv_cache.usage_ratio"].value == 0.25
        assert (values["kvroute.replica.requests.running"].value, values["kvroute.replica.requests.waiting"].value) == (3, 2)
        assert values["kvroute.replica.preemptions"].value == 1
        assert "kvroute.replica.events.published" not in values  # no publisher: nothing observed
        (finished,) = [k for k in points if k[0] == "kvroute.replica.requests.finished"]
        assert ("finish_reason", "abort") in finished[1]
        assert "gen_ai.server.time_to_first_token" not in values  # successful responses only
        assert {dict(attrs).get("kvroute.replica_id") for _, attrs in points} == {"r-7"}  # on every point
        assert values["gen_ai.server.request.duration"].count == 1
    finally:
        telemetry.shutdown()
    assert otlp_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"})
    assert not otlp_configured({})
