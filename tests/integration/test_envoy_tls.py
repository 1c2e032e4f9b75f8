"""A real Envoy with TLS on its listener and on every upstream (kvroute_tools.envoy.EnvoyTls): the
router's gRPC and picker ports serve TLS, the replica requires mutual TLS, and its certificate
names only ``replica.kvroute.svc`` -- not the 127.0.0.1 Envoy dials -- so a served call proves
Envoy checks the replica's name. Refused: a plaintext client, a client that trusts another CA, a
client without a certificate where the listener requires one; an Envoy that expects another
replica name, trusts another CA, or has no client certificate for the replica gets UNAVAILABLE
and nothing is generated."""

from __future__ import annotations

import grpc
import pytest

from kvroute.tls import channel_credentials
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute_tools.envoy import EnvoyFront, EnvoyTls, bootstrap
from replica.server import BackgroundReplica
from replica.settings import ReplicaSettings
from router.server import BackgroundRouter
from router.settings import RouterSettings
from tests.integration.test_router_proxy import ids_request
from tests.support import wait_for
from tests.support_tls import TestCA

T = 30.0
REPLICA_NAME = "replica.kvroute.svc"


@pytest.fixture(scope="module")
def names(tmp_path_factory):
    """The replica's certificate, of the test CA, valid for REPLICA_NAME only."""
    folder = tmp_path_factory.mktemp("named")
    ca = TestCA(folder, "kvroute-test-ca")
    return {"ca": str(ca.file), "replica": ca.issue("replica-named", (REPLICA_NAME,), loopback=False),
            "envoy": ca.issue("envoy"), "router": ca.issue("router"), "client": ca.issue("client")}


@pytest.fixture(scope="module")
def router(redis_server, default_model_dir, names):
    cert, key = names["replica"]
    replica = ReplicaSettings(
        host="127.0.0.1", port=0, model=str(default_model_dir), replica_id="rep-tls", redis_url=redis_server.url,
        namespace="envoy-tls", num_blocks=64, torch_threads=1, heartbeat_interval=0.2, heartbeat_ttl=5.0,
        max_num_seqs=2, tls_cert_file=cert, tls_key_file=key, tls_client_ca_file=names["ca"],
    )
    cert, key = names["router"]
    settings = RouterSettings(host="127.0.0.1", port=0, redis_url=redis_server.url, namespace="envoy-tls",
                              model=str(default_model_dir), heartbeat_poll_interval=0.1, picker_port=0,
                              tls_cert_file=cert, tls_key_file=key)
    with BackgroundReplica(replica), BackgroundRouter(settings) as r:
        wait_for(lambda: [i.replica_id for i in r.server.registry.routable()] == ["rep-tls"], what="replica routable")
        yield r


def envoy_tls(names, **changes) -> EnvoyTls:
    cert, key = names["envoy"]
    up_cert, up_key = names["client"]
    return EnvoyTls(**{**dict(cert_file=cert, key_file=key, upstream_ca_file=names["ca"], upstream_cert_file=up_cert,
                              upstream_key_file=up_key, replica_server_name=REPLICA_NAME), **changes})


def front(router, folder, tls: EnvoyTls) -> EnvoyFront:
    return EnvoyFront(router.target, picker_target=router.picker_target, folder=folder, tls=tls)


def stub(target: str, credentials) -> gen_grpc.GenerationServiceStub:
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    return gen_grpc.GenerationServiceStub(channel)


@pytest.fixture(scope="module")
def envoy(router, names, tmp_path_factory):
    with front(router, tmp_path_factory.mktemp("envoy"), envoy_tls(names)) as e:
        yield e


def generate(s: gen_grpc.GenerationServiceStub):
    call = s.GenerateStream(ids_request([5, 6, 7, 8, 9] * 7, gen_pb.SamplingParams(max_tokens=4, temperature=0.0,
                                                                                     ignore_eos=True)), timeout=T)
    return list(call), dict(call.trailing_metadata())


def test_generation_through_envoy_over_tls_end_to_end(envoy, names):
    deltas, trailers = generate(stub(envoy.target, channel_credentials(names["ca"])))
    assert deltas[-1].usage.completion_tokens == 4 and trailers["x-kvroute-replica"] == "rep-tls"
    info = stub(envoy.target, channel_credentials(names["ca"])).GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=T)
    assert info.block_size == 16  # the router's port, over TLS too


@pytest.mark.parametrize("client", ["plaintext", "other-ca"])
def test_a_client_that_does_not_speak_tls_to_the_listeners_ca_is_refused(envoy, pki, client):
    credentials = None if client == "plaintext" else channel_credentials(pki["other_ca"])
    with pytest.raises(grpc.RpcError) as err:
        generate(stub(envoy.target, credentials))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("change", [
    {"replica_server_name": "other.kvroute.svc"},  # the replica's certificate does not name it
    {"upstream_cert_file": "", "upstream_key_file": ""},  # the replica requires a client certificate
], ids=["another-replica-name", "no-client-cert"])
def test_an_envoy_that_cannot_verify_or_satisfy_the_replica_generates_nothing(router, names, tmp_path, change):
    with front(router, tmp_path, envoy_tls(names, **change)) as e:
        with pytest.raises(grpc.RpcError) as err:
            generate(stub(e.target, channel_credentials(names["ca"])))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert stub(e.target, channel_credentials(names["ca"])).GetModelInfo(  # the router is still reached
            gen_pb.GetModelInfoRequest(), timeout=T).block_size == 16


def test_an_envoy_that_trusts_another_ca_reaches_neither_router_nor_replica(router, names, pki, tmp_path):
    with front(router, tmp_path, envoy_tls(names, upstream_ca_file=pki["other_ca"])) as e:
        for call in (lambda s: generate(s), lambda s: s.GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=T)):
            with pytest.raises(grpc.RpcError) as err:
                call(stub(e.target, channel_credentials(names["ca"])))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_listener_with_a_client_ca_requires_a_client_certificate(router, names, tmp_path):
    with front(router, tmp_path, envoy_tls(names, client_ca_file=names["ca"])) as e:
        with pytest.raises(grpc.RpcError) as err:
            generate(stub(e.target, channel_credentials(names["ca"])))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        deltas, _ = generate(stub(e.target, channel_credentials(names["ca"], *names["client"])))
        assert deltas[-1].usage.completion_tokens == 4


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(cert_file="c.pem"), "cert_file, key_file: set both or neither"),
    (dict(client_ca_file="ca.pem"), "client_ca_file: needs cert_file"),
    (dict(upstream_ca_file="ca.pem"), "replica_server_name: needed with upstream_ca_file"),
    (dict(replica_server_name="r.svc"), "need upstream_ca_file"),
])
def test_a_half_set_envoy_tls_is_an_error_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EnvoyTls(**kwargs)


def test_the_router_is_checked_by_ip_when_dialed_by_ip_and_by_name_with_sni_otherwise():
    tls = EnvoyTls(upstream_ca_file="ca.pem", replica_server_name=REPLICA_NAME)

    def contexts(router_host: str) -> dict[str, dict]:
        b = bootstrap(listen_host="127.0.0.1", listen_port=1, router_host=router_host, router_port=2,
                      picker_host=router_host, picker_port=3, tls=tls)
        return {c["name"]: c["transport_socket"]["typed_config"] for c in b["static_resources"]["clusters"]}

    by_ip, by_name = contexts("127.0.0.1"), contexts("router.kvroute.svc")
    san = by_ip["kvroute_router"]["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"]
    assert san == [{"san_type": "IP_ADDRESS", "matcher": {"exact": "127.0.0.1"}}] and "sni" not in by_ip["kvroute_router"]
    assert by_name["kvroute_picker"]["sni"] == "router.kvroute.svc"
    assert {by_ip[c]["sni"] for c in ("kvroute_replicas", "kvroute_http_replicas")} == {REPLICA_NAME}
