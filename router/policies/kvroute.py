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
    ScoredTable,
    Scorer,
    ScoringWeights,
    default_costs,
    pick_lowest_cost,
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
        """Every candidate's cost, equal to ``score(c, req).cost`` bit for bit: with the default
        scorers ``router.scoring.default_costs`` (no call per term, no terms dict; one compiled pass
        over a decision's CandidateTable), else the scorers' sum per candidate."""
        if self.scorers != DEFAULT_SCORERS:
            fns = tuple(self.scorers.values())
            return [sum(fn(c, req, self.weights) for fn in fns) for c in cands]
        return default_costs(cands, req, self.weights)

    def choose(self, cands: Sequence[Candidate], req: RequestShape) -> tuple[Candidate | None, Sequence[Scored]]:
        costs = self.costs(cands, req)
        return pick_lowest_cost(cands, costs, self.rng), ScoredTable(cands, costs)


__all__ = ["KVRoutePolicy"]
