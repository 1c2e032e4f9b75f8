"""The router's request path: the public GenerationService's calls proxied to replicas, and what
RouterService answers (DESIGN.md §3.3, §5). The servicers that expose it are in router.servicers;
the replica channels in router.channels.

One request through ``GenerationService.GenerateStream`` (``Generate`` is the same, concatenated)::

    tokenize (text | chat | token_ids; INVALID_ARGUMENT naming the field)
      └▶ validate (given ids against the vocabulary, then kvroute.sampling.validate_request: the
         replica's check, against the model limits the routable replicas' heartbeats report:
         router.model_limits; INVALID_ARGUMENT before anything is routed)
      └▶ decide (hash + lookup + score; UNAVAILABLE with the reason when nothing is routable)
          └▶ commit (speculative index entries + in-flight load, counted now, not at dispatch)
              └▶ ReplicaService.GenerateStream(token ids) on the pick's cached channel,
                 with the call's remaining deadline and the W3C trace context in the metadata
                   ├ first delta ──▶ Router.prefill_done (load, speculative entries)
                   ├ deltas ──────▶ passed through unchanged
                   └ last delta ──▶ + routing (replica, address, predicted cached tokens, policy),
                                     trailing metadata x-kvroute-replica / -predicted-cached-tokens,
                                     prediction accuracy (usage.cached_tokens vs predicted)
    the ticket is finished on completion, error and cancel, exactly once.

Failures. Before the first delta, an UNAVAILABLE from the replica (dead address, draining, loading)
or a RESOURCE_EXHAUSTED (its waiting queue filled since its last heartbeat) is retried on another
replica -- the failed ones excluded -- up to ``max_retries`` times; after the first delta nothing is
retried (the client has output it cannot take back). An attempt that ends before its first delta
(refused, failed, cancelled) withdraws its speculative index entries: the replica will not store
those blocks. Every other status (INVALID_ARGUMENT, ...), and the last attempt's, is the replica's,
passed through unchanged (so is a RESOURCE_EXHAUSTED when no other replica is left). A client
cancel or deadline expiry cancels the handler, whose ``finally`` cancels the upstream call: the
replica aborts the request and frees its blocks. Statuses are decided in one place,
:func:`router.routing.classify_error` behind ``error_boundary``.

Threads: everything here runs on the server's event loop; the index is shared with the consumer
thread; ``Router`` takes its ``index_lock`` around lookups and speculative writes.

Latency. What the router adds to the time to first token is mostly the hop itself (a bare
grpc.aio pass-through costs most of it: thread wake-ups in grpc and the kernel, not Python work),
plus this file's path up to the upstream call: trace context extract + inject, tokenize, decide
(hash: kvroute.hashing's fastest implementation on this install; lookup; score), commit, call
creation. bench/router.py measures the router against the replica direct and against bare
pass-throughs side by side (its output and docs/results.md hold the numbers). Metrics and spans
are recorded after the call (``_record``), off the response path.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvroute.grpc_errors import call_outcome, deadline_expired
from kvroute.heartbeat import ENGINE_KVROUTE, ENGINE_VLLM
from kvroute.responses import MD_PREDICTED, MD_REPLICA, concat_deltas
from kvroute.telemetry import call_context, inject_metadata
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import replica_pb2 as rep_pb
from kvroute.v1 import router_pb2 as router_pb
from router.channels import ReplicaChannels
from router.core import Decision
from router.registry import ReplicaInfo
from router.routing import NoReplicaError, RoutingService, classify_error
from router.telemetry import (
    ATTR_ATTEMPTS,
    ATTR_CACHED_TOKENS,
    ATTR_INPUT_TOKENS,
    ATTR_OUTPUT_TOKENS,
    ATTR_PREDICTED,
    ATTR_REPLICA,
    ATTR_REQUEST_ID,
    CallSpans,
)
from router.vllm_upstream import VllmUpstream

log = logging.getLogger(__name__)

GENERATION_SERVICE = gen_pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
ROUTER_SERVICE = router_pb.DESCRIPTOR.services_by_name["RouterService"].full_name
REPLICA_STREAM_METHOD = "kvroute.v1.ReplicaService/GenerateStream"


# Replica statuses that mean "this replica cannot take the call now", worth another replica.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
_UNFINISHED = gen_pb.FINISH_REASON_UNSPECIFIED
_MODEL_INFO_TIMEOUT_S = 2.0
_UINT32_MAX = 2**32 - 1
_PRUNE_EVERY_S = 60.0

class Proxy:
    """The gRPC forwarding front: route (router.routing), forward to the pick, account.

    Args:
        routing: the routing steps (checked ids, route, prefill_done, finish, withdraw).
        max_retries: other replicas tried when one fails with UNAVAILABLE or RESOURCE_EXHAUSTED before
            the first token.
        tracer: makes the spans (None: no spans, but the caller's trace context still goes upstream).
        channels: the channels to the replicas (default: plaintext ones).
        vllm: the HTTP client for vLLM replicas (default: a plaintext one).
    """

    def __init__(
        self,
        routing: RoutingService,
        *,
        max_retries: int = 2,
        tracer: Any = None,
        channels: ReplicaChannels | None = None,
        vllm: VllmUpstream | None = None,
    ):
        self.routing = routing
        self.max_retries = max_retries
        self.metrics = routing.metrics
        self.tracer = tracer
        self.channels = channels if channels is not None else ReplicaChannels()
        self.vllm = vllm if vllm is not None else VllmUpstream()
        self._next_prune = time.monotonic() + _PRUNE_EVERY_S

    # -- the proxied call --------------------------------------------------------------------------
    async def stream(
        self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext, *, method: str,
    ) -> AsyncIterator[gen_pb.GenerateResponse]:
        """Route ``request`` and yield the replica's deltas (see the module docstring).

        Raises:
            InvalidRequestError: a bad prompt or sampling value, or a prompt the model cannot hold
                (before anything is routed).
            NoReplicaError: no replica is routable, or every one tried failed before its first token.
            grpc.aio.AioRpcError: the replica's status, to be passed through.
        """
        t0 = time.perf_counter()
        operation = "chat" if request.WhichOneof("prompt") == "chat" else "text_completion"
        parent = call_context(context)
        spans = None
        if self.tracer is not None:
            service, _, name = method.rpartition("/")
            spans = CallSpans(self.tracer, method, parent, {
                "rpc.system": "grpc", "rpc.service": service, "rpc.method": name, "gen_ai.operation.name": operation,
            })
        decision: Decision | None = None
        final: gen_pb.GenerateResponse | None = None
        first_token_s: float | None = None
        error: tuple[str, str] | None = None
        attempts: list[tuple[Decision, str | None]] = []  # (decision, the status it failed with)
        try:
            ids = self.routing.checked_ids(request)
            sampling = request.sampling if request.HasField("sampling") else None
            upstream_request = rep_pb.ReplicaGenerateRequest(
                request_id=request.request_id, token_ids=ids, cache_salt=request.cache_salt, sampling=sampling,
            )
            exclude: list[str] = []
            failures: list[str] = []
            refusals: list[grpc.aio.AioRpcError] = []  # the RESOURCE_EXHAUSTED ones
            while True:
                try:
                    route = self.routing.route(ids, request.cache_salt, exclude=exclude)
                except NoReplicaError as e:
                    decision = e.decision
                    if not failures:
                        raise
                    if len(refusals) == len(failures):  # every queue tried is full: the replica's 429
                        raise refusals[-1] from None
                    raise NoReplicaError("; ".join([*failures, str(e)]), e.decision) from None
                decision, ticket, picked = route.decision, route.ticket, route.replica
                attempts.append((decision, None))
                routing_md = ((MD_REPLICA, picked.replica_id), (MD_PREDICTED, str(decision.predicted_cached_tokens)))
                context.set_trailing_metadata(routing_md)
                ctx = parent
                if spans is not None:
                    ctx = spans.attempt(REPLICA_STREAM_METHOD, picked.replica_id, picked.address,
                                        decision.predicted_cached_tokens)
                started = False
                upstream = self._upstream(picked, upstream_request, context.time_remaining(), ctx)
                try:
                    async for resp in upstream:
                        if not started:
                            started = True
                            first_token_s = time.perf_counter() - t0
                            # No initial metadata of our own: sending it apart from the first
                            # delta would delay that delta by one more write.
                            self.routing.prefill_done(ticket)
                        if resp.finish_reason != _UNFINISHED:
                            final = resp
                            resp.routing.CopyFrom(gen_pb.RoutingInfo(
                                replica_id=picked.replica_id, replica_address=picked.address,
                                predicted_cached_tokens=decision.predicted_cached_tokens, policy=decision.policy,
                            ))
                        yield resp
                    return
                except grpc.aio.AioRpcError as e:
                    retry = (not started and e.code() in RETRYABLE_CODES and len(attempts) <= self.max_retries
                             and not deadline_expired(context))
                    if not retry:
                        raise
                    log.info("replica %s (%s) failed before the first token (%s: %s); trying another",
                             picked.replica_id, picked.address, e.code().name, e.details())
                    attempts[-1] = (decision, e.code().name)
                    if spans is not None:
                        spans.end_attempt((e.code().name, e.details() or ""))
                    exclude.append(picked.replica_id)
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        refusals.append(e)
                    failures.append(f"{picked.replica_id} at {picked.address} failed: {e.code().name}: {e.details()}")
                finally:
                    if not started:  # refused or failed before prefill: its blocks will not be stored
                        self.routing.withdraw(decision)
                    self.routing.finish(ticket)
                    await upstream.aclose()  # the replica aborts the request and frees its blocks
        except BaseException as exc:  # noqa: BLE001 - recorded, then re-raised as it is
            error = call_outcome(exc, context, classify_error)
            raise
        finally:
            # Metrics and spans after the call has ended: none of their cost should sit between
            # the client and its first token or its status.
            asyncio.get_running_loop().call_soon(
                self._record, request, decision, final, spans, time.perf_counter() - t0, first_token_s, error,
                attempts, operation,
            )

    async def _upstream(self, picked: ReplicaInfo, request: rep_pb.ReplicaGenerateRequest, timeout: float | None,
                        ctx: Any) -> AsyncIterator[gen_pb.GenerateResponse]:
        """The picked replica's deltas for ``request``: ReplicaService.GenerateStream on a kvroute
        replica, vLLM's completions API on a vLLM one (router.vllm_upstream). Closing it cancels the
        upstream call (RST_STREAM, or the HTTP connection closed): the replica aborts the request.

        Raises:
            grpc.aio.AioRpcError: the replica's status.
        """
        if picked.engine == ENGINE_VLLM:
            stream = self.vllm.stream(picked.address, picked.model, request, timeout=timeout,
                                      headers=dict(inject_metadata((), ctx)))
            try:
                async for resp in stream:
                    yield resp
            finally:
                await stream.aclose()
            return
        call = None
        try:
            with self.channels.in_flight(picked.address) as stub:
                call = stub.GenerateStream(request, timeout=timeout, metadata=inject_metadata((), ctx))
                async for resp in call:
                    yield resp
        finally:
            if call is not None and not call.done():
                call.cancel()  # RST_STREAM

    def _record(
        self, request: gen_pb.GenerateRequest, decision: Decision | None, final: gen_pb.GenerateResponse | None,
        spans: CallSpans | None, duration_s: float, first_token_s: float | None, error: tuple[str, str] | None,
        attempts: list[tuple[Decision, str | None]], operation: str,
    ) -> None:
        now = time.monotonic()
        if now >= self._next_prune:
            self._next_prune = now + _PRUNE_EVERY_S
            live = {i.address for i in self.routing.replicas()}
            self.channels.prune(live)
        usage = final.usage if final is not None and final.HasField("usage") else None
        if self.metrics is not None:
            for d, failed_with in attempts:
                self.metrics.record_decision(d, "routed")
                if failed_with is not None and d.picked is not None:
                    self.metrics.record_retry(d.picked.replica_id, failed_with)
            if decision is not None and decision.picked is None:
                self.metrics.record_decision(decision, "no_replica")
            if usage is not None and decision is not None and decision.picked is not None:
                self.metrics.record_prediction(
                    decision.picked.replica_id, decision.predicted_cached_tokens, usage.cached_tokens
                )
            self.metrics.record_request(
                operation=operation, ttft_s=first_token_s, duration_s=duration_s,
                prompt_tokens=usage.prompt_tokens if usage is not None else None,
                completion_tokens=usage.completion_tokens if usage is not None else None,
                error_type=error[0] if error is not None else None,
            )
        if spans is not None:
            attrs: dict[str, Any] = {ATTR_ATTEMPTS: len(attempts)}
            if request.request_id:
                attrs[ATTR_REQUEST_ID] = request.request_id
            if decision is not None and decision.picked is not None:
                attrs[ATTR_REPLICA] = decision.picked.replica_id
                attrs[ATTR_PREDICTED] = decision.predicted_cached_tokens
            if usage is not None:
                attrs.update({ATTR_INPUT_TOKENS: usage.prompt_tokens, ATTR_OUTPUT_TOKENS: usage.completion_tokens,
                              ATTR_CACHED_TOKENS: usage.cached_tokens})
            spans.end(attributes=attrs, error=error)

    async def unary(self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext, *, method: str
                    ) -> gen_pb.GenerateResponse:
        """``stream`` concatenated into one response (all token ids, the full text, final fields)."""
        return await concat_deltas(self.stream(request, context, method=method))

    async def model_info(self) -> gen_pb.ModelInfo:
        """A routable replica's ModelInfo (the router's public GetModelInfo), else what the router
        knows: the model folder's, with :meth:`model_limits`."""
        replicas = [r for r in self.routing.routable() if r.engine == ENGINE_KVROUTE]  # vLLM has no GetModelInfo
        random.shuffle(replicas)
        for info in replicas[:2]:
            try:
                return await self.channels.stub(info.address).GetModelInfo(
                    gen_pb.GetModelInfoRequest(), timeout=_MODEL_INFO_TIMEOUT_S
                )
            except grpc.aio.AioRpcError as e:
                log.debug("GetModelInfo from %s failed: %s", info.replica_id, e.code().name)
        tok, hasher = self.routing.tokenizer, self.routing.hasher
        vocab_size, max_model_len = self.routing.model_limits()
        return gen_pb.ModelInfo(  # uint32 fields: a limit past them (UNBOUNDED) is the folder's
            model=tok.model_name, vocab_size=vocab_size if vocab_size <= _UINT32_MAX else tok.vocab_size,
            max_model_len=max_model_len if max_model_len <= _UINT32_MAX else tok.max_model_len,
            block_size=hasher.block_size, hash_algorithm=hasher.algorithm, hash_seed_digest=hasher.seed_digest,
            eos_token_ids=list(tok.tokenizer.eos_token_ids),
        )

    async def close(self) -> None:
        await self.channels.close()
        await self.vllm.close()


__all__ = ["GENERATION_SERVICE", "MD_PREDICTED", "MD_REPLICA", "ROUTER_SERVICE", "Proxy"]
