"""The replica's metrics and spans (DESIGN.md §6), on top of the providers of ``kvroute.telemetry``.

Metrics. The engine-owned numbers (prefix cache, KV usage, queue lengths, preemptions) are read
from an :class:`EngineSample` that the engine thread takes after every step, by *observable*
instruments: the exporter's collection thread never touches engine state, and the counters are
exact (they are the KV manager's own cumulative counts). Per-request numbers (tokens, latencies)
are recorded by the service when a call ends.

OpenTelemetry name -> Prometheus name (as the Prometheus exporter writes them; token counts use the
annotation unit ``{token}``, which adds no suffix) -> vLLM v1 equivalent:

================================================  ======================================================  ======================================
``kvroute.replica.prefix_cache.queries``          ``kvroute_replica_prefix_cache_queries_total``          ``vllm:prefix_cache_queries``
``kvroute.replica.prefix_cache.hits``             ``kvroute_replica_prefix_cache_hits_total``             ``vllm:prefix_cache_hits``
``kvroute.replica.kv_cache.usage_ratio``          ``kvroute_replica_kv_cache_usage_ratio`` (0..1)         ``vllm:kv_cache_usage_perc``
``kvroute.replica.requests.running``              ``kvroute_replica_requests_running``                    ``vllm:num_requests_running``
``kvroute.replica.requests.waiting``              ``kvroute_replica_requests_waiting``                    ``vllm:num_requests_waiting``
``kvroute.replica.preemptions``                   ``kvroute_replica_preemptions_total``                   ``vllm:num_preemptions``
``kvroute.replica.preemption.recomputed_tokens``  ``kvroute_replica_preemption_recomputed_tokens_total``  (none: vLLM drops them from its stats)
``kvroute.replica.prompt_tokens``                 ``kvroute_replica_prompt_tokens_total``                 ``vllm:prompt_tokens``
``kvroute.replica.generation_tokens``             ``kvroute_replica_generation_tokens_total``             ``vllm:generation_tokens``
``kvroute.replica.requests.finished``             ``kvroute_replica_requests_finished_total``             ``vllm:request_success``
``kvroute.replica.events.published``              ``kvroute_replica_events_published_total``              (none: vLLM publishes over ZMQ)
``kvroute.replica.events.batches``                ``kvroute_replica_events_batches_total``                (none)
``kvroute.replica.events.dropped_batches``        ``kvroute_replica_events_dropped_batches_total``        (none)
``gen_ai.server.time_to_first_token``             ``gen_ai_server_time_to_first_token_seconds``           ``vllm:time_to_first_token_seconds``
``gen_ai.server.time_per_output_token``           ``gen_ai_server_time_per_output_token_seconds``         ``vllm:time_per_output_token_seconds``
``gen_ai.server.request.duration``                ``gen_ai_server_request_duration_seconds``              ``vllm:e2e_request_latency_seconds``
================================================  ======================================================  ======================================

(vLLM's Prometheus names carry ``_total`` on counters too, e.g. ``vllm:prefix_cache_hits_total``.)
Every point carries ``kvroute.replica_id`` (label ``kvroute_replica_id``), the label of the router's
per-replica metrics too; vLLM's names have ``model_name`` and ``engine`` instead.
The three ``gen_ai.server.*`` histograms use the GenAI semantic conventions' bucket boundaries and
attributes (``gen_ai.operation.name``, ``gen_ai.request.model``, ``error.type`` on failures), and
``kvroute.component`` = ``replica`` (the router's carry ``router``): a point attribute, which every
path to Prometheus keeps (the scope name does not survive all of them).
``gen_ai.client.token.usage`` is a *client* metric (the router records it); the replica does not.

Spans. One SERVER span per call (``kvroute.v1.ReplicaService/GenerateStream``, ...), continuing the
W3C context in the call metadata, with children ``queue`` (arrival -> admission by the scheduler),
``prefill`` (admission -> first token) and ``decode`` (first token -> end). All carry
``kvroute.request_id``; the server span also carries ``gen_ai.usage.input_tokens``,
``gen_ai.usage.output_tokens`` and ``gen_ai.usage.cache_read.input_tokens`` (the prefix hit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import SpanKind

from kvroute.telemetry import (
    ATTR_CACHED_TOKENS,
    ATTR_COMPONENT,
    ATTR_ERROR_TYPE,
    ATTR_FINISH_REASONS,
    ATTR_INPUT_TOKENS,
    ATTR_MODEL,
    ATTR_OPERATION,
    ATTR_OUTPUT_TOKENS,
    ATTR_REPLICA,
    ATTR_REQUEST_ID,
    REQUEST_DURATION_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    set_span_error,
    start_server_span,
)

CLIENT_GAVE_UP = frozenset({"CANCELLED", "DEADLINE_EXCEEDED"})
"""Statuses of a call its client gave up on: counted as ``abort``, as vLLM counts such a request."""


@dataclass(frozen=True)
class EngineSample:
    """The engine's numbers after one step, taken on the engine thread (immutable, so any thread
    may read the latest one). Prefix cache counts are cumulative, in tokens, once per admission."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_blocks: int = 0
    free_blocks: int = 0
    queued_prefill_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_cpu_hits: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    num_steps: int = 0
    prefill_tokens_per_s: float = 0.0  # measured (replica.engine.step_rates); 0 = not yet
    decode_seconds_per_running: float = 0.0


def sample_engine(engine: Any) -> EngineSample:
    """Read an ``LLMEngine``'s numbers. Engine thread only (the scheduler queues are not locked)."""
    kv = engine.kv
    sched = engine.scheduler
    stats = kv.stats
    rates = engine.step_timer.rates
    return EngineSample(
        running=len(sched.running),
        waiting=len(sched.waiting),
        kv_usage=kv.usage,
        num_blocks=kv.num_blocks,
        free_blocks=kv.num_free_blocks,
        queued_prefill_tokens=sched.queued_prefill_tokens,
        prefix_cache_queries=stats.queries,
        prefix_cache_hits=stats.hits,
        prefix_cache_cpu_hits=stats.cpu_hits,
        preemptions=sched.num_preemptions,
        recomputed_tokens=stats.recomputed_tokens,
        num_steps=engine.num_steps,
        prefill_tokens_per_s=rates.prefill_tokens_per_s,
        decode_seconds_per_running=rates.decode_seconds_per_running,
    )


class ReplicaMetrics:
    """Creates the replica's instruments on ``meter`` (names in the module docstring).

    Every point carries ``kvroute.replica_id`` = ``replica_id`` (Prometheus ``kvroute_replica_id``,
    the label the router's per-replica metrics carry: one dashboard variable selects both).
    ``sample()`` returns the latest :class:`EngineSample` (or None before the engine runs);
    ``publisher()`` returns the KV event publisher or None (its ``events_published``,
    ``batches_published`` and ``batches_dropped`` counters are exported as they are).
    """

    def __init__(
        self,
        meter: metrics.Meter,
        *,
        model: str,
        replica_id: str,
        sample: Callable[[], EngineSample | None],
        publisher: Callable[[], Any] = lambda: None,
    ) -> None:
        self._sample = sample
        self._publisher = publisher
        self.model = model
        self._replica = {ATTR_REPLICA: replica_id}
        replica = self._replica

        def engine_value(attr: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
            def cb(_options: CallbackOptions) -> Iterable[Observation]:
                s = self._sample()
                return [] if s is None else [Observation(getattr(s, attr), replica)]

            return cb

        def publisher_value(attr: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
            def cb(_options: CallbackOptions) -> Iterable[Observation]:
                p = self._publisher()
                return [] if p is None else [Observation(int(getattr(p, attr, 0)), replica)]

            return cb

        meter.create_observable_counter(
            "kvroute.replica.prefix_cache.queries", [engine_value("prefix_cache_queries")], unit="{token}",
            description="Prompt tokens looked up in the prefix cache, once per admission (vllm:prefix_cache_queries)",
        )
        meter.create_observable_counter(
            "kvroute.replica.prefix_cache.hits", [engine_value("prefix_cache_hits")], unit="{token}",
            description="Prompt tokens served from the prefix cache, GPU or CPU tier (vllm:prefix_cache_hits)",
        )
        meter.create_observable_gauge(
            "kvroute.replica.kv_cache.usage_ratio", [engine_value("kv_usage")], unit="1",
            description="KV cache usage, 1 - free/(num_blocks - 1); cached free blocks count as free"
            " (vllm:kv_cache_usage_perc)",
        )
        meter.create_observable_gauge(
            "kvroute.replica.requests.running", [engine_value("running")], unit="{request}",
            description="Requests in the running batch (vllm:num_requests_running)",
        )
        meter.create_observable_gauge(
            "kvroute.replica.requests.waiting", [engine_value("waiting")], unit="{request}",
            description="Requests in the scheduler's waiting queue (vllm:num_requests_waiting)",
        )
        meter.create_observable_counter(
            "kvroute.replica.preemptions", [engine_value("preemptions")], unit="{preemption}",
            description="Requests preempted by recompute (vllm:num_preemptions)",
        )
        meter.create_observable_counter(
            "kvroute.replica.preemption.recomputed_tokens", [engine_value("recomputed_tokens")], unit="{token}",
            description="Tokens computed again by requests re-admitted after a preemption (kept out of"
            " prefix_cache.queries/hits, as vLLM keeps preempted requests out of its prefix cache stats)",
        )
        meter.create_observable_counter(
            "kvroute.replica.events.published", [publisher_value("events_published")], unit="{event}",
            description="KV cache events written to Redis",
        )
        meter.create_observable_counter(
            "kvroute.replica.events.batches", [publisher_value("batches_published")], unit="{batch}",
            description="KV event batches (one per engine step with events) written to Redis",
        )
        meter.create_observable_counter(
            "kvroute.replica.events.dropped_batches", [publisher_value("batches_dropped")], unit="{batch}",
            description="KV event batches dropped because the publish buffer was full (forces a snapshot)",
        )
        self.prompt_tokens = meter.create_counter(
            "kvroute.replica.prompt_tokens", unit="{token}", description="Prompt tokens of finished requests (vllm:prompt_tokens)"
        )
        self.generation_tokens = meter.create_counter(
            "kvroute.replica.generation_tokens", unit="{token}", description="Generated tokens (vllm:generation_tokens)"
        )
        self.requests_finished = meter.create_counter(
            "kvroute.replica.requests.finished", unit="{request}",
            description="Calls that ended, by finish_reason: stop, length, abort (Abort rpc, client cancel,"
            " deadline) or error (refused or failed) (vllm:request_success counts stop/length/abort)",
        )
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s", explicit_bucket_boundaries_advisory=TTFT_BUCKETS,
            description="Time to generate the first token, for successful responses",
        )
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s", explicit_bucket_boundaries_advisory=TPOT_BUCKETS,
            description="Time per output token after the first, for successful responses",
        )
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration", unit="s", explicit_bucket_boundaries_advisory=REQUEST_DURATION_BUCKETS,
            description="Time from the arrival of a request to its last token",
        )

    def record_request(
        self,
        *,
        operation: str,
        prompt_tokens: int,
        completion_tokens: int,
        ttft_s: float | None,
        duration_s: float,
        finish_reason: str | None,
        error_type: str | None,
    ) -> None:
        """Record one ended call, refused ones included (0 tokens). ``ttft_s`` is None when no token
        was produced; ``error_type`` is the gRPC status name of a failed call. TTFT and TPOT are
        recorded for successful calls only (the spec's "for successful responses")."""
        attrs = {ATTR_OPERATION: operation, ATTR_MODEL: self.model, **self._replica}
        self.prompt_tokens.add(prompt_tokens, attrs)
        self.generation_tokens.add(completion_tokens, attrs)
        if error_type is None:
            outcome = finish_reason or "none"
        elif error_type in CLIENT_GAVE_UP:
            outcome = "abort"
        else:
            outcome = "error"
        self.requests_finished.add(1, {**attrs, "finish_reason": outcome})
        latency = {**attrs, ATTR_COMPONENT: "replica"}
        if error_type is not None:
            self.duration.record(duration_s, {**latency, ATTR_ERROR_TYPE: error_type})
            return
        self.duration.record(duration_s, latency)
        if ttft_s is not None:
            self.ttft.record(ttft_s, latency)
            if completion_tokens > 1:
                self.tpot.record((duration_s - ttft_s) / (completion_tokens - 1), latency)


class RequestSpans:
    """The spans of one call: a SERVER span opened at arrival; ``queue``, ``prefill`` and
    ``decode`` children written at the end from the recorded timestamps (``time.time_ns()``)."""

    def __init__(
        self, tracer: trace.Tracer, name: str, parent: otel_context.Context | None, attributes: Mapping[str, Any]
    ) -> None:
        self._tracer = tracer
        self.span = start_server_span(tracer, name, parent, attributes)

    def set_request_id(self, request_id: str) -> None:
        self.span.set_attribute(ATTR_REQUEST_ID, request_id)

    def end(
        self,
        *,
        request_id: str | None,
        submitted_ns: int | None,
        admitted_ns: int | None,
        first_token_ns: int | None,
        end_ns: int,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        finish_reason: str | None,
        error: tuple[str, str] | None,
    ) -> None:
        """Close the server span (status ERROR with ``error = (code name, message)``) and write the
        phase spans that happened."""
        span = self.span
        if request_id is not None:
            span.set_attributes(
                {
                    ATTR_REQUEST_ID: request_id,
                    ATTR_INPUT_TOKENS: prompt_tokens,
                    ATTR_OUTPUT_TOKENS: completion_tokens,
                    ATTR_CACHED_TOKENS: cached_tokens,
                }
            )
        if finish_reason is not None:
            span.set_attribute(ATTR_FINISH_REASONS, [finish_reason])
        if error is not None:
            set_span_error(span, error)
        if submitted_ns is not None and request_id is not None:
            ctx = trace.set_span_in_context(span)
            common = {ATTR_REQUEST_ID: request_id}
            queue_end = admitted_ns if admitted_ns is not None else end_ns
            self._child("queue", ctx, submitted_ns, queue_end, common)
            if admitted_ns is not None:
                prefill_end = first_token_ns if first_token_ns is not None else end_ns
                self._child(
                    "prefill", ctx, admitted_ns, prefill_end,
                    {**common, ATTR_INPUT_TOKENS: prompt_tokens, ATTR_CACHED_TOKENS: cached_tokens},
                )
            if first_token_ns is not None:
                self._child("decode", ctx, first_token_ns, end_ns, {**common, ATTR_OUTPUT_TOKENS: completion_tokens})
        span.end(end_time=end_ns)

    def _child(self, name: str, ctx: otel_context.Context, start: int, end: int, attrs: Mapping[str, Any]) -> None:
        child = self._tracer.start_span(name, context=ctx, kind=SpanKind.INTERNAL, start_time=start, attributes=attrs)
        child.end(end_time=max(start, end))


# The bucket boundaries are re-exported: tests read them from here.
__all__ = [
    "REQUEST_DURATION_BUCKETS",
    "TPOT_BUCKETS",
    "TTFT_BUCKETS",
    "EngineSample",
    "ReplicaMetrics",
    "RequestSpans",
    "sample_engine",
]
