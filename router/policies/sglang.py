"""SGLang router's ``cache_aware`` policy, re-implemented from its published description.

Source: sgl-project/sglang, ``sgl-router`` (``src/policies/cache_aware.rs`` and the router's
README, "Cache-Aware Load-Balancing Router"). Per request:

1. If the load is imbalanced, ``max_load - min_load > balance_abs_threshold`` (64) **and**
   ``max_load > balance_rel_threshold * min_load`` (1.5), route to the least loaded worker.
2. Else find the worker whose approximate radix tree (the prompts routed to it) shares the longest
   prefix with the request; if ``matched / prompt length > cache_threshold`` (0.3) route there,
   else to the worker with the smallest tree (the most cache room).
3. Insert the prompt into the chosen worker's tree. Trees are pruned by LRU to a size cap every
   eviction interval (120 s).

Where this simplifies: the trees are the router's speculative index entries (routing history, no
KV events: ``index_from_kv_events = False``), in blocks rather than characters, expiring
``speculative_ttl`` (the eviction interval) after a prefix was last routed instead of LRU at a size
cap; a worker's tree size is the blocks inserted into it so far (never pruned); load is the
router's in-flight count, as sgl-router's running-request counter.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from router.policies.base import Policy
from router.scoring import Candidate, RequestShape, Scored, pick_lowest


class SGLangCacheAwarePolicy(Policy):
    """cache_aware with SGLang's default thresholds (module docstring)."""

    name = "sglang_cache_aware"
    index_from_kv_events = False
    speculative_ttl = 120.0

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, rng: random.Random | None = None):
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.rng = rng or random.Random()
        self.tree_blocks: Counter[str] = Counter()

    def choose(self, cands: Sequence[Candidate], req: RequestShape) -> tuple[Candidate | None, list[Scored]]:
        if not cands:
            return None, []
        loads = [c.in_flight for c in cands]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            scored = [Scored(c, float(c.in_flight)) for c in cands]
        else:
            best = max(c.match.gpu for c in cands)
            if best * req.block_size / max(req.prompt_tokens, 1) > self.cache_threshold:
                scored = [Scored(c, float(best - c.match.gpu)) for c in cands]
            else:
                scored = [Scored(c, float(self.tree_blocks[c.replica_id])) for c in cands]
        pick = pick_lowest(scored, self.rng)
        blocks = -(-req.prompt_tokens // req.block_size)
        self.tree_blocks[pick.replica_id] += max(blocks - pick.match.gpu, 0)
        return pick, scored
