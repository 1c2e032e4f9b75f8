"""The flags of ``kvroute simulate`` (and ``kvroute demo``), argparse only: building the parser
imports neither the router nor the replica packages."""

from __future__ import annotations

import argparse

TIMING_FLAGS = (("step_overhead_ms", "overhead_s", 1e-3), ("weights_ms", "weights_s", 1e-3),
                 ("token_us", "token_s", 1e-6), ("kv_token_ns", "kv_token_s", 1e-9))


def add_arguments(p: argparse.ArgumentParser, *, requests: int | None, replicas: str, policies: str) -> None:
    """The simulate flags, with these defaults (``kvroute demo`` passes smaller ones)."""
    p.add_argument("--trace", default=None, help="Mooncake-format JSONL (default: the bundled conversation trace)")
    p.add_argument("--requests", type=int, default=requests, help="the first N requests (default: %(default)s, None = all)")
    p.add_argument("--replicas", default=replicas, help="replica counts, comma-separated (default %(default)s)")
    p.add_argument("--policies", default=policies, help="comma-separated policy names (router.scoring.make_policy's)")
    p.add_argument("--tokens-per-block", type=int, default=512, help="tokens per trace hash id (default 512)")
    p.add_argument("--block-size", type=int, default=None, help="KV block size (default: tokens per block)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per replica")
    p.add_argument("--cache-fraction", type=float, default=None,
                   help="cluster KV capacity as a fraction of the trace's distinct blocks (instead of --num-blocks)")
    p.add_argument("--cpu-blocks", type=int, default=0, help="CPU-tier blocks per replica (default 0)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per step (default 8192)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="running requests per replica at most")
    p.add_argument("--time-scale", type=float, default=1.0, help="arrival = timestamp x this (default 1)")
    p.add_argument("--load", type=float, default=None,
                   help="scale arrivals to this fraction of the modelled capacity, e.g. 0.7 (overrides --time-scale)")
    p.add_argument("--output-scale", type=float, default=1.0, help="outputs = round(output_length x this)")
    p.add_argument("--event-delay-ms", type=float, default=10.0, help="KV events reach the router after this")
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="heartbeat period (default 1 s)")
    p.add_argument("--speculative-ttl", type=float, default=2.0, help="the router's speculative entries, seconds")
    p.add_argument("--weights", default="",
                   help="kvroute cost model weights, NAME=VALUE,... of router.scoring.ScoringWeights' fields "
                        "(e.g. prefill_work_weight=5,kv_usage_weight=0.5)")
    p.add_argument("--calibration", default=None, help="JSON file of TimingModel fields (overridden by the flags below)")
    for flag, _, _ in TIMING_FLAGS:
        p.add_argument("--" + flag.replace("_", "-"), type=float, default=None, help="timing model override")
    p.add_argument("--seed", type=int, default=0, help="seed of the policies' tie breaks")
    p.add_argument("--out", default=None, help="write simulate.json and PNG charts into this folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


__all__ = ["TIMING_FLAGS", "add_arguments"]
