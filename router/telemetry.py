"""The router's metrics and spans (DESIGN.md §6), on top of the providers of ``kvroute.telemetry``.

Metrics. Per-request numbers are recorded by the proxy when a call ends; the consumer's and the
registry's numbers are read by *observable* instruments at collection time (the consumer's
counters are plain ints it owns; reading them from the exporter's thread is safe).

OpenTelemetry name -> Prometheus name (as the Prometheus exporter writes them) -> vLLM equivalent:

=============================================  ========================================================  ==================================
``kvroute.router.decisions``                   ``kvroute_router_decisions_total`` {``kvroute.replica_id``,  (none: vLLM does not route)
                                               ``kvroute.policy``, ``kvroute.outcome`` = routed |
                                               no_replica}; a retry is one more decision
``kvroute.router.decision.duration``           ``kvroute_router_decision_duration_seconds``              (none)
                                               {``kvroute.stage`` = hash | lookup | score | total}
``kvroute.router.retries``                     ``kvroute_router_retries_total``                          (none)
``kvroute.router.index.entries``               ``kvroute_router_index_entries`` {``kvroute.replica_id``}  (none)
``kvroute.router.events.applied``              ``kvroute_router_events_applied_total``                   (none: vLLM only publishes)
``kvroute.router.events.blocks``               ``kvroute_router_events_blocks_total``                    (none)
``kvroute.router.events.lag``                  ``kvroute_router_events_lag_seconds``                     (none)
``kvroute.router.events.seq_gaps``             ``kvroute_router_events_seq_gaps_total``                  (none)
``kvroute.router.events.resyncs``              ``kvroute_router_events_resyncs_total``                   (none)
``kvroute.router.events.snapshot_requests``    ``kvroute_router_events_snapshot_requests_total``         (none)
``kvroute.router.events.epoch_changes``        ``kvroute_router_events_epoch_changes_total``             (none)
``kvroute.router.events.rejected``             ``kvroute_router_events_rejected_total`` {``kvroute.reason``}  (none)
                                               (router.consumer_feed.REJECT_REASONS: hostile input)
``kvroute.router.replicas`` {``kvroute.state``}  ``kvroute_router_replicas``                             (none)
``kvroute.router.replicas.address_changes``    ``kvroute_router_replicas_address_changes_total``         (none)
``kvroute.router.picker.streams``              ``kvroute_router_picker_streams`` (ext_proc streams open)  (none)
``kvroute.router.picker.streams.limit``        ``kvroute_router_picker_streams_limit`` (picker_streams)  (none)
``kvroute.router.prediction.ratio``            ``kvroute_router_prediction_ratio`` (actual/predicted)    (none)
``kvroute.router.prediction.over``             ``kvroute_router_prediction_over_total``                  (none)
``kvroute.router.prediction.predicted_tokens`` ``kvroute_router_prediction_predicted_tokens_total``      (none)
``kvroute.router.prediction.cached_tokens``    ``kvroute_router_prediction_cached_tokens_total``         ``vllm:prefix_cache_hits`` (reported)
``gen_ai.server.time_to_first_token``          ``gen_ai_server_time_to_first_token_seconds``             ``vllm:time_to_first_token_seconds``
``gen_ai.server.time_per_output_token``        ``gen_ai_server_time_per_output_token_seconds``           ``vllm:time_per_output_token_seconds``
``gen_ai.server.request.duration``             ``gen_ai_server_request_duration_seconds``                ``vllm:e2e_request_latency_seconds``
``gen_ai.client.token.usage``                  ``gen_ai_client_token_usage`` {``gen_ai.token.type``}     ``vllm:prompt_tokens``,
                                                                                                         ``vllm:generation_tokens``
=============================================  ========================================================  ==================================

Prediction accuracy: at the end of each call the router compares the cached tokens it predicted
for the chosen replica with the ``usage.cached_tokens`` the replica reports. ``ratio`` is recorded
when something was predicted; ``over`` counts calls where the replica hit less than predicted (a
stale or speculative index entry); the two token counters give the aggregate ratio
(``sum(cached) / sum(predicted)``).

The ``gen_ai.*`` histograms are measured at the router (arrival -> first delta, arrival -> end, and
the time per output token between them),
with the GenAI semantic conventions' buckets and attributes (``gen_ai.operation.name``,
``gen_ai.request.model``, ``error.type`` on failures), and ``kvroute.component`` = ``router`` (the
replicas' carry ``replica``).

Spans. One SERVER span per call (``kvroute.v1.GenerationService/GenerateStream``, ...) continuing
the caller's W3C context, with one CLIENT span per upstream attempt
(``kvroute.v1.ReplicaService/GenerateStream``) whose context goes to the replica in the call
metadata, so the replica's server span is its child.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import SpanKind

from kvroute.telemetry import (
    ATTR_CACHED_TOKENS,
    ATTR_COMPONENT,
    ATTR_ERROR_TYPE,
    ATTR_INPUT_TOKENS,
    ATTR_MODEL,
    ATTR_OPERATION,
    ATTR_OUTPUT_TOKENS,
    ATTR_REPLICA,
    ATTR_REQUEST_ID,
    ATTR_TOKEN_TYPE,
    REQUEST_DURATION_BUCKETS,
    TOKEN_USAGE_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    set_span_error,
    start_server_span,
)

# Decision overhead: tens of microseconds to a few milliseconds.
OVERHEAD_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
RATIO_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0, 1.01, 1.1, 1.5, 2.0, 4.0)

ATTR_POLICY = "kvroute.policy"
ATTR_OUTCOME = "kvroute.outcome"
ATTR_STAGE = "kvroute.stage"
ATTR_REASON = "kvroute.reason"
ATTR_PREDICTED = "kvroute.predicted_cached_tokens"
ATTR_ATTEMPTS = "kvroute.attempts"
STAGES = ("hash", "lookup", "score", "total")


class RouterMetrics:
    """Creates the router's instruments on ``meter`` (names in the module docstring).

    ``consumer`` (an EventConsumer) and ``registry`` (a ReplicaRegistry) feed the observable
    instruments; either may be None (then those report nothing), as the picker's gauges do until
    :meth:`observe_picker`.
    """

    def __init__(self, meter: metrics.Meter, *, model: str = "", consumer: Any = None, registry: Any = None) -> None:
        self.model = model
        self._consumer = consumer
        self._registry = registry
        self._picker: Any = None  # an EndpointPicker once observe_picker() is called
        self.decisions = meter.create_counter(
            "kvroute.router.decisions", unit="{decision}",
            description="Routing decisions of the proxy by chosen replica, policy and outcome (routed,"
            " no_replica); a retry on another replica is one more decision",
        )
        self.overhead = meter.create_histogram(
            "kvroute.router.decision.duration", unit="s", explicit_bucket_boundaries_advisory=OVERHEAD_BUCKETS,
            description="Routing decision time by stage: hash (prompt hash chain), lookup (index), score, total",
        )
        self.retries = meter.create_counter(
            "kvroute.router.retries", unit="{retry}",
            description="Upstream attempts that failed before the first token and were retried elsewhere",
        )
        self.prediction_ratio = meter.create_histogram(
            "kvroute.router.prediction.ratio", unit="1", explicit_bucket_boundaries_advisory=RATIO_BUCKETS,
            description="Cached tokens the replica reported / cached tokens the router predicted (when > 0)",
        )
        self.prediction_over = meter.create_counter(
            "kvroute.router.prediction.over", unit="{request}",
            description="Requests whose replica hit fewer cached tokens than the router predicted",
        )
        self.predicted_tokens = meter.create_counter(
            "kvroute.router.prediction.predicted_tokens", unit="{token}",
            description="Cached prompt tokens the router predicted for the replicas it chose",
        )
        self.cached_tokens = meter.create_counter(
            "kvroute.router.prediction.cached_tokens", unit="{token}",
            description="Cached prompt tokens the chosen replicas reported (usage.cached_tokens)",
        )
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s", explicit_bucket_boundaries_advisory=TTFT_BUCKETS,
            description="Time from the request's arrival at the router to its first token, for successful responses",
        )
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s", explicit_bucket_boundaries_advisory=TPOT_BUCKETS,
            description="Time per output token after the first, at the router, for successful responses",
        )
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration", unit="s", explicit_bucket_boundaries_advisory=REQUEST_DURATION_BUCKETS,
            description="Time from the request's arrival at the router to its last token",
        )
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}", explicit_bucket_boundaries_advisory=TOKEN_USAGE_BUCKETS,
            description="Input and output tokens per request, as the replicas reported them",
        )

        def consumer_value(key: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
            def cb(_options: CallbackOptions) -> Iterable[Observation]:
                c = self._consumer
                return [] if c is None else [Observation(getattr(c, key))]

            return cb

        for name, key, unit, kind, desc in (
            ("events.applied", "events_applied", "{event}", "counter", "KV events applied to the index"),
            ("events.blocks", "blocks_applied", "{block}", "counter", "Block hashes in applied KV events"),
            ("events.lag", "stream_lag_seconds", "s", "gauge",
             "Wall clock minus the publish time of the last applied event batch"),
            ("events.seq_gaps", "gaps", "{gap}", "counter", "Sequence gaps found in a replica's event stream"),
            ("events.resyncs", "resyncs", "{resync}", "counter", "Index resyncs of a replica from its snapshot"),
            ("events.snapshot_requests", "snapshot_requests", "{request}", "counter",
             "Snapshot requests published to replicas"),
            ("events.epoch_changes", "epoch_changes", "{epoch}", "counter", "Replica restarts seen (new epochs)"),
        ):
            create = meter.create_observable_counter if kind == "counter" else meter.create_observable_gauge
            create(f"kvroute.router.{name}", [consumer_value(key)], unit=unit, description=desc)

        def rejected(_options: CallbackOptions) -> Iterable[Observation]:
            c = self._consumer
            if c is None:
                return []
            return [Observation(n, {ATTR_REASON: reason}) for reason, n in dict(c.rejected).items()]

        meter.create_observable_counter(
            "kvroute.router.events.rejected", [rejected], unit="{input}",
            description="Stream entries, events, snapshots and heartbeats the consumer rejected, by reason",
        )

        def index_entries(_options: CallbackOptions) -> Iterable[Observation]:
            c = self._consumer
            if c is None:
                return []
            return [Observation(n, {ATTR_REPLICA: rid}) for rid, n in c.entries().items()]

        meter.create_observable_gauge(
            "kvroute.router.index.entries", [index_entries], unit="{block}",
            description="Distinct block hashes indexed per replica (GPU and CPU tiers)",
        )

        def replicas(_options: CallbackOptions) -> Iterable[Observation]:
            r = self._registry
            if r is None:
                return []
            known = r.all()
            routable = sum(1 for i in known if i.routable)
            return [
                Observation(routable, {"kvroute.state": "routable"}),
                Observation(len(known) - routable, {"kvroute.state": "not_routable"}),
                Observation(r.num_incompatible, {"kvroute.state": "hash_incompatible"}),
            ]

        meter.create_observable_gauge(
            "kvroute.router.replicas", [replicas], unit="{replica}",
            description="Heartbeating replicas: routable, not routable, and with a refused hash triple",
        )

        def picker_streams(_options: CallbackOptions) -> Iterable[Observation]:
            p = self._picker
            return [] if p is None else [Observation(p.open_streams)]

        def picker_limit(_options: CallbackOptions) -> Iterable[Observation]:
            p = self._picker
            return [] if p is None or p.max_calls is None else [Observation(p.max_calls)]

        meter.create_observable_gauge(
            "kvroute.router.picker.streams", [picker_streams], unit="{stream}",
            description="ext_proc streams the endpoint picker serves now (one per HTTP call through the gateway)",
        )
        meter.create_observable_gauge(
            "kvroute.router.picker.streams.limit", [picker_limit], unit="{stream}",
            description="The endpoint picker's stream limit (picker_streams); the call past it gets HTTP 429",
        )

        def address_changes(_options: CallbackOptions) -> Iterable[Observation]:
            r = self._registry
            return [] if r is None else [Observation(r.address_changes)]

        meter.create_observable_counter(
            "kvroute.router.replicas.address_changes", [address_changes], unit="{change}",
            description="Heartbeats whose address differs from their replica id's previous one (a flip back"
            " and forth: two replicas share one id in one namespace)",
        )

    def observe_picker(self, picker: Any) -> None:
        """Report ``picker``'s open streams (``open_streams``) and limit (``max_calls``) from now on."""
        self._picker = picker

    def record_decision(self, decision: Any, outcome: str) -> None:
        """One decision of the proxy (not Score): its pick, outcome and stage timings."""
        replica = decision.picked.replica_id if decision.picked is not None else ""
        self.decisions.add(1, {ATTR_REPLICA: replica, ATTR_POLICY: decision.policy, ATTR_OUTCOME: outcome})
        for stage in STAGES:
            t = decision.timings.get(stage)
            if t is not None:
                self.overhead.record(t, {ATTR_STAGE: stage})

    def record_retry(self, replica_id: str, code: str) -> None:
        self.retries.add(1, {ATTR_REPLICA: replica_id, "rpc.grpc.status_code": code})

    def record_prediction(self, replica_id: str, predicted: int, actual: int) -> None:
        attrs = {ATTR_REPLICA: replica_id}
        self.predicted_tokens.add(predicted, attrs)
        self.cached_tokens.add(actual, attrs)
        if predicted > 0:
            self.prediction_ratio.record(actual / predicted, attrs)
        if actual < predicted:
            self.prediction_over.add(1, attrs)

    def record_request(
        self,
        *,
        operation: str,
        ttft_s: float | None,
        duration_s: float,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        error_type: str | None,
    ) -> None:
        """One ended call (refused ones too). TTFT and TPOT only for successful calls, as the spec
        says; TPOT = (duration - TTFT) / (completion tokens - 1), for calls with 2 tokens or more
        (the replica's definition, measured here from the router's clock)."""
        attrs = {ATTR_OPERATION: operation, ATTR_MODEL: self.model, ATTR_COMPONENT: "router"}
        if error_type is not None:
            self.duration.record(duration_s, {**attrs, ATTR_ERROR_TYPE: error_type})
        else:
            self.duration.record(duration_s, attrs)
            if ttft_s is not None:
                self.ttft.record(ttft_s, attrs)
                if completion_tokens is not None and completion_tokens > 1:
                    self.tpot.record((duration_s - ttft_s) / (completion_tokens - 1), attrs)
        if prompt_tokens is not None:
            self.token_usage.record(prompt_tokens, {**attrs, ATTR_TOKEN_TYPE: "input"})
        if completion_tokens is not None:
            self.token_usage.record(completion_tokens, {**attrs, ATTR_TOKEN_TYPE: "output"})


class CallSpans:
    """The spans of one proxied call: the SERVER span, and a CLIENT span per upstream attempt whose
    context is what :meth:`attempt` returns for injection into the upstream metadata."""

    def __init__(self, tracer: trace.Tracer, name: str, parent: otel_context.Context, attributes: Mapping[str, Any]):
        self._tracer = tracer
        self.span = start_server_span(tracer, name, parent, attributes)
        self._attempt: trace.Span | None = None

    def attempt(self, method: str, replica_id: str, address: str, predicted: int) -> otel_context.Context:
        """Open the CLIENT span of one upstream attempt; returns its context."""
        self.end_attempt(None)
        host, _, port = address.rpartition(":")
        attrs: dict[str, Any] = {
            "rpc.system": "grpc", "rpc.method": method.rpartition("/")[2], "rpc.service": method.rpartition("/")[0],
            "server.address": host, ATTR_REPLICA: replica_id, ATTR_PREDICTED: predicted,
        }
        if port.isdigit():
            attrs["server.port"] = int(port)
        ctx = trace.set_span_in_context(self.span)
        self._attempt = self._tracer.start_span(method, context=ctx, kind=SpanKind.CLIENT, attributes=attrs)
        return trace.set_span_in_context(self._attempt)

    def end_attempt(self, error: tuple[str, str] | None) -> None:
        span, self._attempt = self._attempt, None
        if span is None:
            return
        if error is not None:
            set_span_error(span, error)
        span.end()

    def end(self, *, attributes: Mapping[str, Any], error: tuple[str, str] | None) -> None:
        self.end_attempt(error)
        self.span.set_attributes(dict(attributes))
        if error is not None:
            set_span_error(self.span, error)
        self.span.end()


# The shared attribute names are re-exported: router.proxy reads them from here.
__all__ = [
    "ATTR_ATTEMPTS",
    "ATTR_CACHED_TOKENS",
    "ATTR_INPUT_TOKENS",
    "ATTR_OUTPUT_TOKENS",
    "ATTR_PREDICTED",
    "ATTR_REPLICA",
    "ATTR_REQUEST_ID",
    "CallSpans",
    "RouterMetrics",
]
