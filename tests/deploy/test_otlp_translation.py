"""tests.support_otlp_prometheus's names against the OpenTelemetry specification's own examples
("Prometheus and OpenMetrics Compatibility", Metric Metadata), worked by hand, and a translated
histogram's buckets counted by hand, read back by prometheus_client's text parser."""

from __future__ import annotations

import pytest
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from prometheus_client.parser import text_string_to_metric_families

from tests.support_otlp_prometheus import label_name, metric_name, translate


@pytest.mark.parametrize(("name", "unit", "kind", "want"), [
    ("http.server.request.duration", "s", "histogram", "http_server_request_duration_seconds"),
    ("system.memory.usage", "By", "gauge", "system_memory_usage_bytes"),
    ("system.cpu.utilization", "1", "gauge", "system_cpu_utilization_ratio"),
    ("kvroute.replica.kv_cache.usage_ratio", "1", "gauge", "kvroute_replica_kv_cache_usage_ratio"),
    ("kvroute.router.prediction.ratio", "1", "histogram", "kvroute_router_prediction_ratio"),
    ("kvroute.router.decisions", "{decision}", "counter", "kvroute_router_decisions_total"),
    ("network.io", "By/s", "gauge", "network_io_bytes_per_second"),
    ("requests.total", "{request}", "counter", "requests_total"),
    ("kvroute.router.events.lag", "s", "gauge", "kvroute_router_events_lag_seconds"),
    ("latency_seconds", "s", "histogram", "latency_seconds"),
])
def test_metric_names(name, unit, kind, want):
    assert metric_name(name, unit, kind) == want


def test_label_names():
    assert label_name("kvroute.replica_id") == "kvroute_replica_id"
    assert label_name("error.type") == "error_type"
    assert label_name("2xx") == "key_2xx"


def _attr(key: str, value: str) -> common_pb2.KeyValue:
    return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(string_value=value))


def test_a_histogram_and_a_counter_as_prometheus_scrapes_them():
    point = metrics_pb2.HistogramDataPoint(count=6, sum=1.5, explicit_bounds=[0.1, 1.0], bucket_counts=[2, 3, 1],
                                           attributes=[_attr("kvroute.component", "router")])
    counter = metrics_pb2.NumberDataPoint(as_int=7)
    rm = metrics_pb2.ResourceMetrics(
        resource=resource_pb2.Resource(attributes=[_attr("service.name", "kvroute-router"),
                                                   _attr("k8s.namespace.name", "ns")]),
        scope_metrics=[metrics_pb2.ScopeMetrics(metrics=[
            metrics_pb2.Metric(name="gen_ai.server.request.duration", unit="s",
                               histogram=metrics_pb2.Histogram(data_points=[point], aggregation_temporality=2)),
            metrics_pb2.Metric(name="kvroute.router.retries", unit="{retry}",
                               sum=metrics_pb2.Sum(data_points=[counter], is_monotonic=True, aggregation_temporality=2)),
        ])])
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(translate([rm])) for s in family.samples}
    common = (("job", "kvroute-router"), ("kvroute_component", "router"), ("namespace", "ns"))

    def bucket(le: str) -> tuple:
        return "gen_ai_server_request_duration_seconds_bucket", tuple(sorted((*common, ("le", le))))

    assert samples[bucket("0.1")] == 2 and samples[bucket("1.0")] == 5 and samples[bucket("+Inf")] == 6
    assert samples[("gen_ai_server_request_duration_seconds_count", common)] == 6
    assert samples[("gen_ai_server_request_duration_seconds_sum", common)] == 1.5
    assert samples[("kvroute_router_retries_total", (("job", "kvroute-router"), ("namespace", "ns")))] == 7
