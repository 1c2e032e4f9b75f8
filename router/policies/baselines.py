"""The baselines the bench and the simulator compare kvroute against: round robin, least loaded,
random. None reads the cache.

Imports: router.scoring and router.policies.base.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.policies.base import Policy
from router.scoring import Candidate, RequestShape, Scored, ScoringWeights


class RoundRobinPolicy(Policy):
    """Cycles through the candidates in replica-id order (the classic baseline)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    @classmethod
    def build(cls, weights: ScoringWeights | None, rng: random.Random) -> RoundRobinPolicy:
        return cls()

    def choose(self, cands: Sequence[Candidate], req: RequestShape) -> tuple[Candidate | None, list[Scored]]:
        scored = [Scored(c, 0.0) for c in cands]
        if not cands:
            return None, scored
        ordered = sorted(cands, key=lambda c: c.replica_id)
        pick = ordered[self._next % len(ordered)]
        self._next += 1
        return pick, scored


class LeastLoadedPolicy(Policy):
    """Fewest in-flight + running requests (the waiting queue is not counted), ignoring the cache;
    ties at random."""

    name = "least_loaded"

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    def choose(self, cands: Sequence[Candidate], req: RequestShape) -> tuple[Candidate | None, list[Scored]]:
        scored = [Scored(c, float(c.in_flight + c.running)) for c in cands]
        if not scored:
            return None, scored
        best = min(s.cost for s in scored)
        return self.rng.choice([s.candidate for s in scored if s.cost == best]), scored


class RandomPolicy(Policy):
    """Any candidate, uniformly at random."""

    name = "random"

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    def choose(self, cands: Sequence[Candidate], req: RequestShape) -> tuple[Candidate | None, list[Scored]]:
        scored = [Scored(c, 0.0) for c in cands]
        return (self.rng.choice(list(cands)) if cands else None), scored


__all__ = ["LeastLoadedPolicy", "RandomPolicy", "RoundRobinPolicy"]
