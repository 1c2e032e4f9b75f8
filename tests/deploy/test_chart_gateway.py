"""The chart's gateway modes, rendered by Helm's engine: ``envoy`` (an Envoy Deployment whose
bootstrap is ``kvroute_tools.envoy.bootstrap``'s, checked against the generator and by the real
Envoy binary's ``--mode validate``) and ``inferencePool`` (an InferencePool, an example HTTPRoute
and, for Istio, a DestinationRule for the picker's TLS, validated against the published CRDs' v1
schemas in tests/deploy/data/). The Kubernetes schemas of the built-in kinds are
test_chart_render.py's matrix."""

from __future__ import annotations

import copy
import json
import re
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvroute_tools.envoy import bootstrap, envoy_binary
from kvroute_tools.redis_server import free_port
from tests.deploy.chart import FULLNAME, NAMESPACE, container, env_of, find, helm, notes, pod_spec, render
from tests.deploy.envoy_chart import BOOTSTRAP_FILE, TLS_BOOTSTRAP_FILE, TLS_DIR, chart_tls, file_text
from tests.support import wait_for
from tests.support_tls import TestCA

ROUTER, REPLICA, ENVOY = f"{FULLNAME}-router", f"{FULLNAME}-replica", f"{FULLNAME}-envoy"
DATA = Path(__file__).resolve().parent / "data"
ENVOY_MODE = {"gateway": {"mode": "envoy"}}
POOL_MODE = {"gateway": {"mode": "inferencePool"}}


def crd_schema(file_name: str, version: str = "v1") -> dict[str, Any]:
    """The ``openAPIV3Schema`` of one version of a stored CRD, made strict the way the API server's
    strict field validation is: an object schema listing its ``properties`` takes no others
    (unless it says ``x-kubernetes-preserve-unknown-fields``)."""
    crd = yaml.safe_load((DATA / file_name).read_text())
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]

    def strict(node: Any) -> None:
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for child in node.values():
                strict(child)
        elif isinstance(node, list):
            for child in node:
                strict(child)

    strict(schema)
    # The API server takes an object's apiVersion, kind and metadata whether its schema lists them or not.
    for field, type_ in (("apiVersion", "string"), ("kind", "string"), ("metadata", "object")):
        schema["properties"].setdefault(field, {"type": type_})
    return schema


def crd_errors(doc: dict, file_name: str) -> list[str]:
    validator = jsonschema.Draft4Validator(crd_schema(file_name))
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]


POOL_CRDS = {"v1.0": "inference.networking.k8s.io_inferencepools.v1.0.0.yaml",  # the first v1 API
             "v1.6": "inference.networking.k8s.io_inferencepools.v1.6.0.yaml"}  # the latest release
POOL_CRD = POOL_CRDS["v1.6"]
ROUTE_CRD = "gateway.networking.k8s.io_httproutes.yaml"
DESTINATION_RULE_CRD = "networking.istio.io_destinationrules.v1.30.3.yaml"


def rendered_bootstrap(values: dict) -> dict:
    return json.loads(find(render(values), "ConfigMap", ENVOY)["data"]["envoy.json"])


# --- envoy -------------------------------------------------------------------------------------


def test_the_charts_bootstrap_file_is_the_generators_output():
    assert BOOTSTRAP_FILE.read_text() == file_text(), \
        "kvroute_tools.envoy.bootstrap changed: run PYTHONPATH=. python -m tests.deploy.envoy_chart"


def test_the_rendered_bootstrap_is_the_generators_for_the_release_addresses():
    values = {"gateway": {"mode": "envoy", "envoy": {"port": 9443, "adminPort": 9902, "readyPort": 19009}},
              "router": {"service": {"port": 50060}, "picker": {"port": 9012}}}
    config = rendered_bootstrap(values)
    listeners, clusters = config["static_resources"]["listeners"], config["static_resources"]["clusters"]
    ready = listeners.pop([x["name"] for x in listeners].index("ready"))
    admin = clusters.pop([c["name"] for c in clusters].index("envoy_admin"))
    # Everything else is exactly the generator's, addresses included.
    assert config == bootstrap(listen_host="0.0.0.0", listen_port=9443, router_host=f"{ROUTER}.{NAMESPACE}.svc",
                               router_port=50060, picker_host=f"{ROUTER}.{NAMESPACE}.svc", picker_port=9012,
                               admin_host="127.0.0.1", admin_port=9902)
    # The kubelet's listener: only /ready, to the admin on loopback.
    assert ready["address"] == {"socket_address": {"address": "0.0.0.0", "port_value": 19009}}
    hcm = ready["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["route_config"]["virtual_hosts"][0]["routes"] == [
        {"match": {"path": "/ready"}, "route": {"cluster": "envoy_admin"}}]
    assert admin["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] == {
        "socket_address": {"address": "127.0.0.1", "port_value": 9902}}


def test_the_real_envoy_accepts_the_rendered_bootstrap(tmp_path):
    path = tmp_path / "envoy.json"
    path.write_text(find(render(ENVOY_MODE), "ConfigMap", ENVOY)["data"]["envoy.json"])
    done = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and f"configuration '{path}' OK" in done.stdout + done.stderr, done.stderr[-2000:]
    # And the check can fail: a listener without an address is refused.
    broken = json.loads(path.read_text())
    del broken["static_resources"]["listeners"][0]["address"]
    path.write_text(json.dumps(broken))
    bad = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def test_the_kubelets_ready_listener_answers_ready_and_nothing_else_of_the_admin(tmp_path):
    """The rendered bootstrap run by the real Envoy: the probe's port gives the admin's /ready
    (LIVE), no other admin path, and the admin itself answers on 127.0.0.1 only."""
    ports = {"port": free_port(), "adminPort": free_port(), "readyPort": free_port()}
    path = tmp_path / "envoy.json"
    path.write_text(find(render({"gateway": {"mode": "envoy", "envoy": ports}}), "ConfigMap", ENVOY)["data"]["envoy.json"])
    with (tmp_path / "envoy.log").open("w") as log:
        proc = subprocess.Popen([envoy_binary(), "-c", str(path), "--disable-hot-restart", "--concurrency", "1",
                                 "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    try:
        ready = f"http://127.0.0.1:{ports['readyPort']}"
        wait_for(lambda: _get(f"{ready}/ready")[0] == 200 or proc.poll() is not None, timeout=30, what="envoy ready")
        assert proc.poll() is None, (tmp_path / "envoy.log").read_text()[-2000:]
        assert _get(f"{ready}/ready") == (200, "LIVE\n")
        assert _get(f"{ready}/stats")[0] == 404 and _get(f"{ready}/quitquitquit")[0] == 404
        assert _get(f"http://127.0.0.1:{ports['adminPort']}/ready") == (200, "LIVE\n")
        with socket.socket() as s:  # another loopback address: the admin is not bound there
            assert s.connect_ex(("127.0.0.2", ports["adminPort"])) != 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_envoy_image_is_the_envoy_of_the_wheel_kvroute_up_runs():
    out = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True, timeout=60).stdout
    version = re.search(r"/(\d+\.\d+\.\d+)/", out).group(1)
    c = container(find(render(ENVOY_MODE), "Deployment", ENVOY), "envoy")
    assert c["image"] == f"docker.io/envoyproxy/envoy:v{version}"


def test_the_envoy_deployment_runs_the_bootstrap_non_root_with_probes_on_ready():
    docs = render(ENVOY_MODE)
    deployment = find(docs, "Deployment", ENVOY)
    c = container(deployment, "envoy")
    assert c["command"] == ["envoy"]
    assert c["args"][:2] == ["--config-path", "/etc/envoy/envoy.json"] and "--disable-hot-restart" in c["args"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 8080, "ready": 19001}
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/ready", "port": "ready"}
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"]
    assert c["resources"]["requests"] == {"cpu": "500m", "memory": "256Mi"} and c["resources"]["limits"]["memory"]
    assert {"name": "bootstrap", "configMap": {"name": ENVOY}} in pod_spec(deployment)["volumes"]
    assert pod_spec(deployment)["automountServiceAccountToken"] is False
    # The Service sends the clients to the Envoy pods' listener.
    svc = find(docs, "Service", ENVOY)
    assert svc["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"] == [{"name": "grpc", "port": 8080, "targetPort": "grpc", "protocol": "TCP",
                                     "appProtocol": "kubernetes.io/h2c"}]
    # The routers still run: they are the picker.
    assert find(docs, "Deployment", ROUTER)
    # A changed bootstrap rolls the Envoy pods.
    other = find(render({"gateway": {"mode": "envoy", "envoy": {"port": 9000}}}), "Deployment", ENVOY)
    key = "checksum/bootstrap"
    assert other["spec"]["template"]["metadata"]["annotations"][key] != \
        deployment["spec"]["template"]["metadata"]["annotations"][key]


def test_the_charts_tls_bootstrap_file_is_the_generators_output():
    assert TLS_BOOTSTRAP_FILE.read_text() == file_text(tls=True), \
        "kvroute_tools.envoy.bootstrap changed: run PYTHONPATH=. python -m tests.deploy.envoy_chart"


@pytest.mark.parametrize("mutual", [False, True])
def test_envoy_mode_with_tls_renders_the_generators_tls_bootstrap_for_the_release_names(mutual):
    values = {**ENVOY_MODE, "tls": {"enabled": True, "existingSecret": "kvr-tls", "mutual": mutual}}
    config = rendered_bootstrap(values)
    listeners, clusters = config["static_resources"]["listeners"], config["static_resources"]["clusters"]
    listeners.pop([x["name"] for x in listeners].index("ready"))
    clusters.pop([c["name"] for c in clusters].index("envoy_admin"))
    router_host = f"{ROUTER}.{NAMESPACE}.svc"
    assert config == bootstrap(
        listen_host="0.0.0.0", listen_port=8080, router_host=router_host, router_port=50050, picker_host=router_host,
        picker_port=9002, admin_host="127.0.0.1", admin_port=9901,
        tls=chart_tls(replica_server_name=f"{REPLICA}.{NAMESPACE}.svc", router_server_name=ROUTER, client_ca=mutual))
    # The Envoy pods mount the Secret the bootstrap names, and the routers check replicas by the same name.
    deployment = find(render(values), "Deployment", ENVOY)
    assert {"name": "tls", "secret": {"secretName": "kvr-tls"}} in pod_spec(deployment)["volumes"]
    assert {"name": "tls", "mountPath": TLS_DIR, "readOnly": True} in container(deployment, "envoy")["volumeMounts"]
    router_env = env_of(container(find(render(values), "Deployment", ROUTER), "router"))
    assert router_env["KVROUTE_REPLICA_TLS_SERVER_NAME"] == f"{REPLICA}.{NAMESPACE}.svc"


def test_the_real_envoy_accepts_the_rendered_tls_bootstrap_with_the_secrets_files(tmp_path):
    ca = TestCA(tmp_path, "ca")
    cert, key = ca.issue("kvroute")
    for name, source in (("tls.crt", cert), ("tls.key", key), ("ca.crt", ca.file)):
        (tmp_path / name).write_bytes(Path(source).read_bytes())
    values = {**ENVOY_MODE, "tls": {"enabled": True, "existingSecret": "kvr-tls", "mutual": True}}
    text = find(render(values), "ConfigMap", ENVOY)["data"]["envoy.json"]
    assert TLS_DIR in text
    path = tmp_path / "envoy.json"
    path.write_text(text.replace(TLS_DIR, str(tmp_path)))
    done = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and f"configuration '{path}' OK" in done.stdout + done.stderr, done.stderr[-2000:]
    (tmp_path / "tls.key").write_text("not a key")  # and the check reads the files
    bad = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0


def test_proxy_mode_renders_no_gateway_resources():
    kinds = {(d["kind"], d["metadata"]["name"]) for d in render({})}
    assert not {k for k in kinds if k[1] == ENVOY or k[0] in ("InferencePool", "HTTPRoute")}


# --- inferencePool -----------------------------------------------------------------------------


def test_the_inference_pool_validates_against_the_published_crd_and_selects_the_replicas():
    docs = render(POOL_MODE)
    pool = find(docs, "InferencePool", FULLNAME)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert crd_errors(pool, POOL_CRD) == []
    replica = find(docs, "StatefulSet", REPLICA)
    pod_labels = replica["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pool["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "replica"
    grpc_port = next(p["containerPort"] for p in container(replica, "replica")["ports"] if p["name"] == "grpc")
    assert pool["spec"]["targetPorts"] == [{"number": grpc_port}]
    assert pool["spec"]["appProtocol"] == "kubernetes.io/h2c"  # the replicas speak gRPC
    # The endpoint picker is the router Service's picker port (the EPP's 9002), failing closed.
    ref = pool["spec"]["endpointPickerRef"]
    router_svc = find(docs, "Service", ROUTER)
    assert (ref["kind"], ref["name"], ref["failureMode"]) == ("Service", ROUTER, "FailClose")
    ports = {p["name"]: p for p in router_svc["spec"]["ports"]}
    assert ports["picker"]["port"] == ref["port"]["number"] == 9002 and ports["picker"]["targetPort"] == "picker"
    router = find(docs, "Deployment", ROUTER)  # the router runs, as the picker, on that port
    rc = container(router, "router")
    assert {"name": "picker", "containerPort": 9002, "protocol": "TCP"} in rc["ports"]
    assert {"name": "KVROUTE_PICKER_PORT", "value": "9002"} in rc["env"]


@pytest.mark.parametrize("engine", ["kvroute", "vllm"])
@pytest.mark.parametrize("version", sorted(POOL_CRDS))
def test_the_inference_pool_validates_against_the_crd_of_the_gie_release_the_values_name(version, engine):
    values = {**POOL_MODE, "gateway": {"mode": "inferencePool", "inferencePool": {"version": version}},
              "replica": {"engine": engine}, "router": {"discovery": "redis"}}
    pool = find(render(values), "InferencePool", FULLNAME)
    assert crd_errors(pool, POOL_CRDS[version]) == []
    # appProtocol is v1.4's: v1.0's CRD refuses it (strict fields), so it is only there from v1.4,
    # for the kvroute engine's gRPC; the NOTES warn where a gRPC pool has none.
    grpc_pool = engine == "kvroute" and version >= "v1.4"
    assert ("appProtocol" in pool["spec"]) == grpc_pool
    assert ("has no appProtocol" in notes(values)) == (engine == "kvroute" and not grpc_pool)
    with_field = {**pool, "spec": {**pool["spec"], "appProtocol": "kubernetes.io/h2c"}}
    assert (crd_errors(with_field, POOL_CRDS[version]) == []) == (version >= "v1.4")


def test_the_crd_check_rejects_what_the_api_server_would():
    pool = find(render(POOL_MODE), "InferencePool", FULLNAME)
    for path, value, expected in ((("targetPorts", 0, "number"), 0, "minimum"),
                                  (("endpointPickerRef", "failureMode"), "FailSoft", "is not one of"),
                                  (("selector", "matchLabels", "app.kubernetes.io/name"), "-bad-", "does not match"),
                                  (("endpointPickerRef", "portt"), 1, "Additional properties")):
        bad = copy.deepcopy(pool)
        node = bad["spec"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        errors = crd_errors(bad, POOL_CRD)
        assert len(errors) == 1 and expected in errors[0], (path, errors)
    bad = copy.deepcopy(pool)
    del bad["spec"]["targetPorts"]
    assert crd_errors(bad, POOL_CRD) == ["spec: 'targetPorts' is a required property"]


def test_the_example_http_route_validates_and_sends_generation_calls_to_the_pool():
    docs = render({"gateway": {"mode": "inferencePool", "inferencePool": {
        "name": "llama-pool", "httpRoute": {"gatewayName": "shared-gw", "gatewayNamespace": "gateways"}}}})
    route = find(docs, "HTTPRoute", "llama-pool")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert crd_errors(route, ROUTE_CRD) == []
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                           "name": "shared-gw", "namespace": "gateways"}]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llama-pool"}]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/kvroute.v1.GenerationService"}}]
    assert find(docs, "InferencePool", "llama-pool")
    bad = copy.deepcopy(route)
    bad["spec"]["rules"][0]["matches"][0]["path"]["type"] = "Prefix"
    assert len(crd_errors(bad, ROUTE_CRD)) == 1
    # Off: the pool alone.
    docs = render({"gateway": {"mode": "inferencePool", "inferencePool": {"httpRoute": {"enabled": False}}}})
    assert not [d for d in docs if d["kind"] == "HTTPRoute"] and find(docs, "InferencePool", FULLNAME)


def istio_picker_tls(destination_rule: dict | None = None, **tls) -> dict:
    """inferencePool mode with gRPC TLS (``tls``: more of its keys) and the picker's DestinationRule on."""
    return {"gateway": {"mode": "inferencePool", "inferencePool": {"istio": {"destinationRule": {
                "enabled": True, **(destination_rule or {})}}}},
            "tls": {"enabled": True, "existingSecret": "kvr-tls", **tls}}


def test_the_istio_destination_rule_dials_the_picker_port_over_tls_by_the_routers_name():
    docs = render(istio_picker_tls())
    rule = find(docs, "DestinationRule", f"{ROUTER}-picker")
    assert rule["apiVersion"] == "networking.istio.io/v1"
    assert crd_errors(rule, DESTINATION_RULE_CRD) == []
    assert rule["spec"]["host"] == f"{ROUTER}.{NAMESPACE}.svc.cluster.local"
    # One port: the picker's, the one the InferencePool names (the router's other ports keep the mesh's policy).
    (port,) = rule["spec"]["trafficPolicy"]["portLevelSettings"]
    picker = next(p for p in find(docs, "Service", ROUTER)["spec"]["ports"] if p["name"] == "picker")
    assert port["port"]["number"] == picker["port"] == find(docs, "InferencePool", FULLNAME)["spec"][
        "endpointPickerRef"]["port"]["number"]
    # SNI and the name checked are the router Service's, which the router's certificate carries (the
    # probes and helm test check it against that name), verified with the Secret the router serves from.
    assert port["tls"] == {"mode": "SIMPLE", "sni": ROUTER, "subjectAltNames": [ROUTER], "credentialName": "kvr-tls"}
    test_pod = container(find(docs, "Pod", f"{FULLNAME}-test-health"), "health")
    assert test_pod["command"][test_pod["command"].index("--tls-server-name") + 1] == ROUTER
    router = find(docs, "Deployment", ROUTER)
    assert {"name": "tls", "secret": {"secretName": "kvr-tls"}} in pod_spec(router)["volumes"]
    assert {"KVROUTE_TLS_CERT_FILE", "KVROUTE_PICKER_PORT"} <= set(env_of(container(router, "router")))
    # And the check can fail: a mode Istio does not have.
    bad = copy.deepcopy(rule)
    bad["spec"]["trafficPolicy"]["portLevelSettings"][0]["tls"]["mode"] = "TLS"
    (error,) = crd_errors(bad, DESTINATION_RULE_CRD)
    assert "is not one of" in error


@pytest.mark.parametrize(("destination_rule", "tls", "want"), [
    ({}, {"mutual": True}, {"mode": "MUTUAL", "subjectAltNames": [ROUTER], "credentialName": "kvr-tls"}),
    ({"credentialName": "kvr-tls-copy"}, {}, {"mode": "SIMPLE", "subjectAltNames": [ROUTER], "credentialName": "kvr-tls-copy"}),
    ({"insecureSkipVerify": True}, {}, {"mode": "SIMPLE", "insecureSkipVerify": True}),
    ({"insecureSkipVerify": True}, {"mutual": True}, {"mode": "MUTUAL", "insecureSkipVerify": True, "credentialName": "kvr-tls"}),
], ids=["mutual", "credential-name", "insecure-skip-verify", "insecure-skip-verify-mutual"])
def test_the_istio_destination_rule_presents_and_checks_what_the_values_say(destination_rule, tls, want):
    rule = find(render(istio_picker_tls(destination_rule, **tls)), "DestinationRule", f"{ROUTER}-picker")
    assert crd_errors(rule, DESTINATION_RULE_CRD) == []
    (port,) = rule["spec"]["trafficPolicy"]["portLevelSettings"]
    assert port["tls"] == {"sni": ROUTER, **want}
    other = render({**istio_picker_tls(), "clusterDomain": "k8s.example", "router": {"picker": {"port": 9012}}})
    (port,) = find(other, "DestinationRule", f"{ROUTER}-picker")["spec"]["trafficPolicy"]["portLevelSettings"]
    assert port["port"] == {"number": 9012}
    assert find(other, "DestinationRule", f"{ROUTER}-picker")["spec"]["host"] == f"{ROUTER}.{NAMESPACE}.svc.k8s.example"


def test_the_istio_destination_rule_without_tls_is_refused_naming_both_keys():
    values = istio_picker_tls()
    values["tls"] = {"enabled": False}
    with pytest.raises(helm.HelmRenderError,
                       match=r"gateway\.inferencePool\.istio\.destinationRule\.enabled needs tls\.enabled"):
        render(values)
    # Off unless asked, and only in inferencePool mode.
    assert not [d for d in render({**istio_picker_tls(), "gateway": {"mode": "inferencePool"}}) if d["kind"] == "DestinationRule"]
    envoy = istio_picker_tls()
    envoy["gateway"]["mode"] = "envoy"
    assert not [d for d in render(envoy) if d["kind"] == "DestinationRule"]


def test_notes_name_the_front_of_each_mode():
    assert f"port-forward svc/{ENVOY} 8080:8080" in notes(ENVOY_MODE)
    text = notes(POOL_MODE)
    assert f"InferencePool {FULLNAME}" in text and "Gateway inference-gateway" in text


def test_notes_give_the_tls_flags_for_envoys_tls_listener_and_https_for_the_http_api():
    text = notes({**ENVOY_MODE, "tls": {"enabled": True, "existingSecret": "kvr-tls", "mutual": True}})
    assert "Envoy's listener serves TLS and requires a client certificate" in text
    assert (f"kvroute generate --target 127.0.0.1:8080 --tls-ca-file ca.crt --tls-cert-file tls.crt"
            f" --tls-key-file tls.key --tls-server-name {ROUTER}") in text
    assert "-plaintext" not in text
    text = notes({"tls": {"enabled": True, "existingSecret": "kvr-tls", "http": True}})
    assert (f"curl --cacert ca.crt --connect-to {ROUTER}:8000:127.0.0.1:8000 https://{ROUTER}:8000/v1/models"
            in text) and "curl http://" not in text
    assert "curl http://127.0.0.1:8000/v1/models" in notes({"tls": {"enabled": True, "existingSecret": "kvr-tls"}})


@pytest.mark.parametrize(("extra", "warning"), [
    ({"tls": {"enabled": True, "existingSecret": "kvroute-tls"}}, "upstream TLS policy for the replica pods"),
    ({"networkPolicy": {"enabled": True}}, "your gateway's pods cannot reach them"),
])
def test_the_notes_warn_of_a_pool_the_gateway_cannot_reach(extra, warning):
    """TLS replicas behind an h2c pool, and replicas fenced off from the gateway by the release's
    own NetworkPolicy: both render, and both fail every call, so the NOTES say so; the same values
    without the pool (or with the gateway's pods let in) carry no such warning."""
    assert warning in notes({**POOL_MODE, **extra})
    assert warning not in notes(POOL_MODE)
    assert warning not in notes({**extra, "router": {"discovery": "redis"}})
    if "networkPolicy" in extra:
        let_in = {"networkPolicy": {"enabled": True, "replicaIngressFrom": [
            {"podSelector": {"matchLabels": {"app": "gateway"}}}]}}
        assert warning not in notes({**POOL_MODE, **let_in})
