"""The trace made concrete: each Mooncake trace request as the prompt, output length and send time
the bench uses (prompts from kvroute_tools.trace's TraceTokenizer: equal hash ids, equal prefixes),
the hit-rate bounds the table shows next to the measured rates, and what the routing cost against
them."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.hashing import BlockHasher
from kvroute_tools.simulate.oracles import oracle_rates
from kvroute_tools.trace import TraceRequest, TraceTokenizer, hit_rate_bounds, leading_seen


@dataclass(frozen=True)
class PlannedRequest:
    """One trace request made concrete: when it is sent (seconds after the start), its prompt and
    how many tokens it generates."""

    index: int
    arrival_s: float
    token_ids: list[int]
    max_tokens: int


def plan_requests(
    trace: Sequence[TraceRequest], tokenizer: TraceTokenizer, *, output_scale: float, max_output_tokens: int,
    time_scale: float | None, max_model_len: int = 0,
) -> tuple[list[PlannedRequest], int]:
    """The trace's requests as prompts and output lengths, and how many prompts were cut to fit
    ``max_model_len`` (0 = no limit; a prompt keeps at least one slot for its output)."""
    t_first = min((r.timestamp_ms for r in trace), default=0.0)
    planned = []
    truncated = 0
    for i, r in enumerate(trace):
        ids = tokenizer.token_ids(r)
        max_tokens = min(max(1, round(r.output_length * output_scale)), max_output_tokens)
        if max_model_len:
            if len(ids) >= max_model_len:
                ids = ids[: max_model_len - 1]
                truncated += 1
            max_tokens = max(1, min(max_tokens, max_model_len - len(ids)))
        arrival = (r.timestamp_ms - t_first) / 1000.0 * time_scale if time_scale is not None else 0.0
        planned.append(PlannedRequest(i, arrival, ids, max_tokens))
    return planned, truncated


def hit_bounds(trace: Sequence[TraceRequest], replicas: int, *, tokens_per_block: int, block_size: int,
               whole_blocks: bool) -> dict[str, float]:
    """``{"prompt_tokens", "ideal", "round_robin"}``: the ideal and round-robin hit rates (0..1)
    over ``replicas`` unlimited caches.

    Prompts from ``input_length`` (``whole_blocks`` False): from the trace's own 512-token blocks
    and input lengths (:func:`kvroute_tools.trace.hit_rate_bounds`). With ``whole_blocks``, under
    the engine's lookup rule over the prompts sent, ``len(hash_ids) * tokens_per_block`` tokens in
    KV blocks of ``block_size``: whole blocks only, the last prompt token recomputed
    (:func:`kvroute_tools.simulate.oracles.oracle_rates`; the peer routers' measurement harness
    counts the same way), which is what one replica with an unlimited cache measures. When ``block_size``
    does not divide ``tokens_per_block`` the trace's own bounds are returned.
    """
    if not whole_blocks or tokens_per_block % block_size:
        return hit_rate_bounds(trace, replicas)
    rates = oracle_rates(trace, replicas, sys.maxsize, tokens_per_block, block_size, whole_blocks=True)
    return {"prompt_tokens": rates.prompt_tokens, "ideal": rates.ideal, "round_robin": rates.round_robin}


def routed_past(prompts: Sequence[Sequence[int]], picks: Sequence[str], block_size: int) -> tuple[int, int]:
    """``(requests, tokens)`` that routing gave up, against unlimited caches.

    ``prompts[i]`` was sent to replica ``picks[i]`` (token ids, in the order sent; a request that
    failed has pick ""), and every replica is taken to keep every block it computed. A request
    counts when another replica held a longer prefix of it than the one it went to; its tokens
    count the difference, under the engine's lookup rule (whole blocks of ``block_size``, at most
    ``(len - 1) // block_size`` of them). So on a run where nothing is evicted, ideal hit rate -
    measured hit rate = routing's share (these tokens / prompt tokens) + the replicas' own (a
    prefix still being computed when a request that shares it is admitted, say).

    Raises:
        ValueError: ``block_size`` < 1, or ``prompts`` and ``picks`` of different lengths.
    """
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    if len(prompts) != len(picks):
        raise ValueError(f"picks: {len(picks)} for {len(prompts)} prompts")
    hasher = BlockHasher(block_size=block_size)  # the block and all before it, as the engine keys it
    held: dict[str, set[bytes]] = {}
    requests = tokens = 0
    for ids, pick in zip(prompts, picks, strict=True):
        if not pick:
            continue
        keys = hasher.hash_blocks(ids)
        lookable = keys[: max(len(ids) - 1, 0) // block_size]
        mine = held.setdefault(pick, set())
        lost = max(leading_seen(lookable, blocks) for blocks in held.values()) - leading_seen(lookable, mine)
        if lost > 0:
            requests += 1
            tokens += lost * block_size
        mine.update(keys)
    return requests, tokens


__all__ = ["PlannedRequest", "hit_bounds", "plan_requests", "routed_past"]
