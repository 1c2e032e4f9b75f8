"""The one table of routing policies, name -> class: what the router's ``--policy`` and
``SetPolicy``, ``kvroute bench --policies`` and ``kvroute simulate --policies`` accept.

``LIVE_POLICIES`` are the live router's choices; ``PEER_POLICIES``, the peers' re-implementations,
need the simulator's hooks (``router.policies.base``), which the live router does not drive, so
only ``kvroute simulate`` runs them.

Imports: the policy modules of this package and router.scoring (no I/O).
"""

from __future__ import annotations

import random

from router.policies.base import Policy
from router.policies.baselines import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy
from router.policies.chwbl import BoundedLoadHashPolicy
from router.policies.dynamo import DynamoKVPolicy
from router.policies.kvroute import KVRoutePolicy
from router.policies.llmd import LlmdPolicy
from router.policies.sglang import SGLangCacheAwarePolicy
from router.scoring import ScoringWeights

LIVE_POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (KVRoutePolicy, RoundRobinPolicy, LeastLoadedPolicy, RandomPolicy)
}
PEER_POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (SGLangCacheAwarePolicy, LlmdPolicy, DynamoKVPolicy, BoundedLoadHashPolicy)
}
POLICIES: dict[str, type[Policy]] = {**LIVE_POLICIES, **PEER_POLICIES}

POLICY_NAMES = tuple(LIVE_POLICIES)
"""The live router's choices (its ``--policy`` setting, ``SetPolicy``, ``kvroute bench``)."""
PEER_POLICY_NAMES = tuple(PEER_POLICIES)
ALL_POLICY_NAMES = tuple(POLICIES)
"""Every policy ``kvroute simulate`` can run."""


def make_policy(name: str, weights: ScoringWeights | None = None, seed: int | None = None,
                rng: random.Random | None = None) -> Policy:
    """A fresh policy by name (one of ALL_POLICY_NAMES) with the cost ``weights`` (used by
    ``kvroute``) and a generator seeded with ``seed`` for ties (None: from the OS), or ``rng``
    itself (several policies drawing from one generator: the simulator's routers).

    Raises:
        ValueError: an unknown name; the message names the valid ones.
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"policy: unknown {name!r}; expected one of {', '.join(ALL_POLICY_NAMES)}")
    return cls.build(weights, rng if rng is not None else random.Random(seed))


__all__ = ["ALL_POLICY_NAMES", "LIVE_POLICIES", "PEER_POLICIES", "PEER_POLICY_NAMES", "POLICIES", "POLICY_NAMES",
           "make_policy"]
