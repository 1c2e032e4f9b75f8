"""The simulation's outputs: one table row per (replica count, policy), JSON, PNG charts.

Metrics of a row: hit rate in prompt tokens (each request's cached tokens at its first admission /
its prompt tokens), its share of the pooled oracle, TTFT mean / p50 / p99 and TPOT p50 / p99 in
milliseconds (TPOT: (finish - first token) / (outputs - 1), requests with 2+ outputs), mean queue
(waiting requests per replica, sampled at heartbeats), load imbalance (most requests routed to one
replica / the mean), stepping (the share of the virtual time the replicas spent in steps: any
running request keeps a replica stepping, so it is not utilization), preemptions, and the router's
decision time per request (wall microseconds of decide + commit). Percentiles are nearest-rank.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from kvroute.counted import counted
from kvroute_tools.simulate.cluster import PolicyRun
from kvroute_tools.simulate.oracles import OracleRates


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence (nan when empty)."""
    if not sorted_values:
        return math.nan
    return sorted_values[max(0, math.ceil(q / 100 * len(sorted_values)) - 1)]


def summarize(run: PolicyRun, oracle: OracleRates) -> dict:
    """One row's metrics (module docstring) as a JSON-ready dict."""
    reqs = run.requests
    prompt = sum(r.prompt_tokens for r in reqs)
    hit = sum(r.cached_tokens for r in reqs) / prompt if prompt else 0.0
    ttft = sorted(r.first_token_s - r.arrival_s for r in reqs)
    tpot = sorted((r.finish_s - r.first_token_s) / (r.output_tokens - 1) for r in reqs if r.output_tokens > 1)
    mean_routed = sum(run.routed) / len(run.routed)
    return {
        "replicas": run.replicas, "routers": run.routers, "policy": run.policy, "requests": len(reqs), "hit_rate": hit,
        "pooled_share": hit / oracle.pooled if oracle.pooled else math.nan,
        "ttft_mean_ms": 1e3 * sum(ttft) / len(ttft) if ttft else math.nan,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "tpot_p50_ms": 1e3 * percentile(tpot, 50), "tpot_p99_ms": 1e3 * percentile(tpot, 99),
        "mean_queue": sum(run.queue_samples) / len(run.queue_samples) if run.queue_samples else 0.0,
        "imbalance": max(run.routed) / mean_routed if mean_routed else math.nan,
        "preemptions": run.preemptions,
        "decide_us": 1e6 * sum(run.decide_s) / len(run.decide_s) if run.decide_s else math.nan,
        "busy": sum(run.busy_s) / (len(run.busy_s) * run.end_s) if run.end_s > 0 else 0.0,
        "wall_s": run.wall_s, "virtual_s": run.end_s,
        "ttft_cdf_ms": [1e3 * percentile(ttft, q) for q in range(1, 101)],
    }


_COLUMNS = (("policy", "policy", "{:<19}", 19), ("hit", "hit_rate", "{:.4f}", 7), ("%pooled", "pooled_share", "{:.1%}", 8),
            ("TTFT mean", "ttft_mean_ms", "{:.0f}", 10), ("p50", "ttft_p50_ms", "{:.0f}", 7),
            ("p99", "ttft_p99_ms", "{:.0f}", 8), ("TPOT p50", "tpot_p50_ms", "{:.1f}", 9),
            ("p99", "tpot_p99_ms", "{:.1f}", 7), ("queue", "mean_queue", "{:.2f}", 7),
            ("max/mean", "imbalance", "{:.2f}", 9), ("stepping", "busy", "{:.0%}", 9), ("preempt", "preemptions", "{}", 8),
            ("decide us", "decide_us", "{:.0f}", 10), ("wall s", "wall_s", "{:.1f}", 7))


def format_table(rows: Sequence[dict], oracle: OracleRates, header: str) -> str:
    """The table of one replica count, with the oracles under it (times in ms)."""
    lines = [header, "".join(f"{t:<{w}}" if k == "policy" else f"{t:>{w}}" for t, k, _, w in _COLUMNS)]
    for row in rows:
        lines.append("".join(f.format(row[k]).ljust(w) if k == "policy" else f"{f.format(row[k]):>{w}}"
                             for _, k, f, w in _COLUMNS))
    lines.append(f"oracles (hit rate in prompt tokens): ideal {oracle.ideal:.4f}, pooled LRU {oracle.pooled:.4f},"
                 f" round robin over unlimited caches {oracle.round_robin:.4f}")
    return "\n".join(lines)


def write_outputs(out: str | Path, rows: Sequence[dict], oracles: dict[int, OracleRates], meta: dict) -> list[Path]:
    """``simulate.json`` and the charts (hit rate and TTFT mean against replica count, TTFT CDF per
    policy for each replica count) into ``out``; returns the files written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "oracles": {str(n): vars(o) for n, o in oracles.items()}, "rows": list(rows)}
    files = [out / "simulate.json"]
    files[0].write_text(json.dumps(doc, indent=1, default=float) + "\n", encoding="utf-8")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted(oracles)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for p in policies:
        pts = sorted((r["replicas"], r["hit_rate"], r["ttft_mean_ms"]) for r in rows if r["policy"] == p)
        ax_hit.plot([x for x, _, _ in pts], [h for _, h, _ in pts], marker="o", label=p)
        ax_ttft.plot([x for x, _, _ in pts], [t for _, _, t in pts], marker="o", label=p)
    for name, style in (("ideal", ":"), ("pooled", "--"), ("round_robin", "-.")):
        ax_hit.plot(counts, [getattr(oracles[n], name) for n in counts], "k" + style, label=f"oracle: {name}")
    ax_hit.set(xlabel="replicas", ylabel="prefix cache hit rate (tokens)", xscale="log", title="hit rate")
    ax_ttft.set(xlabel="replicas", ylabel="TTFT mean (ms)", xscale="log", yscale="log", title="TTFT mean")
    for ax in (ax_hit, ax_ttft):
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.minorticks_off()
    ax_hit.legend(fontsize=7)
    fig.tight_layout()
    files.append(out / "hit_ttft_vs_replicas.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    for n in counts:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for r in rows:
            if r["replicas"] == n:
                ax.plot(r["ttft_cdf_ms"], [q / 100 for q in range(1, 101)], label=r["policy"])
        ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", xscale="log", title=f"TTFT CDF, {counted(n, 'replica')}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        files.append(out / f"ttft_cdf_{n}.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files


__all__ = ["format_table", "percentile", "summarize", "write_outputs"]
