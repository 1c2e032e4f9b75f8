"""router.telemetry: what one ended call records (hand-worked values, an in-memory reader)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvroute.telemetry import TPOT_BUCKETS, setup_telemetry
from router.telemetry import RouterMetrics


@pytest.fixture
def recorded():
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry("unit", None, otlp=False, metric_readers=[reader])
    metrics = RouterMetrics(telemetry.meter("kvroute.router"), model="m")

    def points(name: str) -> list:
        return [dp for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                for metric in sm.metrics if metric.name == name for dp in metric.data.data_points]

    yield metrics, points
    telemetry.shutdown()


def test_time_per_output_token_is_the_decode_time_over_the_tokens_after_the_first(recorded):
    metrics, points = recorded
    # 5 tokens: first at 0.2 s, last at 1.0 s -> 4 gaps of 0.2 s
    metrics.record_request(operation="text_completion", ttft_s=0.2, duration_s=1.0, prompt_tokens=10,
                           completion_tokens=5, error_type=None)
    (tpot,) = points("gen_ai.server.time_per_output_token")
    assert tpot.count == 1 and tpot.sum == pytest.approx(0.2)
    assert tuple(tpot.explicit_bounds) == TPOT_BUCKETS
    assert dict(tpot.attributes) == {"gen_ai.operation.name": "text_completion", "gen_ai.request.model": "m",
                                     "kvroute.component": "router"}


def test_no_time_per_output_token_for_one_token_or_a_failed_call(recorded):
    metrics, points = recorded
    metrics.record_request(operation="chat", ttft_s=0.1, duration_s=0.1, prompt_tokens=3, completion_tokens=1,
                           error_type=None)
    metrics.record_request(operation="chat", ttft_s=None, duration_s=0.3, prompt_tokens=None, completion_tokens=None,
                           error_type="UNAVAILABLE")
    assert points("gen_ai.server.time_per_output_token") == []
    assert sum(dp.count for dp in points("gen_ai.server.request.duration")) == 2
