"""The HTTP API and the metrics port over TLS (``http_tls``, ``metrics_tls``: the gRPC server's
certificate, key and client CA, kvroute.tls.server_tls_files), through the ``openai`` client.

One replica serving https with mutual TLS on its HTTP API and metrics port, one router serving
https (TLS without client certificates) in front of it. Covered: a chat completion through either
front with the ``openai`` client trusting the test CA; a client that trusts another CA refused
with a certificate error; a plaintext client answered nothing; the replica's mutual TLS refusing a
client without a certificate of its CA; a scrape over https with a client certificate; the switches without a certificate
refused at start, naming the setting."""

from __future__ import annotations

import ssl

import httpx2
import openai
import pytest

from kvroute.telemetry import setup_telemetry
from replica.server import BackgroundReplica
from replica.settings import ReplicaSettings
from router.server import BackgroundRouter
from router.settings import RouterSettings
from tests.support import wait_for

T = 30.0


@pytest.fixture(scope="module")
def servers(redis_server, default_model_dir, pki):
    cert, key = pki["replica"]
    replica = ReplicaSettings(
        host="127.0.0.1", port=0, model=str(default_model_dir), replica_id="rep-https", redis_url=redis_server.url,
        namespace="https", num_blocks=64, torch_threads=1, heartbeat_interval=0.2, heartbeat_ttl=5.0, max_num_seqs=2,
        http_port=0, http_tls=True,
        tls_cert_file=cert, tls_key_file=key, tls_client_ca_file=pki["ca"],  # mutual TLS
    )
    cert, key = pki["router"]
    client_cert, client_key = pki["client"]
    router = RouterSettings(
        host="127.0.0.1", port=0, redis_url=redis_server.url, namespace="https", model=str(default_model_dir),
        heartbeat_poll_interval=0.1, http_port=0, http_tls=True, tls_cert_file=cert, tls_key_file=key,
        replica_tls_ca_file=pki["ca"], replica_tls_cert_file=client_cert, replica_tls_key_file=client_key,
    )
    with BackgroundReplica(replica) as rep, BackgroundRouter(router) as r:
        wait_for(lambda: [i.replica_id for i in r.server.registry.routable()] == ["rep-https"], what="replica routable")
        yield {"replica": rep, "router": r}


def context(ca: str, cert: tuple[str, str] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca)
    if cert is not None:
        ctx.load_cert_chain(*cert)
    return ctx


def client(server, ctx: ssl.SSLContext) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.server._http.url, api_key="unused", max_retries=0, timeout=T,
                         http_client=httpx2.Client(verify=ctx, timeout=T))


def chat(c: openai.OpenAI):
    return c.chat.completions.create(model="kvroute-tiny-llama", max_tokens=4, temperature=0.0,
                                     messages=[{"role": "user", "content": "hello over https"}])


@pytest.mark.parametrize("front", ["router", "replica"])
def test_a_chat_completion_over_https_with_the_openai_client(servers, pki, front):
    assert servers[front].server._http.url.startswith("https://127.0.0.1:")
    cert = pki["client"] if front == "replica" else None  # the replica requires a client certificate
    out = chat(client(servers[front], context(pki["ca"], cert)))
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"


def test_a_client_that_trusts_another_ca_is_refused(servers, pki):
    with pytest.raises(openai.APIConnectionError) as err:
        chat(client(servers["router"], context(pki["other_ca"])))
    assert isinstance(err.value.__cause__, httpx2.ConnectError) and "CERTIFICATE_VERIFY_FAILED" in str(err.value.__cause__)


def test_a_plaintext_client_gets_no_answer(servers):
    url = servers["router"].server._http.url.replace("https://", "http://")
    with pytest.raises(httpx2.HTTPError):
        httpx2.get(f"{url.removesuffix('/v1')}/health", timeout=T)


@pytest.mark.parametrize("cert", [None, "stranger"], ids=["no-cert", "cert-of-another-ca"])
def test_the_replicas_mutual_tls_refuses_a_client_without_a_cert_of_its_ca(servers, pki, cert):
    with pytest.raises(openai.APIConnectionError):
        chat(client(servers["replica"], context(pki["ca"], pki[cert] if cert else None)))


def test_the_metrics_port_serves_https_to_a_scraper_with_a_client_cert(pki):
    cert, key = pki["replica"]
    settings = ReplicaSettings(metrics_port=0, metrics_tls=True, tls_cert_file=cert, tls_key_file=key,
                               tls_client_ca_file=pki["ca"])
    telemetry = setup_telemetry("kvroute-replica", 0, otlp=False, metrics_tls=settings.metrics_tls_files())
    try:
        telemetry.meter("kvroute.replica").create_counter("kvroute_tls_probe").add(3)
        url = f"https://127.0.0.1:{telemetry.metrics_port}/metrics"
        body = httpx2.get(url, verify=context(pki["ca"], pki["client"]), timeout=T).text
        assert "kvroute_tls_probe_total{" in body and body.split("kvroute_tls_probe_total{")[1].split("} ")[1].startswith("3.0")
        with pytest.raises(httpx2.HTTPError):
            httpx2.get(url, verify=context(pki["ca"]), timeout=T)  # no client certificate
        with pytest.raises(httpx2.HTTPError):
            httpx2.get(url.replace("https", "http"), timeout=T)
    finally:
        telemetry.shutdown()


@pytest.mark.parametrize("main", ["router", "replica"])
@pytest.mark.parametrize("switch", ["--http-tls", "--metrics-tls"])
def test_a_tls_switch_without_a_certificate_stops_the_process_with_exit_2_naming_it(capsys, main, switch):
    import replica.server
    import router.server

    assert {"router": router.server, "replica": replica.server}[main].main([switch]) == 2
    assert f"{switch[2:].replace('-', '_')}: needs tls_cert_file and tls_key_file" in capsys.readouterr().err
