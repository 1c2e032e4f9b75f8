"""Re-implementations of the routing policies of kvroute's peers, for comparison (DESIGN.md §7).

Consumes: ``router.scoring.Candidate`` lists (the router's index matches and load terms) and
``RequestShape``, like every ``router.scoring.Policy``. Produces: a pick and the candidates' scores.
Each module cites the published description it follows and says where it simplifies.

- ``sglang``: SGLang router's cache_aware (approximate tree of routed prompts, balance thresholds).
- ``llmd``: llm-d's precise prefix scorer + queue scorer + KV-usage scorer (weights 3 / 2 / 2).
- ``dynamo``: NVIDIA Dynamo's KV router cost (prefill blocks after overlap + decode blocks).
- ``chwbl``: consistent hashing with bounded load (KubeAI's PrefixHash, 125%).

Two need more than a Candidate carries, declared as attributes the caller reads:
``index_from_kv_events = False`` with ``speculative_ttl`` (the policy's "index" is its own routing
history: the router's speculative entries, no KV events) and ``observe_prompt(block_hashes)``
(called with the request's hash chain before ``decide``). ``block_capacity`` (blocks per replica)
is set by whoever knows it. ``kvroute simulate`` does all three; the live router does not yet, so
these names are not among ``router.scoring.POLICY_NAMES`` (the live choices).

Imports: router.scoring only (no I/O).
"""

PEER_POLICIES = ("sglang_cache_aware", "llmd", "dynamo", "chwbl")


def make_peer_policy(name: str, rng):
    """The peer policy ``name`` (one of PEER_POLICIES) with ``rng`` for ties. KeyError if unknown."""
    if name == "sglang_cache_aware":
        from router.policies.sglang import SGLangCacheAwarePolicy

        return SGLangCacheAwarePolicy(rng=rng)
    if name == "llmd":
        from router.policies.llmd import LlmdPolicy

        return LlmdPolicy(rng=rng)
    if name == "dynamo":
        from router.policies.dynamo import DynamoKVPolicy

        return DynamoKVPolicy(rng=rng)
    if name == "chwbl":
        from router.policies.chwbl import BoundedLoadHashPolicy

        return BoundedLoadHashPolicy()
    raise KeyError(name)


__all__ = ["PEER_POLICIES", "make_peer_policy"]
