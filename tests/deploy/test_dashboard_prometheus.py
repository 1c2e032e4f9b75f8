"""Every query of the Grafana dashboard through a real Prometheus, both ways an operator runs one.

One ``kvroute up --metrics --gateway envoy`` cluster (LocalCluster: 2 replicas, the router with its
endpoint picker, Envoy; real processes on loopback) serves traffic while two Prometheus servers
(``make prometheus``: Debian's 2.53) read it:

- **scrape**: Prometheus scrapes every process's /metrics each second, with a ``namespace`` target
  label (what Kubernetes service discovery adds); the dashboard's ``$namespace`` is that value;
- **OTLP**: every process pushes its metrics over OTLP/HTTP (``http/protobuf``) to a real OTLP
  receiver, whose series a second Prometheus scrapes as the OpenTelemetry-to-Prometheus
  translation names them (tests.support_otlp_prometheus: what a collector's ``prometheus``
  exporter serves, and Prometheus's own OTLP receiver stores; Debian builds Prometheus without
  that receiver), with the namespace from the ``k8s.namespace.name`` resource attribute (the
  chart sets it; docs/metrics.md names the collector setting that makes it the label).

Then each expression of every panel, after Grafana's interpolation, is evaluated through
Prometheus's HTTP API and must return at least one finite sample, and the variables' label_values
queries must list the replicas. The traffic: the same 40-token prompts repeated through the router
(4 output tokens), a call with a token id past the vocabulary (an error at the router), calls
through Envoy and the picker, and a replica just gone (heartbeating at an address nobody listens on,
with the prompt's blocks cached), so the router retries before the first token.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Iterator

import grpc
import pytest

from kvroute.redis_layout import RedisLayout
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute_tools.cluster import ClusterConfig, LocalCluster
from tests.deploy import dashboard as board
from tests.support import scrape_metrics, wait_for
from tests.support_otlp import OtlpReceiver
from tests.support_otlp_prometheus import TranslatedMetrics
from tests.support_prometheus import Prometheus, prometheus_binary
from tests.support_redis import unreachable_replica

PROMETHEUS = prometheus_binary()
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="no Prometheus: `make prometheus` unpacks Debian's")
NAMESPACE = "kvroute-test"
PROMPTS = [[random.Random(seed).randrange(10, 500) for _ in range(40)] for seed in range(3)]
SAMPLING = gen_pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
T = 60.0


def _call(target: str, ids: list[int]) -> None:
    with grpc.insecure_channel(target) as ch:
        gen_grpc.GenerationServiceStub(ch).Generate(
            gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=ids), sampling=SAMPLING), timeout=T)


class _Traffic:
    """Calls through the router until stopped: the prompts in turn, and an error every round."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for ids in PROMPTS:
                    _call(self.target, ids)
                try:
                    _call(self.target, [10**6])
                    self.failure = "a token id past the vocabulary was served"
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
                        raise
                self._stop.wait(0.2)
        except Exception as e:  # noqa: BLE001 - reported by stop()
            self.failure = repr(e)

    def stop(self) -> None:
        """Stop the calls. AssertionError: one failed (or the bad one was served)."""
        self._stop.set()
        self._thread.join(timeout=T)
        assert self.failure is None, self.failure


@pytest.fixture(scope="module")
def servers(tmp_path_factory, default_model_dir) -> Iterator[dict[str, Prometheus]]:
    binary, _version = PROMETHEUS
    folder = tmp_path_factory.mktemp("prometheus")
    with OtlpReceiver() as receiver, pytest.MonkeyPatch.context() as env:
        translated = TranslatedMetrics(receiver)
        pushed = Prometheus(binary, folder / "otlp", targets=[translated.target], honor_labels=True)
        try:
            # inherited by every process kvroute up starts
            env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.http_endpoint)
            env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
            env.setenv("OTEL_METRIC_EXPORT_INTERVAL", "1000")
            env.setenv("OTEL_RESOURCE_ATTRIBUTES", f"k8s.namespace.name={NAMESPACE}")
            config = ClusterConfig(replicas=2, router_port=0, metrics=True, gateway="envoy", num_blocks=256,
                                   model=str(default_model_dir), log_dir=str(folder / "cluster"), ready_timeout=240)
            cluster = LocalCluster(config).start()
            try:
                targets = [url.removeprefix("http://").removesuffix("/metrics") for url in cluster.metrics_urls.values()]
                with Prometheus(binary, folder / "scrape", targets=targets, target_labels={"namespace": NAMESPACE}) as scraped:
                    for ids in PROMPTS:  # through Envoy and the picker, before a replica is gone
                        _call(cluster.front_target, ids)
                    router_metrics = cluster.metrics_urls["router"]
                    with unreachable_replica(cluster.redis_url, "replica-gone", PROMPTS[0][:32],
                                             layout=RedisLayout(namespace=config.namespace)):
                        wait_for(lambda: _routable(router_metrics) == 3, T, "the gone replica routable")
                        traffic = _Traffic(cluster.router_target)
                        try:
                            wait_for(lambda: _retries(router_metrics) > 0, T, "a retry off the gone replica")
                            yield {"scrape": scraped, "otlp": pushed}
                        finally:
                            traffic.stop()
            finally:
                cluster.stop()
        finally:
            pushed.close()
            translated.close()


def _routable(url: str) -> float:
    return sum(v for labels, v in scrape_metrics(url).get("kvroute_router_replicas", [])
               if labels.get("kvroute_state") == "routable")


def _retries(url: str) -> float:
    return sum(v for _, v in scrape_metrics(url).get("kvroute_router_retries_total", []))


def _finite(result: list[dict]) -> list[float]:
    return [v for v in (float(r["value"][1]) for r in result) if math.isfinite(v)]


DASHBOARD = board.load_dashboard()


def _as_sent(expr: str) -> str:
    """``expr`` as Grafana sends it with the namespace variable at the cluster's namespace."""
    return board.interpolate(expr, board.variables(DASHBOARD), {"namespace": NAMESPACE})


@pytest.mark.parametrize("path", ["scrape", "otlp"])
def test_every_dashboard_expression_returns_data(servers, path):
    prom = servers[path]
    exprs = [(p["title"], t["expr"]) for p in board.panels(DASHBOARD) for t in p.get("targets", [])]
    assert len(exprs) >= 40
    for title, expr in exprs:
        query = _as_sent(expr)
        # rate() needs two samples of a series inside its window: a fresh series takes a second or two
        values = wait_for(lambda q=query: _finite(prom.query(q)), 30.0, f"{path}: data for {title!r}: {query}")
        print(f"{path:6} {title[:40]:40} {values[:3]}")


@pytest.mark.parametrize("path", ["scrape", "otlp"])
def test_the_variables_list_the_replicas(servers, path):
    prom = servers[path]
    found = {label: wait_for(lambda s=selector, lab=label: prom.label_values(lab, _as_sent(s)), 30.0,
                             f"{path}: values of {label}")
             for selector, label in board.label_values(DASHBOARD)}
    assert {"replica-0", "replica-1"} <= set(found["kvroute_replica_id"])
    assert found["namespace"] == [NAMESPACE]


def test_over_otlp_the_scope_name_is_gone_and_the_kv_usage_name_is_the_scraped_one(servers):
    """Why the panels select ``kvroute_component`` and the gauge is named ``..._ratio``: after the
    OTLP translation no series keeps ``otel_scope_name`` (the scrape has it), and a unit-"1" gauge
    is named with the ``_ratio`` suffix, which the scrape now has too."""
    scoped = 'count({__name__=~"gen_ai_server_.+_count", otel_scope_name!=""})'
    assert wait_for(lambda: servers["scrape"].query(scoped), 30.0, "scrape: scoped series")
    assert wait_for(lambda: servers["otlp"].query('count({__name__=~"gen_ai_server_.+_count"})'), 30.0, "otlp: series")
    assert not servers["otlp"].query(scoped)
    for path, prom in servers.items():
        got = wait_for(lambda p=prom: p.query("kvroute_replica_kv_cache_usage_ratio"), 30.0, f"{path}: KV usage")
        assert {r["metric"]["kvroute_replica_id"] for r in got} == {"replica-0", "replica-1"}
