"""The chart runs: the rendered Redis, replica and router pods started as local processes with the
containers' own command, args and environment (tests.deploy.local_pods: Secrets resolved, Service
names mapped to per-pod loopback IPs, ports as rendered), every probe called as declared, the
routers discovering the replicas through EndpointSlices of the rendered headless Service on a
loopback API server, 50 generations through the router Service's port, the replicas'
prefix-cache counters read from their metrics ports, ``helm test``'s command run, and a replica
drained the way a pod deletion drains it (terminating endpoint, SIGTERM).

A flag the programs do not know makes them exit (argparse), a probe service they do not register
fails its probe, and a KVROUTE_* variable they do not read is caught by ``unknown_kvroute_env``
(settings ignore unknown variables): each of those fails this test.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis
import requests
from prometheus_client.parser import text_string_to_metric_families

from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute_tools.health import check_health
from tests.deploy.chart import FULLNAME, NAMESPACE, find, render, unknown_kvroute_env
from tests.deploy.local_pods import local_cluster
from tests.support import wait_for

pytestmark = pytest.mark.slow  # about 1-2 minutes on two cores: four model generations, two engines

ROUTER, REPLICA, REDIS = f"{FULLNAME}-router", f"{FULLNAME}-replica", f"{FULLNAME}-redis"
VALUES = {
    "router": {"replicas": 2},
    "replica": {"replicas": 2, "gpu": 0, "drainTimeoutSeconds": 20,
                "settings": {"num_blocks": 1024, "torch_threads": 1, "max_num_batched_tokens": 512}},
}
PREFIXES = [f"Document {d}: " + " ".join(f"w{d}x{i}" for i in range(40)) for d in range(5)]


def _prompts() -> list[str]:
    """50 prompts: 5 long shared prefixes x 10 questions."""
    return [f"{p} Question {q}: what follows?" for q in range(10) for p in PREFIXES]


def _metric(ip: str, port: int, name: str) -> float:
    text = requests.get(f"http://{ip}:{port}/metrics", timeout=5).text
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]
    assert samples, f"{name} not in the scrape of {ip}:{port}"
    return sum(s.value for s in samples)


@pytest.fixture
def cluster(tmp_path):
    with local_cluster(render(VALUES), NAMESPACE, tmp_path) as (local, api):
        yield local, api


def test_the_rendered_release_runs_routes_and_drains(cluster):
    local, api = cluster
    docs = local.docs
    assert unknown_kvroute_env(docs) == []
    [redis_pod] = local.add_pods(find(docs, "StatefulSet", REDIS))
    replicas = local.add_pods(find(docs, "StatefulSet", REPLICA))
    routers = local.add_pods(find(docs, "Deployment", ROUTER))
    assert [p.name for p in replicas] == [f"{REPLICA}-0", f"{REPLICA}-1"] and len(routers) == 2

    # Redis first (the others' Service names must resolve to a ready pod), with requirepass.
    local.start(redis_pod)
    local.wait_started_and_ready(redis_pod, "redis")
    assert local.probe(redis_pod, "redis", "livenessProbe")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=redis_pod.ip, port=6379).ping()
    password = local.secrets[REDIS]["redis-password"]
    assert redis.Redis(host=redis_pod.ip, port=6379, password=password).ping()

    api.put(local.endpoint_slice(REPLICA))  # no endpoint ready yet
    with ThreadPoolExecutor(4) as pool:  # init containers (the default model) run in parallel
        list(pool.map(local.start, replicas + routers))
    for pod in replicas:
        local.wait_started_and_ready(pod, "replica")
        api.put(local.endpoint_slice(REPLICA))  # the EndpointSlice controller's update
    for pod in routers:
        local.wait_started_and_ready(pod, "router")
    for pod, name in [(p, "replica") for p in replicas] + [(p, "router") for p in routers]:
        assert local.probe(pod, name, "livenessProbe"), f"{pod.name}: liveness"

    # helm test: its Pod's command, as rendered, must exit 0 once both replicas are routable.
    test_pod = find(docs, "Pod", f"{FULLNAME}-test-health")
    wait_for(lambda: all("2 routable" in check_health(f"{r.ip}:50050").line for r in routers), 60,
             "both replicas routable on both routers")
    done = local.run_pod(test_pod)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (f"router at {routers[0].ip}:50050: SERVING, 2 routable replicas: "
                                   f"{REPLICA}-0, {REPLICA}-1")  # the Service name resolved to a router pod

    # 50 generations through the router Service's port (kube-proxy spreads them over the pods).
    service_port = find(docs, "Service", ROUTER)["spec"]["ports"][0]
    assert service_port["name"] == "grpc" and service_port["targetPort"] == "grpc"
    per_replica = {p.name: {"prompt": 0, "cached": 0, "n": 0} for p in replicas}
    for i, text in enumerate(_prompts()):
        router = routers[i % len(routers)]
        with grpc.insecure_channel(f"{router.ip}:{service_port['port']}") as ch:
            resp = gen_grpc.GenerationServiceStub(ch).Generate(gen_pb.GenerateRequest(
                text=text, sampling=gen_pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)), timeout=60)
        assert resp.finish_reason == gen_pb.FINISH_REASON_LENGTH and resp.usage.completion_tokens == 4
        got = per_replica[resp.routing.replica_id]
        got["prompt"] += resp.usage.prompt_tokens
        got["cached"] += resp.usage.cached_tokens
        got["n"] += 1
    assert sum(r["n"] for r in per_replica.values()) == 50

    # The replicas' prefix-cache counters (their metrics ports, as rendered) match what the
    # responses reported, replica by replica; the shared prefixes were hits.
    metrics_port = next(p["containerPort"] for p in replicas[0].container("replica")["ports"] if p["name"] == "metrics")
    for pod in replicas:
        queries = _metric(pod.ip, metrics_port, "kvroute_replica_prefix_cache_queries_total")
        hits = _metric(pod.ip, metrics_port, "kvroute_replica_prefix_cache_hits_total")
        assert (queries, hits) == (per_replica[pod.name]["prompt"], per_replica[pod.name]["cached"]), pod.name
    total_cached = sum(r["cached"] for r in per_replica.values())
    assert total_cached >= 45 * 32, per_replica  # 45 requests after the first of each prefix, >= 2 blocks each

    # Deleting replica-1's pod: its endpoint turns terminating (serving while it drains) and it
    # gets SIGTERM; the routers stop sending it requests; it exits 0 within its grace period.
    leaving, staying = replicas[1], replicas[0]
    leaving.terminating = True
    api.put(local.endpoint_slice(REPLICA))
    leaving.procs["replica"].send_signal(signal.SIGTERM)
    wait_for(lambda: all(check_health(f"{r.ip}:50050").line.endswith(f"1 routable replica: {staying.name}")
                         for r in routers), 30, "the terminating replica unroutable")
    for i in range(6):
        with grpc.insecure_channel(f"{routers[i % 2].ip}:50050") as ch:
            resp = gen_grpc.GenerationServiceStub(ch).Generate(gen_pb.GenerateRequest(
                text=PREFIXES[i % 5], sampling=gen_pb.SamplingParams(max_tokens=2, temperature=0.0)), timeout=60)
        assert resp.routing.replica_id == staying.name
    grace = find(docs, "StatefulSet", REPLICA)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert leaving.procs["replica"].wait(grace) == 0
