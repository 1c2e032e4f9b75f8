"""Routing policies as plugins of one interface (DESIGN.md §5, §7).

- ``base``: :class:`~router.policies.base.Policy`, every hook the router and the simulator call.
- ``kvroute``: kvroute's own, the lowest estimated TTFT (the cost math is ``router.scoring``).
- ``baselines``: round robin, least loaded, random.
- peers, re-implemented from their published descriptions for comparison (each module cites its
  source and says where it simplifies): ``sglang`` (SGLang router's cache_aware), ``llmd`` (llm-d's
  prefix + queue + KV-usage scorers, 3 / 2 / 2), ``dynamo`` (NVIDIA Dynamo's KV router cost),
  ``chwbl`` (consistent hashing with bounded load, KubeAI's PrefixHash, 125%).
- ``registry``: name -> class, and ``make_policy``; the router, ``kvroute bench`` and
  ``kvroute simulate`` all take their names from it.

Imports: router.scoring (one way: scoring imports no policy), no I/O. This module imports nothing,
so importing one policy module loads only what it needs.
"""
