"""kvroute's own policy: the lowest estimated TTFT of ``router.scoring``'s cost model (DESIGN.md §5).

Imports: router.scoring (the cost math) and router.policies.base.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.policies.base import Policy
from router.scoring import (
    DEFAULT_SCORERS,
    Candidate,
    RequestShape,
    Scored,
    Scorer,
    ScoringWeights,
    decode_step_seconds,
    pick_lowest,
    prefill_rate,
)


class KVRoutePolicy(Policy):
    """Lowest estimated TTFT (module docstring); exact ties at random from a seeded generator."""

    name = "kvroute"

    def __init__(
        self,
        weights: ScoringWeights | None = None,
        scorers: dict[str, Scorer] | None = None,
        rng: random.Random | None = None,
    ):
        self.weights = weights or ScoringWeights()
        self.scorers = dict(DEFAULT_SCORERS if scorers is None else scorers)
        self.rng = rng or random.Random()

    @classmethod
    def build(cls, weights: ScoringWeights | None, rng: random.Random) -> KVRoutePolicy:
        return cls(weights, rng=rng)

    def score(self, c: Candidate, req: RequestShape) -> Scored:
        """One candidate's cost with its per-scorer terms."""
        terms = {name: fn(c, req, self.weights) for name, fn in self.scorers.items()}
        return Scored(c, sum(terms.values()), terms)

    def costs(self, cands: Sequence[Candidate], req: RequestShape) -> list[float]:
        """Every candidate's cost, equal to ``score(c, req).cost`` bit for bit. With the default
        scorers the sum is written out in their order (same float operations, no call per term and
        no terms dict: several times cheaper per candidate; bench/router.py times the decision)."""
        w = self.weights
        if self.scorers != DEFAULT_SCORERS:
            fns = tuple(self.scorers.values())
            return [sum(fn(c, req, w) for fn in fns) for c in cands]
        prompt, block = req.prompt_tokens, req.block_size
        cpu_w, work_w, backlog_w = w.cpu_match_weight, w.prefill_work_weight, w.backlog_work_weight
        footprint_w, kv_w, flight_w = w.kv_footprint_weight, w.kv_usage_weight, w.in_flight_weight
        out = []
        for c in cands:
            u = max(prompt - block * (c.match.gpu + cpu_w * c.match.cpu), 1.0)  # uncached_tokens
            rate, decode_s = prefill_rate(c, w), decode_step_seconds(c, w)
            out.append(
                0 + (c.queued_prefill_tokens + u) / rate + c.running * decode_s
                + (work_w + backlog_w * c.waiting) * u / rate
                + footprint_w * c.kv_usage * prompt / rate
                + c.kv_usage * kv_w + c.in_flight * flight_w
            )
        return out

    def choose(self, cands: Sequence[Candidate], req: RequestShape) -> tuple[Candidate | None, list[Scored]]:
        costs = self.costs(cands, req)
        scored = [Scored(c, cost) for c, cost in zip(cands, costs, strict=True)]
        return pick_lowest(scored, self.rng), scored


__all__ = ["KVRoutePolicy"]
