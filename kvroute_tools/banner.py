"""``kvroute up``'s banner: what runs where, and what to try (kvroute_tools.cluster's ``banner``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvroute.counted import counted
from kvroute.redis_connect import redact

EXAMPLE_PROMPT = "The harbour town woke before the sun."


def banner_text(cluster: Any) -> str:
    """The banner of a started ``LocalCluster``: every process with its address and pid (Envoy's
    admin and log with ``--gateway envoy``), then commands to try against the front."""
    t = cluster.front_target

    def metrics(name: str) -> str:
        url = cluster.metrics_urls.get(name)
        return f"  metrics {url}" if url else ""

    routers = "a router" if len(cluster.routers) == 1 else counted(len(cluster.routers), "router")
    lines = [f"kvroute up: {counted(len(cluster.replicas), 'replica')} and {routers} are ready (logs in {cluster.log_dir})"]
    for c in cluster.routers:
        lines.append(f"  {c.name:<11} {c.target:<22} pid {c.pid}{metrics(c.name)}")
    if cluster.envoy is not None and cluster.envoy.child is not None:
        lines.append(f"  {'envoy':<11} {t:<22} pid {cluster.envoy.child.pid} (the front; admin {cluster.envoy.admin_url},"
                     f" log {cluster.envoy.log_path}; its endpoint picker: the router on {cluster.picker_target})")
    for c in cluster.replicas:
        lines.append(f"  {c.name:<11} {c.target:<22} pid {c.pid}{metrics(c.name)}")
    if cluster.redis is not None:
        lines.append(f"  {'redis':<11} {cluster.redis_url:<22} pid {cluster.redis.pid} (embedded)")
    else:
        lines.append(f"  {'redis':<11} {redact(cluster.redis_url)}")
    lines.append(f"  model       {cluster.model_dir}")
    lines.append(f"  admin token {cluster.admin_token_file} (SetPolicy: kvroute bench --admin-token-file)")
    lines += [
        "Try:",
        f"  kvroute generate --target {t} \"{EXAMPLE_PROMPT}\"",
        f"  grpcurl -plaintext -d '{{\"text\": \"{EXAMPLE_PROMPT}\", \"sampling\": {{\"max_tokens\": 16}}}}' "
        f"{t} kvroute.v1.GenerationService/GenerateStream",
        f"  kvroute bench --target {t} --admin-token-file {cluster.admin_token_file} --requests 200 --tokens-per-block 16",
    ]
    if cluster.router_http_url:
        whose = "the router's" if len(cluster.router_http_urls) == 1 else "the routers'"
        lines.insert(-4, f"  openai      {', '.join(cluster.router_http_urls)} ({whose} OpenAI-compatible HTTP API)")
        body = json.dumps({"model": Path(cluster.model_dir).name, "prompt": EXAMPLE_PROMPT, "max_tokens": 16})
        lines.append(f"  curl {cluster.router_http_url}/completions -H 'Content-Type: application/json' -d '{body}'")
    return "\n".join(lines)


__all__ = ["EXAMPLE_PROMPT", "banner_text"]
