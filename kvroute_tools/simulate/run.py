"""``kvroute simulate``: the command's driver (flags -> plans -> runs -> table, JSON, charts).

For each replica count: size the caches (``--num-blocks`` per replica, or ``--cache-fraction`` of
the trace's distinct blocks for the whole cluster, or the timing model's deployment capacity),
scale the arrivals (``--load`` of the modelled capacity, or ``--time-scale``), compute the oracles,
then replay the trace once per policy. ``kvroute demo`` is this command with small defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass

from kvroute.counted import counted
from kvroute_tools.simulate.cluster import SimConfig, SimError, simulate
from kvroute_tools.simulate.flags import TIMING_FLAGS
from kvroute_tools.simulate.oracles import OracleRates, oracle_rates, ttft_floor, unique_blocks
from kvroute_tools.simulate.report import format_table, summarize, write_outputs
from kvroute_tools.simulate.timing import TimingModel
from kvroute_tools.simulate.workload import time_scale_for_load
from kvroute_tools.trace import BUNDLED_TRACE, TraceRequest, load_mooncake
from router.policies.registry import ALL_POLICY_NAMES
from router.weights import WEIGHT_NAMES, ScoringWeights


@dataclass
class Plan:
    """Everything a run needs, checked: the trace, the configs per replica count, the policies."""

    trace: list[TraceRequest]
    trace_name: str
    configs: list[SimConfig]
    policies: tuple[str, ...]
    timing: TimingModel


def build_plan(args: argparse.Namespace) -> Plan:
    """Check the flags and load the trace. Raises ValueError (one line naming the flag)."""
    policies = tuple(s.strip() for s in args.policies.split(",") if s.strip())
    for name in policies:
        if name not in ALL_POLICY_NAMES:
            raise ValueError(f"--policies: unknown {name!r}; expected some of {', '.join(ALL_POLICY_NAMES)}")
    try:
        counts = [int(s) for s in args.replicas.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--replicas: expected comma-separated integers, got {args.replicas!r}") from None
    if not counts or min(counts) < 1 or not policies:
        raise ValueError("--replicas and --policies: need at least one each, replicas >= 1")
    if args.requests is not None and args.requests < 1:
        raise ValueError(f"--requests: must be >= 1, got {args.requests}")
    if args.routers < 1:
        raise ValueError(f"--routers: must be >= 1, got {args.routers}")
    if not args.load_sync_interval >= 0:
        raise ValueError(f"--load-sync-interval: must be >= 0, got {args.load_sync_interval}")
    if args.cache_fraction is not None and not args.cache_fraction > 0:
        raise ValueError(f"--cache-fraction: must be > 0, got {args.cache_fraction}")
    timing = TimingModel.from_file(args.calibration) if args.calibration else TimingModel()
    overrides = {field: getattr(args, flag) * unit for flag, field, unit, _ in TIMING_FLAGS
                 if getattr(args, flag) is not None}
    timing = dataclasses.replace(timing, **overrides)
    wkw = {name: getattr(args, name) for name in WEIGHT_NAMES if getattr(args, name) is not None}
    weights = ScoringWeights(**wkw)  # a bad value: ValueError naming the weight
    path = args.trace or BUNDLED_TRACE
    trace = load_mooncake(path, limit=args.requests)
    if not trace:
        raise ValueError(f"--trace: {path} holds no request")
    T = args.tokens_per_block
    B = args.block_size or T
    unique = unique_blocks(trace, T, B) if args.cache_fraction is not None else 0
    configs = []
    for n in counts:
        if args.num_blocks is not None:
            blocks = args.num_blocks
        elif args.cache_fraction is not None:
            blocks = -(-int(args.cache_fraction * unique) // n) + 1
        else:
            blocks = timing.capacity_tokens(B) // B + 1
        scale = (time_scale_for_load(trace, n, args.load, timing, T, args.output_scale)
                 if args.load is not None else args.time_scale)
        configs.append(SimConfig(
            replicas=n, num_blocks=blocks, block_size=B, tokens_per_block=T, cpu_blocks=args.cpu_blocks,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs, timing=timing,
            time_scale=scale, output_scale=args.output_scale, event_delay_s=args.event_delay_ms / 1000,
            heartbeat_s=args.heartbeat_s, speculative_ttl=args.speculative_ttl, weights=weights, seed=args.seed,
            routers=args.routers, load_sync_s=args.load_sync_interval,
        ))
    return Plan(trace, str(args.trace or BUNDLED_TRACE.name), configs, policies, timing)


def simulate_main(args: argparse.Namespace) -> int:
    """Run the plan in ``args.plan``; print the tables. 0, or 2 when a request cannot fit."""
    plan: Plan = args.plan
    print(f"kvroute simulate: {counted(len(plan.trace), 'request', spec=',')} of {plan.trace_name}; timing model: {plan.timing.name}")
    rows: list[dict] = []
    oracles: dict[int, OracleRates] = {}
    first = plan.configs[0]
    floor_s = ttft_floor(plan.trace, plan.timing, first.tokens_per_block, first.block_size, first.max_num_batched_tokens)
    print(f"TTFT floor (every request alone on an idle replica with the ideal oracle's hits): mean {floor_s * 1e3:,.0f} ms")
    for cfg in plan.configs:
        pooled = cfg.replicas * (cfg.num_blocks - 1 + cfg.cpu_blocks)  # every tier's blocks
        oracle = oracle_rates(plan.trace, cfg.replicas, pooled, cfg.tokens_per_block, cfg.block_size)
        oracles[cfg.replicas] = oracle
        group = []
        for name in plan.policies:
            bar = _bar(f"{cfg.replicas:>3} x {name}", len(plan.trace), not args.no_progress)
            try:
                run = simulate(plan.trace, cfg, name, progress=bar and (lambda i, b=bar: b.update(i - b.n)))
            except SimError as e:
                print(f"kvroute simulate: {e}", file=sys.stderr)
                return 2
            finally:
                if bar:
                    bar.close()
            group.append(summarize(run, oracle))
        rows += group
        print()
        routers = (f", {cfg.routers} routers syncing every {cfg.load_sync_s:g} s" if cfg.routers > 1 and cfg.load_sync_s
                   else f", {cfg.routers} routers syncing before every decision" if cfg.routers > 1 else "")
        print(format_table(group, oracle, f"{counted(cfg.replicas, 'replica')} x {counted(cfg.num_blocks - 1, 'block', spec=',')} of"
                                          f" {cfg.block_size} tokens, time scale {cfg.time_scale:.4g}{routers}"))
    if args.out:
        meta = {"trace": plan.trace_name, "requests": len(plan.trace), "timing": plan.timing.to_dict(),
                "ttft_floor_s": floor_s,
                "configs": [dataclasses.asdict(c) for c in plan.configs]}
        for f in write_outputs(args.out, rows, oracles, meta):
            print(f"wrote {f}")
    return 0


def _bar(desc: str, total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, mininterval=0.5 if sys.stderr.isatty() else 15.0)


__all__ = ["Plan", "build_plan", "simulate_main"]
