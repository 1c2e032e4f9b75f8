"""What a bench run measured and how it is shown: per-request results, per-policy summaries
(hit rate, TTFT / TPOT percentiles, requests per replica), the table ``kvroute bench`` prints,
``bench.json`` and the ``bench.png`` chart (``--out``)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvroute.counted import counted
from kvroute_tools.bench.config import BenchConfig


@dataclass
class RequestResult:
    index: int
    error: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    replica_id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    predicted_cached_tokens: int = 0

    def measured(self, t0: float, first: float | None, last: float | None, prompt_tokens: int,
                 completion_tokens: int, cached_tokens: int) -> None:
        """Record a finished request's usage and timings: sent at ``t0``, first and last token
        seen at ``first`` / ``last`` (``time.perf_counter`` seconds; None: no token seen)."""
        self.ttft_s = (first - t0) if first is not None else None
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = prompt_tokens, completion_tokens, cached_tokens
        if completion_tokens > 1 and first is not None and last is not None:
            self.tpot_s = (last - first) / (completion_tokens - 1)


@dataclass
class PolicyResult:
    """One policy's run. ``hit_rate`` is the replicas' counters' delta (``hit_rate_source``
    "replica counters"), or cached / prompt tokens of the responses when a replica was unreachable."""

    policy: str
    cache_salt: str
    wall_s: float
    results: list[RequestResult]
    prefix_cache_queries: int | None
    prefix_cache_hits: int | None
    preemptions: int | None
    routed_past: tuple[int, int] = (0, 0)  # bench.plan.routed_past: (requests, tokens)

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.error is None]

    @property
    def errors(self) -> int:
        return len(self.results) - len(self.ok)

    @property
    def hit_rate_source(self) -> str:
        return "replica counters" if self.prefix_cache_queries else "response usage"

    @property
    def hit_rate(self) -> float:
        if self.prefix_cache_queries:
            return (self.prefix_cache_hits or 0) / self.prefix_cache_queries
        prompt = sum(r.prompt_tokens for r in self.ok)
        return sum(r.cached_tokens for r in self.ok) / prompt if prompt else 0.0

    def percentile(self, attr: str, q: float) -> float | None:
        values = [getattr(r, attr) for r in self.ok if getattr(r, attr) is not None]
        return float(np.percentile(values, q)) if values else None

    def share(self) -> dict[str, int]:
        return dict(sorted(Counter(r.replica_id for r in self.ok).items()))

    def prediction_accuracy(self) -> float | None:
        """Sum of predicted cached tokens over sum of actual cached tokens (1.0 = exact)."""
        actual = sum(r.cached_tokens for r in self.ok)
        return sum(r.predicted_cached_tokens for r in self.ok) / actual if actual else None

    def summary(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "cache_salt": self.cache_salt, "requests": len(self.results),
            "errors": self.errors, "hit_rate": self.hit_rate, "hit_rate_source": self.hit_rate_source,
            "prefix_cache_queries": self.prefix_cache_queries, "prefix_cache_hits": self.prefix_cache_hits,
            "preemptions": self.preemptions,
            "ttft_p50_s": self.percentile("ttft_s", 50), "ttft_p99_s": self.percentile("ttft_s", 99),
            "tpot_p50_s": self.percentile("tpot_s", 50), "latency_p50_s": self.percentile("latency_s", 50),
            "requests_per_replica": self.share(), "predicted_over_actual_cached": self.prediction_accuracy(),
            "prompt_tokens": sum(r.prompt_tokens for r in self.ok),
            "completion_tokens": sum(r.completion_tokens for r in self.ok),
            "wall_s": self.wall_s,
            "routed_past_a_longer_prefix": {"requests": self.routed_past[0], "tokens": self.routed_past[1]},
            "error_samples": sorted({r.error for r in self.results if r.error})[:5],
        }


@dataclass
class BenchReport:
    config: BenchConfig
    model: str
    block_size: int
    replicas: dict[str, str]  # replica_id -> address
    bounds: dict[str, float]
    num_requests: int
    prompt_tokens: int
    truncated: int
    policies: list[PolicyResult] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": {k: v for k, v in asdict(self.config).items() if k != "admin_token"}, "model": self.model, "block_size": self.block_size,
            "replicas": self.replicas, "bounds": self.bounds, "requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens, "truncated_prompts": self.truncated,
            "policies": [p.summary() for p in self.policies],
            "per_request": {p.policy: [asdict(r) for r in p.results] for p in self.policies},
        }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def format_report(report: BenchReport) -> str:
    """One table, a row per policy, and the bounds from the hash ids next to it."""
    ids = list(report.replicas)
    ideal, rr = report.bounds["ideal"], report.bounds["round_robin"]
    head = (f"{'policy':<14}{'requests':>9}{'errors':>8}{'hit rate':>10}{'of ideal':>10}"
            f"{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}   requests per replica (%)")
    lines = [head]
    for p in report.policies:
        share = p.share()
        n = max(len(p.ok), 1)
        shares = "/".join(f"{100 * share.get(rid, 0) / n:.0f}" for rid in ids)
        lines.append(
            f"{p.policy:<14}{len(p.results):>9}{p.errors:>8}{p.hit_rate:>10.3f}"
            f"{(p.hit_rate / ideal if ideal else 0):>10.0%}{_ms(p.percentile('ttft_s', 50)):>10}"
            f"{_ms(p.percentile('ttft_s', 99)):>10}{_ms(p.percentile('tpot_s', 50)):>10}   {shares}"
        )
    lines.append("")
    lines.append(f"bounds from the hash ids alone ({counted(report.num_requests, 'request')}, infinite caches): "
                 f"ideal {ideal:.3f}, round robin over {len(ids)} {rr:.3f}")
    sources = {p.hit_rate_source for p in report.policies}
    lines.append(f"hit rate = prefix-cache hit tokens / queried tokens ({', '.join(sorted(sources))}); "
                 f"replicas: {', '.join(ids)}")
    for p in report.policies:
        n, tokens = p.routed_past
        if n:
            lines.append(f"{p.policy}: {counted(n, 'request')} went past a longer prefix another replica held "
                         f"({tokens / max(report.prompt_tokens, 1):.4f} of the prompt tokens, against infinite caches)")
    by_name = {p.policy: p for p in report.policies}
    if "kvroute" in by_name and "round_robin" in by_name:
        k, r = by_name["kvroute"], by_name["round_robin"]
        kt, rt = k.percentile("ttft_s", 50), r.percentile("ttft_s", 50)
        ratio = f"{k.hit_rate / r.hit_rate:.2f}x" if r.hit_rate else "-"
        ttft = f", TTFT p50 {kt / rt:.2f}x" if kt and rt else ""
        lines.append(f"kvroute vs round_robin: hit rate {ratio}{ttft}")
    errs = [(p.policy, e) for p in report.policies for e in p.summary()["error_samples"]]
    for policy, e in errs[:5]:
        lines.append(f"error ({policy}): {e}")
    return "\n".join(lines)


def write_outputs(report: BenchReport, out_dir: str | Path) -> tuple[Path, Path]:
    """``bench.json`` (summary + per-request numbers) and ``bench.png`` (hit rate vs the bounds,
    TTFT p50/p99) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "bench.json"
    json_path.write_text(json.dumps(report.to_json(), indent=1) + "\n", encoding="utf-8")
    png_path = out / "bench.png"
    _chart(report, png_path)
    return json_path, png_path


def _chart(report: BenchReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [p.policy for p in report.policies]
    x = np.arange(len(names))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(x, [p.hit_rate for p in report.policies], color="tab:blue")
    ax1.axhline(report.bounds["ideal"], ls="--", color="tab:green", label="ideal (one infinite cache)")
    ax1.axhline(report.bounds["round_robin"], ls=":", color="tab:red",
                label=f"round robin over {len(report.replicas)} infinite caches")
    ax1.set_xticks(x, names)
    ax1.set_ylabel("prefix cache hit rate (tokens)")
    ax1.set_ylim(0, 1.35 * max([report.bounds["ideal"], *(p.hit_rate for p in report.policies)], default=0) or 1)
    ax1.legend(fontsize=8, loc="upper right")
    ax1.set_title("hit rate vs the bounds from the trace")
    w = 0.38
    p50 = [1000 * (p.percentile("ttft_s", 50) or 0) for p in report.policies]
    p99 = [1000 * (p.percentile("ttft_s", 99) or 0) for p in report.policies]
    ax2.bar(x - w / 2, p50, w, label="p50")
    ax2.bar(x + w / 2, p99, w, label="p99")
    ax2.set_xticks(x, names)
    ax2.set_ylabel("time to first token (ms)")
    ax2.legend(fontsize=8)
    ax2.set_title("TTFT")
    fig.suptitle(f"kvroute bench: {counted(report.num_requests, 'request')}, {counted(len(report.replicas), 'replica')}, {report.model}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["BenchReport", "PolicyResult", "RequestResult", "format_report", "write_outputs"]
