"""Picking among the best-scored candidates, shared by the peer policies."""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.scoring import Candidate, Scored


def pick_lowest(scored: Sequence[Scored], rng: random.Random) -> Candidate | None:
    """The candidate of lowest cost; exact ties at random (None when there is none)."""
    if not scored:
        return None
    best = min(s.cost for s in scored)
    ties = [s.candidate for s in scored if s.cost == best]
    return ties[0] if len(ties) == 1 else rng.choice(ties)
