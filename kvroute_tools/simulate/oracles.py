"""Hit-rate oracles, in prompt tokens, under the engine's own lookup rule.

A prompt of n tokens holds ``n // B`` full KV blocks of B tokens; block j is named by the trace id
that covers it and its place in that trace block (``(hash_ids[j * B // T], j % (T // B))``, T
tokens per trace block), which is unique because trace ids are prefix-chained. A request hits the
leading run of its blocks that the cache holds, capped at ``(n - 1) // B`` blocks (the engine
always recomputes the last prompt token), so these rates are exactly what one simulated replica
with an unlimited cache and every request prefilled at admission measures (the exactness tests).

- ``ideal``: one unlimited cache that has seen every earlier request.
- ``round_robin``: requests dealt in turn to N unlimited caches.
- ``pooled``: one LRU cache of the cluster's total blocks that sees every request: the best any
  router can do with the same memory. LRU as the engine frees: a request's blocks go to the
  most-recently-used end tail first, so its first block is the last of them to be evicted.
  Simplified: a request's blocks are evictable as soon as it is seen (no request holds blocks
  while it runs) and its output blocks take no room.

And one latency bound, :func:`ttft_floor`: the mean time to first token if every request ran alone
on an idle replica with the ideal oracle's hits, its uncached tokens prefilled in steps of the
token budget timed by the timing model. No policy's TTFT mean can be lower with these hits at best
(a busy replica only adds waiting and shared steps).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvroute_tools.simulate.timing import TimingModel
from kvroute_tools.simulate.workload import prompt_len
from kvroute_tools.trace import TraceRequest


@dataclass(frozen=True)
class OracleRates:
    """Hit rates in 0..1 (hit prompt tokens / prompt tokens) and the prompt tokens counted."""

    prompt_tokens: int
    ideal: float
    round_robin: float
    pooled: float


def block_keys(req: TraceRequest, tokens_per_block: int, block_size: int,
               whole_blocks: bool = False) -> tuple[list[tuple[int, int]], int]:
    """(names of the prompt's full KV blocks, prompt tokens; ``whole_blocks``: the prompt length
    rule of :func:`~kvroute_tools.simulate.workload.prompt_len`). Raises ValueError when block_size
    does not divide tokens_per_block."""
    if tokens_per_block % block_size:
        raise ValueError(f"block_size {block_size} must divide tokens per trace block {tokens_per_block}")
    n = prompt_len(req, tokens_per_block, whole_blocks)
    sub = tokens_per_block // block_size
    ids = req.hash_ids
    return [(ids[j // sub], j % sub) for j in range(n // block_size)], n


def _leading(keys: list[tuple[int, int]], cache, cap: int) -> int:
    k = 0
    for key in keys[:cap]:
        if key not in cache:
            break
        k += 1
    return k


def oracle_rates(requests: Sequence[TraceRequest], replicas: int, pooled_blocks: int, tokens_per_block: int,
                 block_size: int, whole_blocks: bool = False) -> OracleRates:
    """The three oracles over ``requests`` in order (module docstring); ``pooled_blocks``: the
    cluster's total usable KV blocks; ``whole_blocks`` as :func:`block_keys`'."""
    ideal: set = set()
    rr: list[set] = [set() for _ in range(replicas)]
    lru: OrderedDict = OrderedDict()
    total = hit_ideal = hit_rr = hit_pooled = 0
    for i, req in enumerate(requests):
        keys, n = block_keys(req, tokens_per_block, block_size, whole_blocks)
        cap = max(n - 1, 0) // block_size
        total += n
        hit_ideal += _leading(keys, ideal, cap) * block_size
        ideal.update(keys)
        cache = rr[i % replicas]
        hit_rr += _leading(keys, cache, cap) * block_size
        cache.update(keys)
        hit_pooled += _leading(keys, lru, cap) * block_size
        for key in reversed(keys):
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > pooled_blocks:
            lru.popitem(last=False)
    rate = (lambda h: h / total) if total else (lambda h: 0.0)
    return OracleRates(total, rate(hit_ideal), rate(hit_rr), rate(hit_pooled))


def prefill_alone_seconds(prompt_tokens: int, cached_tokens: int, timing: TimingModel, budget: int) -> float:
    """Seconds from admission to the first token of a request alone on an idle replica: its
    ``prompt_tokens - cached_tokens`` tokens in chunks of at most ``budget``, each step reading the
    context up to the chunk's end (the cached tokens included)."""
    done, seconds = cached_tokens, 0.0
    while done < prompt_tokens:
        chunk = min(budget, prompt_tokens - done)
        done += chunk
        seconds += timing.step_seconds(chunk, 0, done)
    return seconds


def ttft_floor(requests: Sequence[TraceRequest], timing: TimingModel, tokens_per_block: int, block_size: int,
               budget: int, whole_blocks: bool = False) -> float:
    """Mean seconds of :func:`prefill_alone_seconds` over ``requests``, each with the ideal oracle's
    cached tokens (the module docstring's latency bound); 0.0 for no request."""
    seen: set = set()
    total = 0.0
    for req in requests:
        keys, n = block_keys(req, tokens_per_block, block_size, whole_blocks)
        cached = _leading(keys, seen, max(n - 1, 0) // block_size) * block_size
        seen.update(keys)
        total += prefill_alone_seconds(n, cached, timing, budget)
    return total / len(requests) if requests else 0.0


def unique_blocks(requests: Sequence[TraceRequest], tokens_per_block: int, block_size: int,
                  whole_blocks: bool = False) -> int:
    """Distinct full KV blocks over the requests' prompts (what ``--cache-fraction`` scales)."""
    seen: set = set()
    for req in requests:
        seen.update(block_keys(req, tokens_per_block, block_size, whole_blocks)[0])
    return len(seen)


__all__ = ["OracleRates", "block_keys", "oracle_rates", "prefill_alone_seconds", "ttft_floor", "unique_blocks"]
