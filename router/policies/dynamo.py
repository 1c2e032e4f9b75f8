"""NVIDIA Dynamo's KV router cost, re-implemented from its published description.

Source: ai-dynamo/dynamo, the KV cache routing docs (``docs/architecture/kv_cache_routing.md``)
and ``lib/llm/src/kv_router/scheduler.rs``: for each worker::

    logit = overlap_score_weight * potential_prefill_blocks + potential_decode_blocks

``potential_prefill_blocks``: the request's blocks not covered by the worker's cached overlap
(from KV events), plus the prefill already queued there; ``potential_decode_blocks``: the blocks
the worker holds for active requests, plus the request's. Lowest logit wins; with temperature 0
(the default here) that is an argmin, ties at random; above 0 the logits are sampled by softmax.

Where this simplifies: a worker's active blocks are its KV usage (last heartbeat) x
``block_capacity`` (``set_block_capacity``, by the caller; 0 leaves only the request's own blocks), where Dynamo counts
the blocks of the requests it routed; overlap_score_weight is 1 (Dynamo's default).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from router.policies.base import Policy
from router.scoring import Candidate, RequestShape, Scored, pick_lowest


class DynamoKVPolicy(Policy):
    """Dynamo's cost (module docstring)."""

    name = "dynamo"

    def __init__(self, overlap_score_weight: float = 1.0, temperature: float = 0.0, block_capacity: int = 0,
                 rng: random.Random | None = None):
        self.overlap_score_weight = overlap_score_weight
        self.temperature = temperature
        self.block_capacity = block_capacity
        self.rng = rng or random.Random()

    def set_block_capacity(self, blocks: int) -> None:
        self.block_capacity = blocks

    def choose(self, cands: Sequence[Candidate], req: RequestShape) -> tuple[Candidate | None, list[Scored]]:
        B = req.block_size
        blocks = -(-req.prompt_tokens // B)
        scored = []
        for c in cands:
            prefill = max(blocks - c.match.gpu, 0) + c.queued_prefill_tokens / B
            decode = c.kv_usage * self.block_capacity + blocks
            scored.append(Scored(c, self.overlap_score_weight * prefill + decode))
        if self.temperature <= 0 or not scored:
            return pick_lowest(scored, self.rng), scored
        low = min(s.cost for s in scored)
        weights = [math.exp(-(s.cost - low) / self.temperature) for s in scored]
        return self.rng.choices([s.candidate for s in scored], weights)[0], scored
