"""The replica's gRPC services over one engine client (DESIGN.md §3.3).

    GenerationService (text | token_ids | chat) ─┐
                                                 ├─▶ ReplicaFrontend ─▶ ProcessLLMEngine (engine process)
    ReplicaService (token_ids, Abort, GetLoad) ──┘        ▲               or AsyncLLMEngine (engine thread)
                                                          │ on_step_report(StepReport): admissions, EngineSample
                                                          └── one in-flight table, admission control

The step hook has two halves. The engine side runs where the engine runs, after every step:
:func:`take_step_sample` (the load sample; the step's KV events to the publisher), wrapped by
:class:`ProcessStepHook` in the engine process, or by ``ReplicaFrontend.on_step`` on the engine
thread. The frontend side, ``on_step_report``, stamps admissions and keeps the latest sample for
GetLoad, admission control and metrics. With the engine in its own process the publisher lives
there too; the server sees it through :class:`RemotePublisher` (counters as of the last report,
``request_snapshot`` forwarded).

Contract:
- Requests are validated before they touch the engine; a bad value fails with INVALID_ARGUMENT
  and a message that starts with the field (``"max_tokens: must be at least 1, got 0"``). A full
  waiting queue (``max_waiting`` requests submitted and not yet admitted by the scheduler) fails
  with RESOURCE_EXHAUSTED; a replica that is loading, draining or whose engine died, UNAVAILABLE.
  Statuses are decided in one place, :func:`classify_error` behind ``error_boundary``.
- A stream is a sequence of deltas; the last message carries ``finish_reason``, the matched stop
  and ``usage`` (``cached_tokens`` = the prefix-cache hit at the first admission). The unary
  ``Generate`` returns the same deltas concatenated.
- Client cancel and deadline expiry cancel the handler; the engine request is aborted and its
  blocks freed. ``Abort`` is idempotent (``found`` says whether the request was in flight).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvroute.grpc_errors import RpcError, call_outcome, error_boundary
from kvroute.heartbeat import EngineLoad
from kvroute.prompt import InvalidRequestError as PromptError
from kvroute.prompt import prompt_ids
from kvroute.responses import concat_deltas
from kvroute.telemetry import extract_context
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute.v1 import replica_pb2 as rep_pb
from kvroute.v1 import replica_pb2_grpc as rep_grpc
from replica.engine.async_engine import AsyncLLMEngine, EngineDeadError
from replica.engine.engine_proc import EngineFacts, ProcessLLMEngine
from replica.engine.errors import EngineError, InvalidRequestError
from replica.engine.params import FinishReason, SamplingParams
from replica.telemetry import EngineSample, ReplicaMetrics, RequestSpans, sample_engine

log = logging.getLogger(__name__)

EngineClient = AsyncLLMEngine | ProcessLLMEngine

GENERATION_SERVICE = gen_pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
REPLICA_SERVICE = rep_pb.DESCRIPTOR.services_by_name["ReplicaService"].full_name

_FINISH_REASONS = {
    FinishReason.STOP: gen_pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: gen_pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: gen_pb.FINISH_REASON_ABORT,
}


# -- the error boundary -------------------------------------------------------------------------
def classify_error(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status of an exception that escaped a servicer method (None: a bug -> INTERNAL)."""
    if isinstance(exc, PromptError):  # the engine's InvalidRequestError is one too
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, EngineError):
        return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
    return None


_boundary = error_boundary(classify_error)


# -- proto -> engine ------------------------------------------------------------------------------
def sampling_params_from_proto(msg: gen_pb.SamplingParams | None) -> SamplingParams:
    """The engine's ``SamplingParams`` of a proto message; unset optional fields keep the defaults.

    Values are copied as they are (range checks are ``SamplingParams.validate``'s job, so that the
    error message is the engine's).
    """
    if msg is None:
        return SamplingParams()
    kwargs: dict[str, Any] = {}
    for name in ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed"):
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    return SamplingParams(
        **kwargs, stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos
    )


# -- per-call state ---------------------------------------------------------------------------------
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


@dataclass(frozen=True)
class ModelDescription:
    """What ``GetModelInfo`` answers; fixed once the engine is built."""

    model: str
    vocab_size: int
    max_model_len: int
    block_size: int
    hash_algorithm: str
    hash_seed_digest: str
    eos_token_ids: tuple[int, ...]

    @classmethod
    def of(cls, facts: EngineFacts, model: str) -> ModelDescription:
        return cls(
            model=model, vocab_size=facts.vocab_size, max_model_len=facts.max_model_len,
            block_size=facts.block_size, hash_algorithm=facts.hash_algorithm,
            hash_seed_digest=facts.hash_seed_digest, eos_token_ids=facts.eos_token_ids,
        )

    def to_proto(self) -> gen_pb.ModelInfo:
        return gen_pb.ModelInfo(
            model=self.model, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
            block_size=self.block_size, hash_algorithm=self.hash_algorithm,
            hash_seed_digest=self.hash_seed_digest, eos_token_ids=list(self.eos_token_ids),
        )


# -- the step hook ----------------------------------------------------------------------------------
def take_step_sample(engine: Any, publisher: Any) -> EngineSample:
    """The engine side of the step hook: read the load sample and hand the step's KV events to the
    publisher (or drop them: nobody else empties the pool's list). Engine thread only; never raises
    a publisher error into the step loop."""
    sample = sample_engine(engine)
    events = engine.take_kv_events()
    if publisher is not None:
        try:
            publisher.on_step(events, load_fields(sample), engine.kv.cached_event_hashes)
        except Exception:  # a publisher bug must not kill the step loop
            log.exception("KV event publisher failed in on_step")
    return sample


@dataclass(frozen=True)
class PublisherStats:
    """A ``KVEventPublisher``'s counters at one moment (see its docstring)."""

    last_seq: int = 0
    batches_published: int = 0
    events_published: int = 0
    batches_dropped: int = 0
    snapshots_written: int = 0
    last_seq_written: int = 0
    reconnects: int = 0
    connected: bool = False

    @classmethod
    def of(cls, publisher: Any) -> PublisherStats:
        return cls(
            last_seq=publisher.last_seq, batches_published=publisher.batches_published,
            events_published=publisher.events_published, batches_dropped=publisher.batches_dropped,
            snapshots_written=publisher.snapshots_written, last_seq_written=publisher.last_seq_written,
            reconnects=publisher.reconnects, connected=publisher.connected,
        )


@dataclass(frozen=True)
class StepReport:
    """What the frontend learns from one engine step or idle tick. ``step_start_ns`` is when the
    step began (about when the previous hook returned): the admission time of what it admitted."""

    sample: EngineSample
    step_start_ns: int
    publisher: PublisherStats | None = None


class ProcessStepHook:
    """The step hook in the engine process (``ProcessLLMEngine``'s ``step_hook_factory`` makes it):
    :func:`take_step_sample`, and a :class:`StepReport` for the server when the sample or the
    publisher's counters changed since the last one (idle ticks mostly change nothing). Owns the
    publisher of that process: ``close`` stops it."""

    def __init__(self, publisher: Any = None) -> None:
        self.publisher = publisher
        self._prev_hook_ns = time.time_ns()
        self._last: tuple[EngineSample, PublisherStats | None] | None = None

    def __call__(self, engine: Any) -> StepReport | None:
        now = time.time_ns()
        prev, self._prev_hook_ns = self._prev_hook_ns, now
        sample = take_step_sample(engine, self.publisher)
        stats = PublisherStats.of(self.publisher) if self.publisher is not None else None
        if (sample, stats) == self._last:
            return None
        self._last = (sample, stats)
        return StepReport(sample, prev, stats)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()


def _request_snapshot(hook: ProcessStepHook) -> None:
    if hook.publisher is not None:
        hook.publisher.request_snapshot()


class RemotePublisher:
    """The server's view of the ``KVEventPublisher`` in the engine process: its counters as of the
    last step report (the attributes ``ReplicaMetrics`` and the frontend read), ``request_snapshot``
    forwarded to it. ``last_seq`` may trail the real one by the steps still in the pipe, which keeps
    RequestSnapshot's promise: the snapshot is valid at the returned seq or later."""

    def __init__(self, engine: ProcessLLMEngine) -> None:
        self._engine = engine
        self.stats = PublisherStats()

    def update(self, stats: PublisherStats) -> None:
        self.stats = stats

    def request_snapshot(self) -> None:
        self._engine.run_in_hook(_request_snapshot)

    def close(self) -> None:
        """Nothing to do here: the engine process closes the publisher when it stops."""

    def __getattr__(self, name: str) -> Any:  # last_seq, batches_published, ... (PublisherStats' fields)
        if name in PublisherStats.__dataclass_fields__:
            return getattr(self.__dict__["stats"], name)
        raise AttributeError(name)


class ReplicaFrontend:
    """The service side of the engine: the in-flight table, admission control, timings, and the
    per-step hook that feeds the load sample and the KV event publisher.

    Threads: every method runs on the event loop except :meth:`on_step` (engine thread) and
    :meth:`on_step_report` (engine thread, or the engine process's reader thread). They share
    ``_awaiting`` (calls submitted but not yet admitted, under ``_lock``), each call's
    ``admitted_ns`` (written once by ``on_step_report``) and ``_sample`` (replaced atomically).
    """

    def __init__(
        self,
        *,
        replica_id: str,
        max_waiting: int,
        metrics: ReplicaMetrics | None = None,
        tracer: Any = None,
    ) -> None:
        self.replica_id = replica_id
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.tracer = tracer
        self.engine: EngineClient | None = None
        self.publisher: Any = None
        self.model: ModelDescription | None = None
        self.tokenizer: Any = None
        self._calls: dict[str, _Call] = {}
        self._awaiting: dict[str, _Call] = {}
        self._lock = threading.Lock()
        self._sample: EngineSample | None = None
        self._prev_hook_ns = time.time_ns()
        self._draining = False

    # -- lifecycle (event loop) ------------------------------------------------------------------
    def attach(self, engine: EngineClient, model: ModelDescription, tokenizer: Any, publisher: Any = None) -> None:
        """Start serving with a started ``engine`` (before: UNAVAILABLE, "loading"); ``tokenizer``
        renders chat prompts."""
        self.model = model
        self.tokenizer = tokenizer
        self.publisher = publisher
        self.engine = engine

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

    # -- the step hook (off the event loop) ---------------------------------------------------------
    def on_step(self, engine: Any) -> None:
        """``AsyncLLMEngine`` step hook (engine thread, after every step and on idle ticks): both
        halves of the step hook in one place."""
        now = time.time_ns()
        # The step that just ran started about when the previous hook returned (or, after an idle
        # wait, when the request arrived), so that is the admission time of what it admitted.
        prev, self._prev_hook_ns = self._prev_hook_ns, now
        self.on_step_report(StepReport(take_step_sample(engine, self.publisher), prev))

    def on_step_report(self, report: StepReport) -> None:
        """The frontend side of the step hook: stamp the admissions the step made (a request's
        ``num_cached_tokens`` turns >= 0 at its first admission; ``ProcessLLMEngine`` mirrors it
        into the request copy here), keep the sample, update the remote publisher's counters."""
        if self._awaiting:
            with self._lock:
                pending = list(self._awaiting.values())
            for call in pending:
                if call.request.num_cached_tokens >= 0:
                    call.admitted_ns = max(report.step_start_ns, call.submitted_ns)
                    with self._lock:
                        self._awaiting.pop(call.request_id, None)
        self._sample = report.sample
        if report.publisher is not None and isinstance(self.publisher, RemotePublisher):
            self.publisher.update(report.publisher)

    # -- calls (event loop) ---------------------------------------------------------------------------
    def _require_engine(self) -> EngineClient:
        if self._draining:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "replica is shutting down")
        if self.engine is None:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "replica is loading its model")
        dead = self.engine.dead
        if dead is not None:
            raise EngineDeadError(str(dead) if isinstance(dead, EngineDeadError) else f"engine step loop died: {dead!r}")
        return self.engine

    def prompt_ids(self, request: gen_pb.GenerateRequest | rep_pb.ReplicaGenerateRequest) -> list[int]:
        """The prompt of a public request as token ids (:func:`kvroute.prompt.prompt_ids`, as the
        router computes them), or a ReplicaService request's ids; the engine validates them.

        Raises:
            InvalidRequestError: ``prompt`` / ``prompt.chat`` (see ``kvroute.prompt``).
        """
        if isinstance(request, rep_pb.ReplicaGenerateRequest):
            return list(request.token_ids)
        return prompt_ids(self.tokenizer, request)

    async def stream(
        self,
        request: gen_pb.GenerateRequest | rep_pb.ReplicaGenerateRequest,
        context: grpc.aio.ServicerContext,
        *,
        method: str,
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
                self.tracer, method, extract_context(context.invocation_metadata()),
                {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name, "gen_ai.operation.name": operation},
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
            # The scheduler's queue as of the last step (preempted requests included), or what
            # was submitted since and not admitted yet, whichever is longer.
            sample = self._sample
            queued = max(sample.waiting if sample is not None else 0, len(self._awaiting))
            if queued >= self.max_waiting:
                raise RpcError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"waiting queue is full ({queued} requests, max_waiting={self.max_waiting}); retry later",
                )
            call = _Call(rid, req, time.time_ns())
            self._calls[rid] = call
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
                        yield self._final_response(out)
                    elif out.new_token_ids or out.text:
                        yield gen_pb.GenerateResponse(request_id=rid, token_ids=out.new_token_ids, text=out.text)
        except BaseException as exc:  # noqa: BLE001 - recorded, then re-raised as it is
            # A cancel (or an abandoned stream) after the final response is no error of the call's.
            if final is None or isinstance(exc, Exception):
                error = call_outcome(exc, context, classify_error)
            raise
        finally:
            end_ns = time.time_ns()
            if call is not None:
                self._calls.pop(call.request_id, None)
                with self._lock:
                    self._awaiting.pop(call.request_id, None)
            self._record(call, final, spans, t0, first_token_s, end_ns, error, operation)

    def _final_response(self, out: Any) -> gen_pb.GenerateResponse:
        resp = gen_pb.GenerateResponse(
            request_id=out.request_id, token_ids=out.new_token_ids, text=out.text,
            finish_reason=_FINISH_REASONS.get(out.finish_reason, gen_pb.FINISH_REASON_UNSPECIFIED),
            usage=gen_pb.Usage(
                prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                cached_tokens=out.cached_tokens,
            ),
        )
        if isinstance(out.matched_stop, str):
            resp.stop_str = out.matched_stop
        elif isinstance(out.matched_stop, int):
            resp.stop_token_id = out.matched_stop
        return resp

    def _record(
        self,
        call: _Call | None,
        final: Any,
        spans: RequestSpans | None,
        t0: float,
        first_token_s: float | None,
        end_ns: int,
        error: tuple[str, str] | None,
        operation: str,
    ) -> None:
        req = call.request if call is not None else None
        prompt_tokens = req.num_prompt_tokens if req is not None else 0
        completion_tokens = call.completion_tokens if call is not None else 0
        cached_tokens = max(req.num_cached_tokens, 0) if req is not None else 0
        finish = final.finish_reason.value if final is not None and final.finish_reason is not None else None
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

    def load(self) -> rep_pb.Load:
        if self.engine is None:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "replica is loading its model")
        s = self._sample or EngineSample()
        return rep_pb.Load(
            replica_id=self.replica_id, running=s.running, waiting=max(s.waiting, len(self._awaiting)),
            kv_usage=s.kv_usage, num_blocks=s.num_blocks, free_blocks=s.free_blocks,
            queued_prefill_tokens=s.queued_prefill_tokens, prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, prefix_cache_cpu_hits=s.prefix_cache_cpu_hits,
            preemptions=s.preemptions,
        )

    def model_info(self) -> gen_pb.ModelInfo:
        if self.model is None:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "replica is loading its model")
        return self.model.to_proto()

    def request_snapshot(self) -> int:
        """Ask the publisher for a snapshot after the next engine step (an idle engine still ticks
        every 50 ms). Returns the last seq assigned so far: the snapshot is valid at it or later."""
        if self.publisher is None:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, "redis_url: KV event publishing is off on this replica")
        self.publisher.request_snapshot()
        return int(self.publisher.last_seq)


def load_fields(sample: EngineSample) -> EngineLoad:
    """The load part of a heartbeat from a sample."""
    return EngineLoad(
        free_blocks=sample.free_blocks, running=sample.running, waiting=sample.waiting, usage=sample.kv_usage,
        queued_prefill_tokens=sample.queued_prefill_tokens,
    )


# -- the servicers ----------------------------------------------------------------------------------
class GenerationServicer(gen_grpc.GenerationServiceServicer):
    """``kvroute.v1.GenerationService`` on a replica: text, token ids or chat."""

    def __init__(self, frontend: ReplicaFrontend) -> None:
        self._fe = frontend

    @staticmethod
    def _operation(request: gen_pb.GenerateRequest) -> str:
        return "chat" if request.WhichOneof("prompt") == "chat" else "text_completion"

    @_boundary
    async def Generate(self, request, context):
        return await self._fe.unary(
            request, context, method=f"{GENERATION_SERVICE}/Generate", operation=self._operation(request)
        )

    @_boundary
    async def GenerateStream(self, request, context):
        async with contextlib.aclosing(
            self._fe.stream(
                request, context, method=f"{GENERATION_SERVICE}/GenerateStream", operation=self._operation(request)
            )
        ) as deltas:
            async for d in deltas:
                yield d

    @_boundary
    async def GetModelInfo(self, request, context):
        return self._fe.model_info()


class ReplicaServicer(rep_grpc.ReplicaServiceServicer):
    """``kvroute.v1.ReplicaService``: the router's view of this replica (token ids only)."""

    def __init__(self, frontend: ReplicaFrontend) -> None:
        self._fe = frontend

    @_boundary
    async def Generate(self, request, context):
        return await self._fe.unary(request, context, method=f"{REPLICA_SERVICE}/Generate")

    @_boundary
    async def GenerateStream(self, request, context):
        async with contextlib.aclosing(
            self._fe.stream(request, context, method=f"{REPLICA_SERVICE}/GenerateStream")
        ) as deltas:
            async for d in deltas:
                yield d

    @_boundary
    async def Abort(self, request, context):
        return rep_pb.AbortResponse(found=self._fe.abort(request.request_id))

    @_boundary
    async def GetLoad(self, request, context):
        return self._fe.load()

    @_boundary
    async def GetModelInfo(self, request, context):
        return self._fe.model_info()

    @_boundary
    async def RequestSnapshot(self, request, context):
        return rep_pb.RequestSnapshotResponse(seq=self._fe.request_snapshot())


def service_names() -> Sequence[str]:
    """Full names of the services a replica serves (health statuses, reflection)."""
    return (GENERATION_SERVICE, REPLICA_SERVICE)


__all__ = [
    "GENERATION_SERVICE",
    "REPLICA_SERVICE",
    "GenerationServicer",
    "EngineClient",
    "ModelDescription",
    "ProcessStepHook",
    "PublisherStats",
    "RemotePublisher",
    "ReplicaFrontend",
    "ReplicaServicer",
    "StepReport",
    "classify_error",
    "load_fields",
    "sampling_params_from_proto",
    "service_names",
    "take_step_sample",
]
