"""gRPC TLS end to end (kvroute/tls.py): a replica that requires mutual TLS, a router that serves
TLS and dials the replica with its client certificate, ``kvroute generate``'s client over TLS.
The CA, the server and client certificates (and a second, unrelated CA) are generated here with
the ``cryptography`` library. Refused: a plaintext client, a client that trusts another CA, a
client without a certificate where mTLS is required, a half-set TLS configuration."""

from __future__ import annotations

import io

import grpc
import pytest

from kvroute.tls import channel_credentials, server_credentials
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute.v1 import replica_pb2_grpc as rep_grpc
from kvroute_tools.client import build_request, stream_generate
from replica.server import BackgroundReplica
from replica.settings import ReplicaSettings
from router.server import BackgroundRouter
from router.settings import RouterSettings
from tests.support import wait_for
from tests.support_tls import TestCA

T = 30.0


@pytest.fixture(scope="module")
def cluster(redis_server, default_model_dir, pki):
    cert, key = pki["replica"]
    replica = ReplicaSettings(
        host="127.0.0.1", port=0, model=str(default_model_dir), replica_id="rep-tls", redis_url=redis_server.url,
        namespace="tls", num_blocks=64, torch_threads=1, heartbeat_interval=0.2, heartbeat_ttl=5.0, max_num_seqs=2,
        tls_cert_file=cert, tls_key_file=key, tls_client_ca_file=pki["ca"],  # mutual TLS
    )
    cert, key = pki["router"]
    router = RouterSettings(
        host="127.0.0.1", port=0, redis_url=redis_server.url, namespace="tls", model=str(default_model_dir),
        heartbeat_poll_interval=0.1, tls_cert_file=cert, tls_key_file=key,
        replica_tls_ca_file=pki["ca"], replica_tls_cert_file=cert, replica_tls_key_file=key,
    )
    with BackgroundReplica(replica) as rep, BackgroundRouter(router) as r:
        wait_for(lambda: [i.replica_id for i in r.server.registry.routable()] == ["rep-tls"], what="replica routable")
        yield {"replica": rep, "router": r}


def _request() -> gen_pb.GenerateRequest:
    return build_request("hello over TLS", max_tokens=4, temperature=0.0, ignore_eos=True)


def _refused(target: str, credentials: grpc.ChannelCredentials | None, stub=gen_grpc.GenerationServiceStub) -> grpc.RpcError:
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel, pytest.raises(grpc.RpcError) as err:
        stub(channel).GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=5)
    return err.value


def test_generate_over_tls_through_the_router_to_an_mtls_replica(cluster, pki):
    out = io.StringIO()
    result = stream_generate(cluster["router"].target, _request(), timeout=T, out=out,
                             credentials=channel_credentials(pki["ca"]))
    assert result.final is not None and result.final.usage.completion_tokens == 4
    assert result.final.routing.replica_id == "rep-tls" and out.getvalue() == result.text


def test_a_plaintext_client_is_refused(cluster):
    assert _refused(cluster["router"].target, None).code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_that_trusts_another_ca_is_refused(cluster, pki):
    err = _refused(cluster["router"].target, channel_credentials(pki["other_ca"]))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("client", [None, "stranger"], ids=["no-cert", "cert-of-another-ca"])
def test_mtls_refuses_a_client_without_a_cert_of_its_ca(cluster, pki, client):
    cert, key = pki[client] if client else ("", "")
    err = _refused(cluster["replica"].target, channel_credentials(pki["ca"], cert, key), rep_grpc.ReplicaServiceStub)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    cert, key = pki["client"]  # the same call with a certificate of the replica's client CA works
    with grpc.secure_channel(cluster["replica"].target, channel_credentials(pki["ca"], cert, key)) as ch:
        assert rep_grpc.ReplicaServiceStub(ch).GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=T).block_size == 16


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(cert_file="c.pem", key_file=""), "tls_cert_file, tls_key_file: set both or neither"),
    (dict(cert_file="", key_file="", client_ca_file="ca.pem"), "tls_client_ca_file: needs tls_cert_file"),
    (dict(cert_file="/nonexistent.pem", key_file="/nonexistent.key"), "tls_key_file: cannot read /nonexistent.key"),
])
def test_a_half_set_server_config_is_an_error_naming_the_setting(kwargs, match):
    with pytest.raises(ValueError, match=match):
        server_credentials(**kwargs)


def test_a_client_cert_without_a_ca_is_an_error_naming_the_setting():
    with pytest.raises(ValueError, match="replica_tls_cert_file, replica_tls_key_file: need replica_tls_ca_file"):
        channel_credentials("", "c.pem", "k.pem", prefix="replica_tls_")


@pytest.mark.parametrize(("main", "argv", "message"), [
    ("router", ["--tls-cert-file", "c.pem"], "tls_cert_file, tls_key_file: set both or neither"),
    ("router", ["--replica-tls-cert-file", "c.pem"], "need replica_tls_ca_file"),
    ("router", ["--replica-tls-server-name", "replica.svc"], "replica_tls_server_name: needs replica_tls_ca_file"),
    ("router", ["--admin-token-file", "/nonexistent/token"], "admin_token_file: cannot read /nonexistent/token"),
    ("replica", ["--tls-client-ca-file", "ca.pem"], "tls_client_ca_file: needs tls_cert_file"),
    ("replica", ["--redis-password", "a", "--redis-password-file", "f"], "redis_password, redis_password_file"),
])
def test_a_bad_security_setting_stops_the_process_with_exit_2_naming_it(capsys, main, argv, message):
    import replica.server
    import router.server

    assert {"router": router.server, "replica": replica.server}[main].main(argv) == 2
    assert message in capsys.readouterr().err


def test_replica_tls_server_name_checks_the_replicas_name_not_the_ip_dialed(redis_server, default_model_dir, pki,
                                                                          tmp_path):
    """A replica whose certificate names only its DNS name (as a pod's does: not the pod IP the
    router dials): without ``replica_tls_server_name`` the handshake fails and the call is
    UNAVAILABLE; with the name set the same call is served."""
    cert, key = TestCA(tmp_path, "named-ca").issue("rep-named", ("rep.tls.svc",), loopback=False)
    ca = str(tmp_path / "named-ca.pem")
    replica = ReplicaSettings(
        host="127.0.0.1", port=0, model=str(default_model_dir), replica_id="rep-named", redis_url=redis_server.url,
        namespace="tls-named", num_blocks=64, torch_threads=1, heartbeat_interval=0.2, heartbeat_ttl=5.0,
        max_num_seqs=2, tls_cert_file=cert, tls_key_file=key,
    )
    base = dict(host="127.0.0.1", port=0, redis_url=redis_server.url, namespace="tls-named",
                model=str(default_model_dir), heartbeat_poll_interval=0.1, replica_tls_ca_file=ca, max_retries=0)
    with BackgroundReplica(replica):
        for server_name, served in (("", False), ("rep.tls.svc", True)):
            with BackgroundRouter(RouterSettings(**base, replica_tls_server_name=server_name)) as r:
                wait_for(lambda r=r: len(r.server.registry.routable()) == 1, what="replica routable")
                with grpc.insecure_channel(r.target) as ch:
                    stub = gen_grpc.GenerationServiceStub(ch)
                    if served:
                        assert stub.Generate(_request(), timeout=T).usage.completion_tokens == 4
                    else:
                        with pytest.raises(grpc.RpcError) as err:
                            stub.Generate(_request(), timeout=T)
                        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
