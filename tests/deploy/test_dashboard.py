"""The Grafana dashboard (deploy/helm/kvroute/dashboards/kvroute.json) against a live cluster.

A real router and a real replica (BackgroundRouter / BackgroundReplica over one redis-server,
the generated default model, each with its Prometheus endpoint on a free loopback port) serve a
small workload: the same 40-token prompt three times through the router, 4 output tokens each, and
one call with a token id past the vocabulary (an error). A second replica heartbeats at an address
nobody listens on with the prompt's 2 blocks cached (a replica just gone): the router picks it
first, and retries on replica-0 before the first token. The router's endpoint picker is on.
Then every PromQL expression of the dashboard is parsed by a PromQL parser (after Grafana's
variable interpolation), and every metric and label it names must be in the scrape of those two
endpoints: a renamed metric or label, or a panel over a series nothing exports, fails here.

Hand-worked numbers of the workload (block_size 16): each prompt is 2 full blocks + 8 tokens, so
the replica looks up 3 x 40 = 120 prompt tokens; the second and third find the 2 full blocks
cached (2 x 32 = 64 hits), and the router predicted exactly those 64 tokens.
"""

from __future__ import annotations

import random
import re

import grpc
import promql_parser
import pytest

from kvroute.telemetry import setup_telemetry
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute_tools.redis_server import RedisServer
from replica.server import BackgroundReplica
from replica.settings import ReplicaSettings
from router.server import BackgroundRouter
from router.settings import RouterSettings
from tests.deploy import dashboard as board
from tests.support import scrape_metrics, wait_for
from tests.support_redis import unreachable_replica

# Labels Prometheus attaches to every series of a scraped target (Kubernetes service discovery, the
# chart's ServiceMonitor); no process exports them, so a local scrape cannot show them.
TARGET_LABELS = {"namespace"}
PROMPT = [random.Random(7).randrange(10, 500) for _ in range(40)]
T = 60.0


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return board.load_dashboard()


# -- the JSON alone -------------------------------------------------------------------------------
def test_the_dashboard_has_a_uid_a_datasource_variable_and_namespace_and_replica_variables(dashboard):
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dashboard["uid"])
    variables = board.variables(dashboard)
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "replica"} <= set(variables)
    for name in ("namespace", "replica"):
        assert variables[name]["datasource"]["uid"] == "${datasource}"
        assert variables[name]["includeAll"] and variables[name]["multi"]


def test_no_panel_without_a_query_and_every_query_on_the_datasource_variable(dashboard):
    panels = [p for p in board.panels(dashboard) if p["type"] != "row"]
    assert len(panels) >= 15
    for p in panels:
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]
    ids = [p["id"] for p in board.panels(dashboard)]
    assert len(ids) == len(set(ids))


def test_the_rows_are_routing_cache_latency_and_load(dashboard):
    assert [p["title"] for p in dashboard["panels"] if p["type"] == "row"] == ["Routing", "Cache", "Latency", "Load"]


def test_every_expression_parses_as_promql(dashboard):
    variables = board.variables(dashboard)
    exprs = board.expressions(dashboard) + [selector for selector, _ in board.label_values(dashboard)]
    for expr in exprs:
        promql_parser.parse(board.interpolate(expr, variables))  # raises ValueError on a syntax error
    with pytest.raises(ValueError):
        promql_parser.parse("sum by (le (rate(x[1m]))")  # the parser does refuse bad PromQL


# -- against a live scrape ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scraped(default_model_dir) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The router's and the replica's /metrics samples after the workload, merged by sample name."""
    with RedisServer() as redis:
        replica_telemetry = setup_telemetry("kvroute-replica", 0, otlp=False)
        router_telemetry = setup_telemetry("kvroute-router", 0, otlp=False)
        replica_settings = ReplicaSettings(
            host="127.0.0.1", port=0, model=str(default_model_dir), replica_id="replica-0", redis_url=redis.url,
            num_blocks=128, torch_threads=1, heartbeat_interval=0.2, heartbeat_ttl=5.0,
        )
        router_settings = RouterSettings(host="127.0.0.1", port=0, redis_url=redis.url, model=str(default_model_dir),
                                         heartbeat_poll_interval=0.1, seed=0, picker_port=0)
        try:
            with BackgroundReplica(replica_settings, telemetry=replica_telemetry), \
                    BackgroundRouter(router_settings, telemetry=router_telemetry) as router, \
                    unreachable_replica(redis.url, "replica-gone", PROMPT[:32]):
                wait_for(lambda: len(router.server.registry.routable()) == 2, T, "both replicas routable")
                with grpc.insecure_channel(router.target) as channel:
                    gen = gen_grpc.GenerationServiceStub(channel)
                    sampling = gen_pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
                    for _ in range(3):  # the first goes to replica-gone (it holds the 2 blocks), then replica-0
                        gen.Generate(gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=PROMPT), sampling=sampling),
                                     timeout=T)
                    with pytest.raises(grpc.RpcError):  # a token id past the vocabulary: an error at the router
                        gen.Generate(gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=[10**6]), sampling=sampling),
                                     timeout=T)
                urls = {name: f"http://127.0.0.1:{t.metrics_port}/metrics"
                        for name, t in (("router", router_telemetry), ("replica", replica_telemetry))}

                def settled() -> dict | None:
                    # the router records a call just after it ends; the replica's counters follow its steps
                    samples = {name: scrape_metrics(url) for name, url in urls.items()}
                    router_done = sum(v for _, v in samples["router"].get(
                        "gen_ai_server_request_duration_seconds_count", [])) == 4
                    replica_done = sum(v for _, v in samples["replica"].get(
                        "kvroute_replica_prefix_cache_queries_total", [])) == 120
                    return samples if router_done and replica_done else None

                samples = wait_for(settled, T, "the workload recorded")
        finally:
            router_telemetry.shutdown()
            replica_telemetry.shutdown()
    merged: dict[str, list] = {}
    for by_name in samples.values():
        for name, points in by_name.items():
            merged.setdefault(name, []).extend(points)
    return merged


def test_the_workload_reads_as_worked_out(scraped):
    def total(name: str) -> float:
        return sum(v for _, v in scraped[name])

    assert total("kvroute_replica_prefix_cache_queries_total") == 120
    assert total("kvroute_replica_prefix_cache_hits_total") == 64
    assert total("kvroute_router_prediction_predicted_tokens_total") == 64
    assert total("kvroute_router_prediction_cached_tokens_total") == 64
    assert {lab["kvroute_replica_id"] for lab, _ in scraped["kvroute_router_decisions_total"]} == {"replica-0", "replica-gone"}
    assert total("kvroute_router_retries_total") >= 1
    assert {lab["kvroute_replica_id"] for lab, _ in scraped["kvroute_router_retries_total"]} == {"replica-gone"}


class _Names:
    """What one expression names: its selectors (metric, matchers) and its grouping labels, each
    with the metrics of the selectors it groups."""

    def __init__(self, expr: promql_parser.Expr):
        self.selectors: list[tuple[str, list]] = []
        self.groupings: list[tuple[list[str], set[str]]] = []
        promql_parser.walk(expr, pre_visit=self._visit)

    def _visit(self, node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            self.selectors.append((node.name, list(node.matchers.matchers)))
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            self.groupings.append((list(node.modifier.labels), {name for name, _ in _Names(node.expr).selectors}))
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None \
                and node.modifier.matching is not None:
            inner = _Names(node.lhs).selectors + _Names(node.rhs).selectors
            self.groupings.append((list(node.modifier.matching.labels), {name for name, _ in inner}))


def test_every_metric_and_label_the_dashboard_names_is_in_the_live_scrape(dashboard, scraped):
    variables = board.variables(dashboard)
    exprs = board.expressions(dashboard) + [selector for selector, _ in board.label_values(dashboard)]
    labels_of = {name: {label for lab, _ in points for label in lab} for name, points in scraped.items()}
    used: set[str] = set()
    for expr in exprs:
        names = _Names(promql_parser.parse(board.interpolate(expr, variables)))
        for metric, matchers in names.selectors:
            assert metric in scraped, f"{metric} (in {expr!r}) is in no scrape"
            used.add(metric)
            for m in matchers:
                if m.name in TARGET_LABELS:
                    continue
                assert m.name in labels_of[metric], f"{metric} has no label {m.name} (in {expr!r})"
                if m.op == promql_parser.MatchOp.Equal:
                    assert any(lab.get(m.name) == m.value for lab, _ in scraped[metric]), \
                        f"no {metric} series with {m.name}={m.value!r}"
        for labels, metrics in names.groupings:
            have = set().union(*(labels_of[name] for name in metrics)) | TARGET_LABELS
            assert set(labels) <= have, f"grouping by {set(labels) - have} that {metrics} lack (in {expr!r})"
    for selector, label in board.label_values(dashboard):
        (metric, _), = _Names(promql_parser.parse(board.interpolate(selector, variables))).selectors
        assert label in labels_of[metric] | TARGET_LABELS, f"variable label {label} not on {metric}"
    # the router's and the replica's own metrics both feed it
    assert any(n.startswith("kvroute_router_") for n in used) and any(n.startswith("kvroute_replica_") for n in used)
