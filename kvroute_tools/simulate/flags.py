"""The flags of ``kvroute simulate`` (and ``kvroute demo``), argparse only: building the parser
imports neither the router nor the replica packages, only the leaf that declares the cost model's
weights (``router.weights``), whose fields are the same flags as the router's."""

from __future__ import annotations

import argparse
import dataclasses

from kvroute_tools.trace import TRACE_BLOCK_TOKENS
from router.weights import ScoringWeights

# (flag, TimingModel field, unit of the flag in seconds, what it is)
TIMING_FLAGS = (("step_overhead_ms", "overhead_s", 1e-3, "fixed cost of a step, ms"),
                ("model_read_ms", "weights_s", 1e-3, "reading the model's weights once (a step's floor), ms"),
                ("token_us", "token_s", 1e-6, "compute per scheduled token once compute bound, us"),
                ("kv_token_ns", "kv_token_s", 1e-9, "reading one context token's KV, ns"))


def add_arguments(p: argparse.ArgumentParser, *, requests: int | None, replicas: str, policies: str) -> None:
    """The simulate flags, with these defaults (``kvroute demo`` passes smaller ones)."""
    p.add_argument("--trace", default=None, help="Mooncake-format JSONL (default: the bundled conversation trace)")
    p.add_argument("--requests", type=int, default=requests, help=f"the first N requests (default: {requests or 'all'})")
    p.add_argument("--replicas", default=replicas, help="replica counts, comma-separated (default %(default)s)")
    p.add_argument("--policies", default=policies, help="comma-separated policy names of router.policies.registry (default %(default)s)")
    p.add_argument("--tokens-per-block", type=int, default=TRACE_BLOCK_TOKENS,
                   help="tokens per trace hash id (default %(default)s, the trace's own, as kvroute bench)")
    p.add_argument("--block-size", type=int, default=None, help="KV block size (default: tokens per block)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per replica (default: what the timing model's GPU holds)")
    p.add_argument("--cache-fraction", type=float, default=None,
                   help="cluster KV capacity as a fraction of the trace's distinct blocks (instead of --num-blocks)")
    p.add_argument("--cpu-blocks", type=int, default=0, help="CPU-tier blocks per replica (default 0)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per step (default 8192)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="running requests per replica at most")
    p.add_argument("--time-scale", type=float, default=1.0, help="arrival = timestamp x this (default 1)")
    p.add_argument("--load", type=float, default=None,
                   help="scale arrivals to this fraction of the modelled capacity, e.g. 0.7 (overrides --time-scale)")
    p.add_argument("--output-scale", type=float, default=1.0, help="outputs = round(output_length x this)")
    p.add_argument("--event-delay-ms", type=float, default=10.0, help="KV events reach the router this long after their step, ms (default 10)")
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="heartbeat period (default 1 s)")
    p.add_argument("--speculative-ttl", type=float, default=2.0, help="the router's speculative entries, seconds")
    p.add_argument("--routers", type=int, default=1,
                   help="routers splitting the stream, request i to router i mod N (default 1)")
    p.add_argument("--load-sync-interval", type=float, default=0.2,
                   help="with --routers > 1: seconds between each router's exchange of load and speculative "
                        "entries with the others, the live router's load_sync_interval (default 0.2; 0: before "
                        "every decision)")
    for f in dataclasses.fields(ScoringWeights):  # the router's own flags for its cost model
        p.add_argument("--" + f.name.replace("_", "-"), type=float, default=None,
                       help=f"kvroute's cost model: {f.metadata['help']} (default {f.default})")
    p.add_argument("--calibration", default=None, help="JSON file of TimingModel fields (overridden by the flags below)")
    for flag, _, _, what in TIMING_FLAGS:
        p.add_argument("--" + flag.replace("_", "-"), type=float, default=None, help=f"timing model: {what}")
    p.add_argument("--seed", type=int, default=0, help="seed of the policies' tie breaks")
    p.add_argument("--out", default=None, help="write simulate.json and PNG charts into this folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


__all__ = ["TIMING_FLAGS", "add_arguments"]
