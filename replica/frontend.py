"""The replica frontend: admission control, the in-flight table and per-call timings over one engine
client (DESIGN.md §3.3). The gRPC servicers (``replica.servicers``) call it; it knows no servicer.

    servicers ─▶ ReplicaFrontend.stream / unary / abort / load / model_info / request_snapshot
                   │ prompt_ids (kvroute.prompt) ─▶ engine.make_request (validation) ─▶ engine.generate
                   ▲ on_step_report(StepReport): admissions, the latest EngineSample
    ProcessLLMEngine (reader thread) or AsyncLLMEngine (engine thread, through on_step)

Contract:
- Requests are validated before they touch the engine; a bad value fails with INVALID_ARGUMENT
  and a message that starts with the field (``"max_tokens: must be at least 1, got 0"``). A full
  waiting queue (``max_waiting`` requests submitted and not yet admitted by the scheduler) fails
  with RESOURCE_EXHAUSTED; a replica that is loading, draining or whose engine died, UNAVAILABLE.
  Statuses are decided in one place, ``replica.wire.classify_error``.
- A stream is a sequence of deltas; the last message carries ``finish_reason``, the matched stop
  and ``usage`` (``cached_tokens`` = the prefix-cache hit at the first admission). The unary form
  returns the same deltas concatenated.
- Client cancel and deadline expiry cancel the handler; the engine request is aborted and its
  blocks freed. ``abort`` is idempotent (it says whether the request was in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from kvroute.counted import counted
from kvroute.engine_info import EngineInfo
from kvroute.grpc_errors import RpcError, call_outcome
from kvroute.prompt import check_model, prompt_ids
from kvroute.responses import MD_CACHED_TOKENS, concat_deltas
from kvroute.telemetry import ATTR_REPLICA, call_context
from kvroute.tokenizer import Tokenizer
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import replica_pb2 as rep_pb
from replica.engine.async_engine import AsyncLLMEngine, EngineDeadError
from replica.engine.core_client import ProcessLLMEngine
from replica.engine.errors import InvalidRequestError
from replica.engine.step_hook import StepReport, take_step_sample
from replica.publisher import EventPublisher, NullEventPublisher
from replica.telemetry import EngineSample, ReplicaMetrics, RequestSpans
from replica.vllm_metrics import RequestTotals
from replica.wire import (
    classify_error,
    delta_response,
    final_response,
    load_response,
    sampling_params_from_proto,
)

EngineClient = AsyncLLMEngine | ProcessLLMEngine
GenerateRequest = gen_pb.GenerateRequest | rep_pb.ReplicaGenerateRequest
"""A public request (text, token ids or chat) or the router's ``ReplicaGenerateRequest`` (token ids)."""


@dataclass(eq=False)
class _Call:
    """One in-flight request. ``admitted_ns`` is written once by the step hook's frontend side
    (engine thread, or the engine process's reader thread)."""

    request_id: str
    request: Any  # replica.engine.request.Request
    submitted_ns: int
    admitted_ns: int | None = None
    first_token_ns: int | None = None
    completion_tokens: int = 0  # as of the last output received


class ReplicaFrontend:
    """The service side of the engine: the in-flight table, admission control, timings, and the
    step hook's frontend side (the latest load sample, admission times).

    Args:
        replica_id: this replica's id (request ids it makes up start with it).
        max_waiting: calls submitted and not admitted yet before RESOURCE_EXHAUSTED.
        publishing: whether this replica publishes KV events (``RequestSnapshot`` needs it).
        metrics / tracer: where calls are recorded (None: not recorded).

    ``publisher`` is the :class:`~replica.publisher.EventPublisher` the engine side feeds
    (``NullEventPublisher`` until :meth:`attach`). Threads: every method runs on the event loop
    except :meth:`on_step` (engine thread) and :meth:`on_step_report` (engine thread, or the engine
    process's reader thread). They share ``_awaiting`` (calls submitted but not yet admitted, under
    ``_lock``), each call's ``admitted_ns`` (written once by ``on_step_report``) and ``_sample``
    (replaced atomically).
    """

    def __init__(
        self,
        *,
        replica_id: str,
        max_waiting: int,
        publishing: bool = False,
        metrics: ReplicaMetrics | None = None,
        tracer: Any = None,
    ) -> None:
        self.replica_id = replica_id
        self.max_waiting = max_waiting
        self.publishing = publishing
        self.metrics = metrics
        self.tracer = tracer
        self.engine: EngineClient | None = None
        self.publisher: EventPublisher = NullEventPublisher()
        self.info: EngineInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self._calls: dict[str, _Call] = {}
        self._awaiting: dict[str, _Call] = {}
        self._lock = threading.Lock()
        self._sample: EngineSample | None = None
        self.totals = RequestTotals()  # the per-request counts under vLLM's names (replica.vllm_metrics)
        self._prev_hook_ns = time.time_ns()
        self._draining = False
        self._idle = asyncio.Event()  # set while no call is in flight (wait_idle)
        self._idle.set()

    # -- lifecycle (event loop) ------------------------------------------------------------------
    def attach(self, engine: EngineClient, info: EngineInfo, tokenizer: Tokenizer, publisher: EventPublisher) -> None:
        """Start serving with a started ``engine`` described by ``info`` (before: UNAVAILABLE,
        "loading"); ``tokenizer`` turns text and chat prompts into ids."""
        self.info = info
        self.tokenizer = tokenizer
        self.publisher = publisher
        self.engine = engine

    def stop_admitting(self) -> None:
        """Refuse new calls (UNAVAILABLE, "shutting down"); calls in flight go on."""
        self._draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the calls in flight to end; True when none is left."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def drain(self) -> int:
        """Refuse new calls (UNAVAILABLE) and abort every in-flight one; returns how many."""
        self._draining = True
        if self.engine is not None:
            for rid in list(self._calls):
                self.engine.abort(rid)
        return len(self._calls)

    @property
    def num_in_flight(self) -> int:
        return len(self._calls)

    def latest_sample(self) -> EngineSample | None:
        return self._sample

    # -- the step hook's frontend side (off the event loop) ---------------------------------------
    def on_step(self, engine: Any) -> None:
        """``AsyncLLMEngine`` step hook (engine thread, after every step and on idle ticks): both
        halves of the step hook in one place."""
        now = time.time_ns()
        # The step that just ran started about when the previous hook returned (or, after an idle
        # wait, when the request arrived), so that is the admission time of what it admitted.
        prev, self._prev_hook_ns = self._prev_hook_ns, now
        self.on_step_report(StepReport(take_step_sample(engine, self.publisher), prev))

    def on_step_report(self, report: StepReport) -> None:
        """Stamp the admissions the step made (a request's ``num_cached_tokens`` turns >= 0 at its
        first admission; ``ProcessLLMEngine`` mirrors it into the request copy before this runs)
        and keep the sample."""
        if self._awaiting:
            with self._lock:
                pending = list(self._awaiting.values())
            for call in pending:
                if call.request.num_cached_tokens >= 0:
                    call.admitted_ns = max(report.step_start_ns, call.submitted_ns)
                    with self._lock:
                        self._awaiting.pop(call.request_id, None)
        self._sample = report.sample

    # -- calls (event loop) ---------------------------------------------------------------------------
    def _require_engine(self) -> EngineClient:
        if self._draining:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "replica is shutting down (draining: no new calls)")
        if self.engine is None:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "replica is loading its model")
        dead = self.engine.dead
        if dead is not None:
            raise EngineDeadError(str(dead) if isinstance(dead, EngineDeadError) else f"engine step loop died: {dead!r}")
        return self.engine

    def check_serving(self) -> None:
        """Raise what a call made now would fail with before its prompt is read: RpcError
        UNAVAILABLE (loading, draining) or EngineDeadError (the HTTP front's ``/health``)."""
        self._require_engine()

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The prompt of a public request as token ids (:func:`kvroute.prompt.prompt_ids`, as the
        router computes them), or a ReplicaService request's ids; the engine validates them.

        Raises:
            UnknownModelError: ``model`` names another model than this replica's.
            InvalidRequestError: ``prompt`` / ``prompt.chat`` (see ``kvroute.prompt``).
        """
        if isinstance(request, rep_pb.ReplicaGenerateRequest):
            return list(request.token_ids)
        check_model(request.model, self.info.model if self.info is not None else "")
        return prompt_ids(self.tokenizer, request)

    async def stream(
        self, request: GenerateRequest, context: grpc.aio.ServicerContext, *, method: str,
        operation: str = "text_completion",
    ) -> AsyncIterator[gen_pb.GenerateResponse]:
        """Run one request (a public one, or the router's token ids) and yield its response deltas
        (the last one carries the final fields).

        Raises:
            InvalidRequestError: a bad prompt or sampling value, or ``request_id`` in flight.
            RpcError: RESOURCE_EXHAUSTED (queue full) or UNAVAILABLE (loading, draining).
            EngineDeadError: the step loop died.
        """
        t0 = time.perf_counter()
        spans = None
        if self.tracer is not None:
            service, _, name = method.rpartition("/")
            spans = RequestSpans(
                self.tracer, method, call_context(context),
                {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name, "gen_ai.operation.name": operation,
                 ATTR_REPLICA: self.replica_id},
            )
        call: _Call | None = None
        first_token_s: float | None = None
        final = None
        error: tuple[str, str] | None = None
        try:
            engine = self._require_engine()
            params = sampling_params_from_proto(request.sampling if request.HasField("sampling") else None)
            rid = request.request_id or f"{self.replica_id}-{uuid.uuid4().hex[:16]}"
            if rid in self._calls:
                raise InvalidRequestError("request_id", f"{rid!r} is already in flight")
            req = engine.make_request(self.prompt_ids(request), params, rid, request.cache_salt or None)
            queued = self.queued()  # preempted requests included
            if queued >= self.max_waiting:
                raise RpcError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"waiting queue is full ({counted(queued, 'request')}, max_waiting={self.max_waiting}); retry later",
                )
            call = _Call(rid, req, time.time_ns())
            self._calls[rid] = call
            self._idle.clear()
            with self._lock:
                self._awaiting[rid] = call
            async with contextlib.aclosing(engine.generate(req)) as outputs:
                async for out in outputs:
                    call.completion_tokens = out.completion_tokens
                    if out.new_token_ids and first_token_s is None:
                        first_token_s = time.perf_counter() - t0
                        call.first_token_ns = time.time_ns()
                    if out.finished:
                        final = out
                        resp = final_response(out)
                        # For a gateway's endpoint picker, which sees the trailers, not the messages.
                        context.set_trailing_metadata(((MD_CACHED_TOKENS, str(resp.usage.cached_tokens)),))
                        yield resp
                    elif out.new_token_ids or out.text:
                        yield delta_response(rid, out)
        except BaseException as exc:  # noqa: BLE001 - recorded, then re-raised as it is
            # A cancel (or an abandoned stream) after the final response is no error of the call's.
            if final is None or isinstance(exc, Exception):
                error = call_outcome(exc, context, classify_error)
            raise
        finally:
            end_ns = time.time_ns()
            if call is not None:
                self._calls.pop(call.request_id, None)
                if not self._calls:
                    self._idle.set()
                with self._lock:
                    self._awaiting.pop(call.request_id, None)
            self._record(call, final, spans, t0, first_token_s, end_ns, error, operation)

    def _record(
        self, call: _Call | None, final: Any, spans: RequestSpans | None, t0: float, first_token_s: float | None,
        end_ns: int, error: tuple[str, str] | None, operation: str,
    ) -> None:
        req = call.request if call is not None else None
        prompt_tokens = req.num_prompt_tokens if req is not None else 0
        completion_tokens = call.completion_tokens if call is not None else 0
        cached_tokens = max(req.num_cached_tokens, 0) if req is not None else 0
        finish = final.finish_reason.value if final is not None and final.finish_reason is not None else None
        self.totals.record(finish, error[0] if error is not None else None, prompt_tokens, completion_tokens)
        if self.metrics is not None:
            self.metrics.record_request(
                operation=operation, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                ttft_s=first_token_s, duration_s=time.perf_counter() - t0, finish_reason=finish,
                error_type=error[0] if error is not None else None,
            )
        if spans is not None:
            spans.end(
                request_id=call.request_id if call is not None else None,
                submitted_ns=call.submitted_ns if call is not None else None,
                admitted_ns=call.admitted_ns if call is not None else None,
                first_token_ns=call.first_token_ns if call is not None else None,
                end_ns=end_ns, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                cached_tokens=cached_tokens, finish_reason=finish, error=error,
            )

    async def unary(self, *args: Any, **kwargs: Any) -> gen_pb.GenerateResponse:
        """``stream`` concatenated into one response (all token ids, the full text, final fields)."""
        return await concat_deltas(self.stream(*args, **kwargs))

    def abort(self, request_id: str) -> bool:
        """Abort an in-flight request (its stream ends with FINISH_REASON_ABORT); idempotent."""
        if self.engine is None or request_id not in self._calls:
            return False
        self.engine.abort(request_id)
        return True

    def queued(self) -> int:
        """Requests waiting for admission: the scheduler's queue as of the last step (preempted
        requests included), or the calls submitted since that no step has admitted yet, whichever
        is longer."""
        sample = self._sample
        return max(sample.waiting if sample is not None else 0, len(self._awaiting))

    def load(self) -> rep_pb.Load:
        """``GetLoad``'s answer. Raises RpcError UNAVAILABLE while loading."""
        if self.engine is None:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "replica is loading its model")
        return load_response(self.replica_id, self._sample or EngineSample(), self.queued())

    def model_info(self) -> gen_pb.ModelInfo:
        """``GetModelInfo``'s answer (``EngineInfo.to_proto``). Raises RpcError UNAVAILABLE while loading."""
        if self.info is None:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "replica is loading its model")
        return self.info.to_proto()

    def request_snapshot(self) -> int:
        """Ask the publisher for a snapshot after the next engine step (an idle engine still ticks
        every 50 ms). Returns the last seq assigned so far: the snapshot is valid at it or later.

        Raises:
            RpcError: FAILED_PRECONDITION when this replica does not publish.
        """
        if not self.publishing:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, "redis_url: KV event publishing is off on this replica")
        self.publisher.request_snapshot()
        return int(self.publisher.stats().last_seq)


__all__ = ["EngineClient", "GenerateRequest", "ReplicaFrontend"]
