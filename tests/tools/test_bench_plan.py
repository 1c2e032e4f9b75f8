"""``kvroute bench`` without a cluster: how trace lines become requests, and the table it prints."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from kvroute_tools.bench.config import BenchConfig
from kvroute_tools.bench.plan import hit_bounds, plan_requests, routed_past
from kvroute_tools.bench.report import BenchReport, PolicyResult, RequestResult, format_report
from kvroute_tools.client import describe_rpc_error
from kvroute_tools.cluster import ClusterConfig, LocalCluster
from kvroute_tools.trace import TraceRequest, TraceTokenizer
from kvroute_tools.up import substitute


def _req(ts: float, n: int, out: int, ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(ts, n, out, ids)


def test_plan_maps_equal_hash_ids_to_equal_prefixes_and_scales_output_and_time():
    trace = [_req(1000.0, 1024, 350, (1, 2)), _req(3000.0, 1536, 10, (1, 2, 3)), _req(4000.0, 512, 2000, (7,))]
    tok = TraceTokenizer(16, vocab_size=500)
    planned, truncated = plan_requests(trace, tok, output_scale=0.02, max_output_tokens=30, time_scale=0.5)
    assert truncated == 0
    assert [len(p.token_ids) for p in planned] == [32, 48, 16]
    assert planned[1].token_ids[:32] == planned[0].token_ids  # same ids, same tokens
    assert planned[2].token_ids[:16] != planned[0].token_ids[:16]
    # max(1, round(output_length * scale)) capped: 350 * .02 = 7; 10 * .02 -> 0 -> 1; 2000 * .02 = 40 -> 30
    assert [p.max_tokens for p in planned] == [7, 1, 30]
    assert [p.arrival_s for p in planned] == [0.0, 1.0, 1.5]  # (timestamp - first) * time_scale, seconds
    assert all(0 <= t < 500 for p in planned for t in p.token_ids)


def test_plan_without_a_time_scale_releases_everything_at_once():
    trace = [_req(0.0, 512, 100, (1,)), _req(9000.0, 512, 100, (2,))]
    planned, _ = plan_requests(trace, TraceTokenizer(16), output_scale=1.0, max_output_tokens=5, time_scale=None)
    assert [p.arrival_s for p in planned] == [0.0, 0.0]
    assert [p.max_tokens for p in planned] == [5, 5]


def test_plan_cuts_prompts_to_max_model_len_and_keeps_room_for_output():
    trace = [_req(0.0, 512 * 8, 500, tuple(range(8))), _req(0.0, 512 * 2, 500, (1, 2))]
    planned, truncated = plan_requests(trace, TraceTokenizer(16), output_scale=1.0, max_output_tokens=100,
                                       time_scale=None, max_model_len=64)
    assert truncated == 1
    assert (len(planned[0].token_ids), planned[0].max_tokens) == (63, 1)
    assert (len(planned[1].token_ids), planned[1].max_tokens) == (32, 32)


def test_plan_with_whole_blocks_makes_every_hash_id_one_block_whatever_the_input_length():
    # input_length 700 scaled to 16 per 512 would be round(21.875) = 22 tokens; whole blocks: 2 x 16.
    trace = [_req(0.0, 700, 10, (1, 2)), _req(0.0, 100, 10, (1, 2, 3))]
    scaled, _ = plan_requests(trace, TraceTokenizer(16), output_scale=1.0, max_output_tokens=5, time_scale=None)
    whole, _ = plan_requests(trace, TraceTokenizer(16, whole_blocks=True), output_scale=1.0, max_output_tokens=5,
                             time_scale=None)
    assert [len(p.token_ids) for p in scaled] == [22, 3]
    assert [len(p.token_ids) for p in whole] == [32, 48]
    assert whole[1].token_ids[:32] == whole[0].token_ids
    assert whole[0].token_ids[:22] == scaled[0].token_ids


def test_whole_block_bounds_count_whole_kv_blocks_and_recompute_the_last_token():
    # 32 tokens per hash id, KV blocks of 16: prompts of 64, 96 and 32 tokens, 192 in all.
    trace = [_req(0.0, 1, 1, (1, 2)), _req(0.0, 1, 1, (1, 2, 3)), _req(0.0, 1, 1, (1,))]
    b = hit_bounds(trace, 2, tokens_per_block=32, block_size=16, whole_blocks=True)
    # ideal: r1 hits the 4 blocks of ids 1, 2 (cap (96 - 1) // 16 = 5); r2 would hit 2 blocks of
    # id 1 but is capped at (32 - 1) // 16 = 1 block: (64 + 16) / 192.
    assert b == {"prompt_tokens": 192, "ideal": 80 / 192, "round_robin": 16 / 192}
    # Round robin: r1 goes to the second, empty cache; r2 to the first, which holds id 1: 16 / 192.
    # Without whole blocks: the trace's own bounds, over its input lengths (1 + 1 + 1 tokens).
    assert hit_bounds(trace, 2, tokens_per_block=32, block_size=16, whole_blocks=False)["prompt_tokens"] == 3


def _policy(name: str, replicas: list[str], hits: int, ttft: float) -> PolicyResult:
    results = [RequestResult(i, ttft_s=ttft, tpot_s=0.01, latency_s=ttft + 0.05, replica_id=replicas[i % len(replicas)],
                             prompt_tokens=100, completion_tokens=6, cached_tokens=hits // 4) for i in range(4)]
    results.append(RequestResult(4, error="UNAVAILABLE: gone"))
    return PolicyResult(name, f"salt:{name}", 1.0, results, prefix_cache_queries=400, prefix_cache_hits=hits,
                        preemptions=0)


def test_report_is_one_table_with_a_row_per_policy_and_the_bounds():
    ids = ["replica-0", "replica-1"]
    report = BenchReport(
        config=BenchConfig(target="127.0.0.1:1", admin_token="s3cret-token"), model="m", block_size=16,
        replicas={i: f"127.0.0.1:{n}" for n, i in enumerate(ids, 1)},
        bounds={"prompt_tokens": 1, "ideal": 0.25, "round_robin": 0.1}, num_requests=5, prompt_tokens=500,
        truncated=0, policies=[_policy("kvroute", ids, 96, 0.040), _policy("round_robin", ids, 40, 0.080)],
    )
    text = format_report(report)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["policy", "requests", "errors", "hit"]
    kv = next(ln for ln in lines if ln.startswith("kvroute "))
    assert kv.split()[:6] == ["kvroute", "5", "1", "0.240", "96%", "40"]
    assert kv.rstrip().endswith("50/50")
    assert "ideal 0.250, round robin over 2 0.100" in text
    assert "kvroute vs round_robin: hit rate 2.40x, TTFT p50 0.50x" in text
    assert "error (kvroute): UNAVAILABLE: gone" in text
    summary = report.to_json()["policies"][0]
    assert summary["hit_rate_source"] == "replica counters" and summary["errors"] == 1
    assert "went past a longer prefix" not in text
    report.policies[0].routed_past = (3, 50)
    assert "kvroute: 3 requests went past a longer prefix another replica held (0.1000 of the prompt tokens" \
        in format_report(report)
    assert report.to_json()["policies"][0]["routed_past_a_longer_prefix"] == {"requests": 3, "tokens": 50}
    # bench.json holds the run's settings, never the router's admin token
    assert report.to_json()["config"]["target"] == "127.0.0.1:1"
    assert "s3cret-token" not in json.dumps(report.to_json())


def test_routed_past_counts_the_prefix_another_replica_held_under_the_lookup_rule():
    a = list(range(1, 13))  # 3 blocks of 4; a lookup reaches (12 - 1) // 4 = 2 of them
    b = a[:8] + [90] * 4
    e = a[:8] + [91] * 4 + [92] * 4
    prompts = [a, b, a, b, b, e]
    picks = ["r0", "r1", "r0", "r0", "", "r2"]
    # b on r1: r0 held a's 2 leading blocks, r1 nothing -> 8 tokens; a again on r0: its own 2 (the
    # lookup's cap), no loss; b on r0: r0 holds b's 2 leading blocks too (a's), equal to r1's; the
    # failed request is skipped and holds nothing; e on the new r2: 2 blocks held elsewhere -> 8.
    assert routed_past(prompts, picks, 4) == (2, 16)
    assert routed_past(prompts, ["r0"] * 6, 4) == (0, 0)
    with pytest.raises(ValueError, match="picks"):
        routed_past(prompts, picks[:2], 4)


def test_hit_rate_falls_back_to_response_usage_without_replica_counters():
    p = _policy("kvroute", ["r"], 96, 0.01)
    p.prefix_cache_queries = p.prefix_cache_hits = None
    assert p.hit_rate_source == "response usage"
    assert p.hit_rate == sum(r.cached_tokens for r in p.ok) / 400


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_rpc_errors_read_as_one_actionable_line():
    t = "h:1"
    assert "has no replica to send the request to" in describe_rpc_error(
        _FakeRpcError(grpc.StatusCode.UNAVAILABLE, "no replica is known (none discovered or heartbeating)"), t)
    assert "cannot reach a router at h:1" in describe_rpc_error(
        _FakeRpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"), t)
    assert describe_rpc_error(_FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: too many"), t) == (
        "INVALID_ARGUMENT: the request was refused: max_tokens: too many")
    assert "overloaded" in describe_rpc_error(_FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"), t)


def test_up_fills_in_the_router_targets_in_the_command():
    cluster = LocalCluster(ClusterConfig(routers=2))
    try:
        cluster.redis_url = "redis://127.0.0.1:7/0"

        class _Router:
            def __init__(self, target: str) -> None:
                self.target = target

        cluster.routers = [_Router("127.0.0.1:5"), _Router("127.0.0.1:6")]  # type: ignore[list-item]
        cluster.admin_token_file = Path("/run/token")
        assert substitute(["bench", "--target", "{target}", "--x={redis_url}", "--t", "{admin_token_file}"],
                          cluster) == ["bench", "--target", "127.0.0.1:5", "--x=redis://127.0.0.1:7/0", "--t", "/run/token"]
        assert substitute(["--target", "{targets}"], cluster) == ["--target", "127.0.0.1:5,127.0.0.1:6"]
    finally:
        cluster.routers = []
        cluster.stop()


def test_up_gives_every_router_its_own_ports_the_first_on_router_port():
    from kvroute_tools.cluster_ports import plan_ports, router_names
    from kvroute_tools.redis_server import free_port

    port = free_port()
    plan = plan_ports(ClusterConfig(replicas=2, routers=3, router_port=port, metrics=True))
    assert plan.routers[0] == port and len(plan.routers) == 3 and len(plan.router_http) == 3
    assert len(set(plan.taken())) == len(plan.taken())  # nothing twice
    assert sorted(plan.metrics) == ["replica-0", "replica-1", "router", "router-1", "router-2"]
    assert router_names(3) == ["router", "router-1", "router-2"]
    assert plan_ports(ClusterConfig(routers=2, router_http_port=-1)).router_http == []
    with pytest.raises(ValueError, match="--routers: must be >= 1"):
        ClusterConfig(routers=0)
    with pytest.raises(ValueError, match="--routers: --gateway envoy puts Envoy in front of one router"):
        ClusterConfig(routers=2, gateway="envoy")


def test_up_gives_each_replica_its_http_port_and_metrics_and_refuses_a_taken_one():
    from kvroute_tools.cluster import ClusterError
    from kvroute_tools.cluster_ports import plan_ports
    from kvroute_tools.redis_server import free_port

    base = free_port()
    cluster = LocalCluster(ClusterConfig(replicas=2, replica_http_base_port=base))
    try:
        argv = cluster._replica_argv("replica-1", 5001, base + 1)
        assert argv[argv.index("--http-port") + 1] == str(base + 1) and "--metrics-port" in argv
        assert "--http-port" not in cluster._replica_argv("replica-0", 5000)
        # the replicas' HTTP ports would overlap their gRPC ports (base, base + 1)
        with pytest.raises(ClusterError, match=rf"--replica-http-base-port: port\(s\) {base}, {base + 1} "):
            plan_ports(ClusterConfig(replicas=2, base_port=base, replica_http_base_port=base))
    finally:
        cluster.stop()
