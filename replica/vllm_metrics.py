"""The replica's numbers under vLLM's Prometheus names, next to our own (DESIGN.md §6), so that
pickers, harnesses and dashboards written for vLLM read a kvroute replica unchanged (the Gateway
API Inference Extension's model-server protocol reads the queue and KV-usage ones).

    vLLM name                              value (labels model_name, engine="0")
    vllm:num_requests_running              requests in the running batch
    vllm:num_requests_waiting              waiting requests, as GetLoad counts them (the scheduler's
                                           queue, or the calls not yet admitted, whichever is longer)
    vllm:kv_cache_usage_perc               KV usage, 0..1 (cached free blocks count as free, as vLLM's)
    vllm:prefix_cache_queries_total        prompt tokens looked up in the prefix cache (per admission)
    vllm:prefix_cache_hits_total           of those, tokens found cached
    vllm:num_preemptions_total             preemptions by recompute
    vllm:request_success_total             finished requests, label finished_reason: stop|length|abort
    vllm:prompt_tokens_total               prompt tokens of the requests that reached the engine's prefill
    vllm:generation_tokens_total           tokens generated

The first six are read at scrape time from the frontend's latest engine sample (the same numbers as
``kvroute_replica_*`` and ``GetLoad``); the last three are :class:`RequestTotals`, which the frontend
adds to as each call ends (vLLM adds per engine step: a scrape during a long request sees its tokens
later here). A custom prometheus_client collector, because OpenTelemetry instrument names cannot
contain ``:``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from replica.telemetry import CLIENT_GAVE_UP, EngineSample

FINISHED_REASONS = ("stop", "length", "abort")


@dataclass
class RequestTotals:
    """Cumulative per-request counts since the replica started. Written on the event loop, read by
    the scrape thread (int updates are atomic under the GIL; a scrape may see one call half added)."""

    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISHED_REASONS, 0))
    prompt_tokens: int = 0
    generation_tokens: int = 0

    def record(self, finish_reason: str | None, error_type: str | None, prompt_tokens: int,
               generation_tokens: int) -> None:
        """One call that ended with ``finish_reason`` (None: no final response) or the gRPC status
        name ``error_type``. A call its client gave up on (CANCELLED, DEADLINE_EXCEEDED) counts as
        ``abort``, as vLLM counts it; a refused or failed one counts no success. Its prompt counts
        once it produced a token or finished."""
        if finish_reason is None and error_type in CLIENT_GAVE_UP:
            finish_reason = "abort"
        if finish_reason in self.finished:
            self.finished[finish_reason] += 1
        if finish_reason is not None or generation_tokens:
            self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens


class MetricsSource(Protocol):
    """What the collector reads of a replica (``replica.frontend.ReplicaFrontend`` is one): declared
    here so that this module needs nothing of the frontend, which imports it for :class:`RequestTotals`."""

    @property
    def engine(self) -> object | None:
        """None: no engine yet (the engine's gauges are left out)."""

    @property
    def totals(self) -> RequestTotals: ...

    def latest_sample(self) -> EngineSample | None: ...

    def queued(self) -> int: ...


class VllmMetricsCollector(Collector):
    """The vLLM names of one replica's numbers (module docstring), for its Prometheus registry."""

    def __init__(self, frontend: MetricsSource, model_name: str) -> None:
        self._fe = frontend
        self._labels = [model_name, "0"]

    def collect(self) -> Iterator[Metric]:
        fe, labels = self._fe, self._labels
        names = ["model_name", "engine"]
        s = fe.latest_sample()
        if s is not None and fe.engine is not None:
            for name, doc, value in (
                ("vllm:num_requests_running", "Number of requests in model execution batches.", s.running),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", fe.queued()),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage),
            ):
                gauge = GaugeMetricFamily(name, doc, labels=names)
                gauge.add_metric(labels, value)
                yield gauge
            for name, doc, count in (
                ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                 s.prefix_cache_queries),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_cache_hits),
                ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.preemptions),
            ):
                counter = CounterMetricFamily(name, doc, labels=names)
                counter.add_metric(labels, count)
                yield counter
        totals = fe.totals
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*names, "finished_reason"])
        for reason in FINISHED_REASONS:
            success.add_metric([*labels, reason], totals.finished[reason])
        yield success
        for name, doc, count in (
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", totals.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.", totals.generation_tokens),
        ):
            counter = CounterMetricFamily(name, doc, labels=names)
            counter.add_metric(labels, count)
            yield counter


__all__ = ["FINISHED_REASONS", "MetricsSource", "RequestTotals", "VllmMetricsCollector"]
