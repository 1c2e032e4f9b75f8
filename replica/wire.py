"""What crosses the replica's gRPC boundary: the status of an error, and proto <-> engine types.

- :func:`classify_error` decides every status a replica call ends with (behind ``boundary``,
  :func:`kvroute.grpc_errors.error_boundary`): a refused request (``kvroute.prompt`` or the
  engine's ``InvalidRequestError``) is INVALID_ARGUMENT with ``"{field}: {reason}"``; a dead step
  loop, UNAVAILABLE; any other ``EngineError``, INTERNAL.
- :func:`sampling_params_from_proto` (:mod:`kvroute.sampling`'s, the router's too): proto
  ``SamplingParams`` -> ``SamplingParams``.
- :func:`delta_response` / :func:`final_response`: an engine ``RequestOutput`` -> a stream message.
- :func:`load_response`: a load sample -> ``GetLoad``'s answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from kvroute.grpc_errors import error_boundary
from kvroute.prompt import InvalidRequestError, UnknownModelError
from kvroute.sampling import sampling_params_from_proto
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import replica_pb2 as rep_pb
from replica.engine.async_engine import EngineDeadError
from replica.engine.errors import EngineError
from replica.engine.params import FinishReason
from replica.telemetry import EngineSample

GENERATION_SERVICE = gen_pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
REPLICA_SERVICE = rep_pb.DESCRIPTOR.services_by_name["ReplicaService"].full_name

_FINISH_REASONS = {
    FinishReason.STOP: gen_pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: gen_pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: gen_pb.FINISH_REASON_ABORT,
}


def service_names() -> Sequence[str]:
    """Full names of the services a replica serves (health statuses, reflection)."""
    return (GENERATION_SERVICE, REPLICA_SERVICE)


def classify_error(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status of an exception that escaped a servicer method (None: a bug -> INTERNAL)."""
    if isinstance(exc, InvalidRequestError):  # the engine's InvalidRequestError is one too
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, UnknownModelError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, EngineError):
        return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
    return None


boundary = error_boundary(classify_error)
"""The decorator of every replica servicer method."""


def delta_response(request_id: str, out: Any) -> gen_pb.GenerateResponse:
    """A stream message of one unfinished ``RequestOutput``: its new token ids and text."""
    return gen_pb.GenerateResponse(request_id=request_id, token_ids=out.new_token_ids, text=out.text)


def final_response(out: Any) -> gen_pb.GenerateResponse:
    """The last stream message, of the final ``RequestOutput``: the delta plus ``finish_reason``,
    the matched stop (``stop_str`` or ``stop_token_id``) and ``usage``."""
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


def load_response(replica_id: str, s: EngineSample, waiting: int) -> rep_pb.Load:
    """``GetLoad``'s answer from the latest sample; ``waiting`` as the frontend counts it (the
    scheduler's queue or the calls not admitted yet, whichever is longer)."""
    return rep_pb.Load(
        replica_id=replica_id, running=s.running, waiting=waiting,
        kv_usage=s.kv_usage, num_blocks=s.num_blocks, free_blocks=s.free_blocks,
        queued_prefill_tokens=s.queued_prefill_tokens, prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits, prefix_cache_cpu_hits=s.prefix_cache_cpu_hits,
        preemptions=s.preemptions, recomputed_tokens=s.recomputed_tokens,
    )


__all__ = [
    "GENERATION_SERVICE",
    "REPLICA_SERVICE",
    "boundary",
    "classify_error",
    "delta_response",
    "final_response",
    "load_response",
    "sampling_params_from_proto",
    "service_names",
]
