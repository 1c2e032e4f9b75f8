"""The chart runs with mutual gRPC TLS (``tls.enabled``, ``tls.mutual``): the rendered Redis, one
replica and one router started as local processes (tests.deploy.local_pods) with the Secret
``tls.existingSecret`` names (tls.crt, tls.key, ca.crt generated here by tests.support_tls) mounted
where the chart mounts it. The exec probes run as declared and must pass over TLS; ``helm test``'s
command exits 0; a generation goes through the router to the replica over mTLS on both hops; a
plaintext client and a client without a certificate are refused.

Static discovery; the local DNS maps the pods' names to loopback IPs. The one certificate names the
router Service, the router pod's IP (what this test dials) and the replica Service
``<fullname>-replica.<namespace>.svc`` -- not the replica's IP or pod name: the router checks the
replica against the Service's name (``KVROUTE_REPLICA_TLS_SERVER_NAME``), as docs/security.md says.
"""

from __future__ import annotations

import random
from pathlib import Path

import grpc
import pytest

from kvroute.tls import channel_credentials
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from tests.deploy.chart import FULLNAME, NAMESPACE, find, render, unknown_kvroute_env
from tests.deploy.local_pods import LocalCluster, write_kubeconfig
from tests.support_tls import TestCA

pytestmark = pytest.mark.slow  # about a minute on two cores: one model generation, one engine

ROUTER, REPLICA, REDIS = f"{FULLNAME}-router", f"{FULLNAME}-replica", f"{FULLNAME}-redis"
VALUES = {
    "tls": {"enabled": True, "existingSecret": "kvr-tls", "mutual": True},
    "router": {"replicas": 1, "discovery": "static", "autoscaling": {"enabled": False}},
    "replica": {"replicas": 1, "gpu": 0, "settings": {"num_blocks": 256, "torch_threads": 1}},
}


def _refused(target: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel, pytest.raises(grpc.RpcError) as err:
        gen_grpc.GenerationServiceStub(channel).GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=5)
    return err.value.code()


def test_the_rendered_release_runs_over_mutual_tls(tmp_path: Path):
    docs = render(VALUES)
    assert unknown_kvroute_env(docs) == []
    subnet = f"127.{random.randint(100, 250)}.{random.randint(0, 250)}"
    local = LocalCluster(docs, NAMESPACE, tmp_path, subnet, write_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:1"))
    try:
        [redis_pod] = local.add_pods(find(docs, "StatefulSet", REDIS))
        [replica] = local.add_pods(find(docs, "StatefulSet", REPLICA))
        [router] = local.add_pods(find(docs, "Deployment", ROUTER))
        ca = TestCA(tmp_path, "kvroute-ca")
        cert, key = ca.issue("kvroute", dns_names=(ROUTER, f"{REPLICA}.{NAMESPACE}.svc"), ips=(router.ip,),
                             loopback=False)
        local.secrets["kvr-tls"] = {"tls.crt": Path(cert).read_text(), "tls.key": Path(key).read_text(),
                                    "ca.crt": ca.file.read_text()}  # kubectl create secret ... (docs/security.md)

        local.start(redis_pod)
        local.wait_started_and_ready(redis_pod, "redis")
        local.start(replica)
        local.start(router)
        local.wait_started_and_ready(replica, "replica")
        local.wait_started_and_ready(router, "router")
        for pod, name in ((replica, "replica"), (router, "router")):
            assert "exec" in pod.container(name)["livenessProbe"]
            assert local.probe(pod, name, "livenessProbe"), f"{pod.name}: liveness over TLS"

        done = local.run_pod(find(docs, "Pod", f"{FULLNAME}-test-health"))
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"router at {router.ip}:50050: SERVING, 1 routable replica: {replica.name}"

        target = f"{router.ip}:50050"
        client = channel_credentials(str(ca.file), cert, key)
        with grpc.secure_channel(target, client, options=[("grpc.ssl_target_name_override", ROUTER)]) as ch:
            resp = gen_grpc.GenerationServiceStub(ch).Generate(gen_pb.GenerateRequest(
                text="hello over mutual TLS", sampling=gen_pb.SamplingParams(max_tokens=3, temperature=0.0,
                                                                             ignore_eos=True)), timeout=60)
        assert resp.usage.completion_tokens == 3 and resp.routing.replica_id == replica.name
        assert _refused(target, None) == grpc.StatusCode.UNAVAILABLE  # plaintext
        assert _refused(f"{replica.ip}:50051", channel_credentials(str(ca.file))) == grpc.StatusCode.UNAVAILABLE  # no cert
    finally:
        local.stop_all()
