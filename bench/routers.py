"""Two routers splitting one stream against one router: the ``make run`` replay through each.

    python bench/routers.py [--replicas 4] [--num-blocks 14336] [--requests 1000] [--routers 2]

What runs: ``kvroute up`` with ``--replicas`` replicas and ``--routers`` routers on one Redis
(the default tiny model, ``--num-blocks`` KV blocks each), then the Makefile's ``run`` replay
(``kvroute bench`` with its flags: 16 tokens per trace block, outputs 2% of the trace's, 16 in
flight, kvroute and round robin taking turns every 200 requests) twice on that cluster: through
the first router alone, then through all of them, request i to router i mod N
(``--target a,b``). Each bench run has its own cache salts, so the second run hits nothing the
first cached; the caches hold a run's two working sets, and the LRU evicts the older run's blocks
first. One cluster for both runs: the replicas and the machine are the same.

Printed: per policy and router count, the hit rate (the replicas' counters), its share of the
ideal, TTFT p50, the requests per replica (%) and the largest replica share; then the goal line:
two routers' kvroute hit rate within 0.005 of one router's (docs/results.md has the run).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import busy_cores, print_table  # noqa: E402
from kvroute_tools.bench.config import BenchConfig  # noqa: E402
from kvroute_tools.bench.report import PolicyResult  # noqa: E402
from kvroute_tools.bench.run import run_bench  # noqa: E402
from kvroute_tools.cluster import ClusterConfig, LocalCluster  # noqa: E402

GOAL = 0.005
"""The largest difference between one router's and N routers' kvroute hit rate."""
MAKE_RUN = dict(requests=1000, tokens_per_block=16, output_scale=0.02, concurrency=16, interleave=200,
                policies=("kvroute", "round_robin"))
"""The Makefile's ``run`` bench flags (its ``kvroute up`` is --replicas 4 --num-blocks 14336)."""


@dataclass
class Measured:
    """One bench run's policies, through ``routers`` routers."""

    routers: int
    policies: dict[str, PolicyResult]
    ideal: float
    replicas: list[str]


def measure(replicas: int, num_blocks: int, routers: int = 2, *, log=print, **bench) -> list[Measured]:
    """Start the cluster, run the replay through the first router and then through all
    ``routers``; ``bench`` overrides :data:`MAKE_RUN`'s flags (BenchConfig fields)."""
    flags = {**MAKE_RUN, **bench}
    cluster = LocalCluster(ClusterConfig(replicas=replicas, routers=routers, router_port=0, router_http_port=-1,
                                         num_blocks=num_blocks), log=log)
    try:
        cluster.start()
        out = []
        for targets in (cluster.router_targets[:1], cluster.router_targets):
            cfg = BenchConfig(target=",".join(targets), admin_token=cluster.admin_token, progress=False, **flags)
            report = asyncio.run(run_bench(cfg, log=log))
            out.append(Measured(len(targets), {p.policy: p for p in report.policies}, report.bounds["ideal"],
                                list(report.replicas)))
        return out
    finally:
        cluster.stop()


def shares(p: PolicyResult, replicas: list[str]) -> list[float]:
    """Each replica's share of the policy's successful requests, in replica order."""
    counts = p.share()
    n = max(len(p.ok), 1)
    return [counts.get(r, 0) / n for r in replicas]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=14336)
    ap.add_argument("--requests", type=int, default=MAKE_RUN["requests"])
    ap.add_argument("--routers", type=int, default=2)
    a = ap.parse_args()
    busy = busy_cores()
    runs = measure(a.replicas, a.num_blocks, a.routers, requests=a.requests)
    rows = []
    for run in runs:
        for name, p in run.policies.items():
            split = shares(p, run.replicas)
            ttft = p.percentile("ttft_s", 50)
            rows.append([name, run.routers, len(p.results), p.errors, f"{p.hit_rate:.4f}",
                         f"{p.hit_rate / run.ideal:.1%}" if run.ideal else "-",
                         f"{ttft * 1000:.0f} ms" if ttft is not None else "-",
                         "/".join(f"{100 * s:.0f}" for s in split), f"{max(split):.2f}"])
    print()
    load = f"; the machine was {busy:.1f} cores busy before" if busy is not None else ""
    print(f"make run's replay, {a.replicas} replicas x {a.num_blocks} blocks, {a.requests} requests{load}")
    print_table(["policy", "routers", "requests", "errors", "hit rate", "of ideal", "TTFT p50",
                 "requests per replica (%)", "largest share"], rows)
    one, many = (r.policies["kvroute"].hit_rate for r in runs)
    ok = abs(many - one) <= GOAL
    print(f"goal: {a.routers} routers' kvroute hit rate within {GOAL} of one router's: {many:.4f} vs {one:.4f} "
          f"(difference {many - one:+.4f}) -> {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
