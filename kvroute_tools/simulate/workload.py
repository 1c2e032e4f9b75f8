"""The simulated workload: trace requests as prompts in virtual time.

Each trace hash id becomes ``tokens_per_block`` copies of the id itself (equal ids, equal tokens;
distinct ids never collide), and the prompt is cut to ``input_length`` scaled the way
``kvroute bench`` scales it (:meth:`kvroute_tools.trace.TraceTokenizer.prompt_len`). Token content
does not matter to a simulation, only equality, and this mapping costs a list repeat per block.
A request arrives at ``timestamp * time_scale`` seconds and asks for
``max(1, round(output_length * output_scale))`` output tokens.

The **modelled capacity** behind ``--load``: a request's work is the time the timing model charges
for its tokens once batched (every prompt and output token through the weights, and every decode
reading its context), with no prefix hit; a replica does one second of work per second. The load
of a trace on N replicas is its total work / (N x its duration), so the time scale giving a target
load is ``work / (load x N x duration)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute_tools.simulate.timing import TimingModel
from kvroute_tools.trace import TraceRequest, TraceTokenizer


def prompt_of(req: TraceRequest, tokens_per_block: int, whole_blocks: bool = False) -> list[int]:
    """The prompt token ids of ``req`` (module docstring; ``whole_blocks`` as
    :class:`~kvroute_tools.trace.TraceTokenizer`'s). Raises ValueError on empty hash_ids."""
    if not req.hash_ids:
        raise ValueError("hash_ids: empty")
    tokens: list[int] = []
    for h in req.hash_ids:
        tokens += [h] * tokens_per_block
    del tokens[prompt_len(req, tokens_per_block, whole_blocks):]
    return tokens


def prompt_len(req: TraceRequest, tokens_per_block: int, whole_blocks: bool = False) -> int:
    """``len(prompt_of(req, tokens_per_block, whole_blocks))`` without building it."""
    return TraceTokenizer(tokens_per_block, whole_blocks=whole_blocks).prompt_len(req)


def output_tokens(req: TraceRequest, output_scale: float) -> int:
    return max(1, round(req.output_length * output_scale))


def work_seconds(prompt: int, outputs: int, timing: TimingModel) -> float:
    """One request's work in seconds: its tokens through the weights, its decodes' KV reads."""
    kv = outputs * prompt + outputs * (outputs - 1) / 2
    return (prompt + outputs) * timing.token_s + kv * timing.kv_token_s


def time_scale_for_load(requests: Sequence[TraceRequest], replicas: int, load: float, timing: TimingModel,
                        tokens_per_block: int, output_scale: float) -> float:
    """The time scale at which ``requests`` load ``replicas`` replicas to ``load`` (0..1+).

    Raises:
        ValueError: load <= 0, or the trace spans no time.
    """
    if not load > 0:
        raise ValueError(f"load: must be > 0, got {load}")
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000 if requests else 0.0
    if span_s <= 0:
        raise ValueError("load: the trace's timestamps span no time; use --time-scale")
    work = sum(work_seconds(prompt_len(r, tokens_per_block), output_tokens(r, output_scale), timing)
               for r in requests)
    return work / (load * replicas * span_s)


__all__ = ["output_tokens", "prompt_len", "prompt_of", "time_scale_for_load", "work_seconds"]
