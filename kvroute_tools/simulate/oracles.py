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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

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


def unique_blocks(requests: Sequence[TraceRequest], tokens_per_block: int, block_size: int,
                  whole_blocks: bool = False) -> int:
    """Distinct full KV blocks over the requests' prompts (what ``--cache-fraction`` scales)."""
    seen: set = set()
    for req in requests:
        seen.update(block_keys(req, tokens_per_block, block_size, whole_blocks)[0])
    return len(seen)


__all__ = ["OracleRates", "block_keys", "oracle_rates", "unique_blocks"]
