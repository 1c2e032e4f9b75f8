"""llm-d's inference scheduler with its precise prefix-cache, queue and KV-usage scorers (3 / 2 / 2).

Source: llm-d/llm-d-inference-scheduler (the "precise prefix cache aware" well-lit path and its
scorer plugins, built on the Gateway API Inference Extension's scorers) and llm-d-kv-cache-manager
(the KV-event-fed block index). Each scorer gives each pod a score in [0, 1], higher is better;
the scheduler picks the highest weighted sum, ties at random:

- precise prefix cache: the request's leading blocks cached on the pod (from its KV events) /
  the request's blocks (weight 3);
- queue: ``(max_q - q) / (max_q - min_q)`` over the candidates, 1 when all are equal, q the pod's
  waiting requests (weight 2);
- KV cache utilization: ``1 - usage`` (weight 2).

Where this simplifies: the prefix match is the router's index (KV events + speculative entries);
the waiting queue is estimated as the router's in-flight count minus the pod's running count (its
last heartbeat), where llm-d scrapes ``vllm:num_requests_waiting``; no filters run before scoring.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.policies.base import Policy
from router.scoring import Candidate, RequestShape, Scored, pick_lowest


class LlmdPolicy(Policy):
    """Weighted prefix + queue + KV-usage scores (module docstring); cost = -score."""

    name = "llmd"

    def __init__(self, prefix_weight: float = 3.0, queue_weight: float = 2.0, kv_weight: float = 2.0,
                 rng: random.Random | None = None):
        self.prefix_weight, self.queue_weight, self.kv_weight = prefix_weight, queue_weight, kv_weight
        self.rng = rng or random.Random()

    def choose(self, cands: Sequence[Candidate], req: RequestShape) -> tuple[Candidate | None, list[Scored]]:
        blocks = max(-(-req.prompt_tokens // req.block_size), 1)
        queues = [max(c.in_flight - c.running, 0) for c in cands]
        hi, lo = (max(queues), min(queues)) if queues else (0, 0)
        scored = []
        for c, q in zip(cands, queues, strict=True):
            queue = 1.0 if hi == lo else (hi - q) / (hi - lo)
            score = (self.prefix_weight * min(c.match.gpu, blocks) / blocks + self.queue_weight * queue
                     + self.kv_weight * (1.0 - c.kv_usage))
            scored.append(Scored(c, -score))
        return pick_lowest(scored, self.rng), scored
