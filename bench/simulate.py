"""Simulator speed: the whole conversation trace through ``kvroute simulate`` at 16 replicas.

    python bench/simulate.py [--replicas 16] [--policies kvroute] [--requests N]

One row per policy (columns: metric, value, goal, verdict): the CPU seconds of one replay of the
trace (``kvroute_tools.simulate.cluster.simulate``: every request routed by the real ``Router``,
decisions included, every step of the real scheduler and KV manager; oracles and trace loading
not included), its wall seconds, the router's mean decision time, and the virtual time simulated.
The setting is the simulation table's (docs/results.md): caches holding 25% of the trace's
distinct blocks in all, arrivals at 70% of the modelled capacity. Goal: <= 60 s on one core. The
simulation is single-threaded, so its CPU time is its time on one core; the wall time also shows
what the other processes on the machine took from it (the cores they kept busy are printed).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import busy_cores, print_table  # noqa: E402
from kvroute_tools.simulate.cluster import simulate  # noqa: E402
from kvroute_tools.simulate.flags import add_arguments  # noqa: E402
from kvroute_tools.simulate.run import build_plan  # noqa: E402

GOAL_S = 60.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p, requests=None, replicas="16", policies="kvroute")
    args = p.parse_args(argv)
    if args.cache_fraction is None and args.num_blocks is None:
        args.cache_fraction = 0.25
    if args.load is None:
        args.load = 0.7
    others = busy_cores()
    t0 = time.perf_counter()
    plan = build_plan(args)
    rows = []
    for cfg in plan.configs:
        for name in plan.policies:
            cpu0, wall0 = time.process_time(), time.perf_counter()
            run = simulate(plan.trace, cfg, name)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            decide_us = 1e6 * sum(run.decide_s) / len(run.decide_s)
            tag = f"{len(plan.trace):,} requests, {cfg.replicas} replicas, {name}"
            rows += [
                (f"CPU s, {tag}", f"{cpu:.1f}", f"<= {GOAL_S:.0f}", "PASS" if cpu <= GOAL_S else "MISS"),
                (f"wall s, {tag}", f"{wall:.1f}", "", ""),
                (f"router decide + commit, us/request ({name})", f"{decide_us:.0f}", "", ""),
                (f"virtual s simulated ({name})", f"{run.end_s:.0f}", "", ""),
            ]
    print(f"kvroute simulate bench: {plan.trace_name}, cache fraction {args.cache_fraction}, load {args.load},"
          f" python {sys.version.split()[0]}; other processes kept {others or 0:.1f} cores busy")
    print_table(("metric", "value", "goal", "verdict"), rows)
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
