"""The chart rendered by Helm's engine for a matrix of values (defaults, external Redis with an
existing Secret, an external Redis Cluster, CPU replicas, monitoring on, 1 and 3 routers with the HPA, kubernetes and static
discovery, the envoy and inferencePool gateway modes, gRPC TLS and mutual TLS, Istio's picker TLS, the model
downloaded from a Hub): every manifest validates against the Kubernetes schemas of 1.29 and 1.33
(kubernetes-validate, strict), each case renders what its values ask for, the chart lints clean
in strict mode, and the chart's contract with the code holds (appVersion, setting names)."""

from __future__ import annotations

import json
import re
import tomllib

import kubernetes_validate
import pytest
import yaml

from tests.deploy.chart import (
    CHART_DIR,
    FULLNAME,
    NAMESPACE,
    container,
    env_of,
    find,
    helm,
    kinds,
    notes,
    pod_spec,
    render,
    unknown_kvroute_env,
)

K8S_VERSIONS = ("1.29.0", "1.33.0")
ROUTER, REPLICA, REDIS = f"{FULLNAME}-router", f"{FULLNAME}-replica", f"{FULLNAME}-redis"
# Not in the Kubernetes schemas: ServiceMonitor checked field by field below, InferencePool, HTTPRoute
# and Istio's DestinationRule against their published CRDs in test_chart_gateway.py.
CRD_KINDS = {"ServiceMonitor", "InferencePool", "HTTPRoute", "DestinationRule"}

MATRIX = {
    "defaults": {},
    "external-redis-existing-secret": {
        "redis": {"enabled": False},
        "externalRedis": {"url": "rediss://redis.shared.svc:6380/2", "existingSecret": "redis-creds",
                          "secretKey": "password", "tls": {"caSecret": "redis-ca", "caKey": "ca.pem"}},
    },
    "external-redis-cluster": {
        "redis": {"enabled": False}, "cluster": {"eventShards": 12},
        "externalRedis": {"url": "redis://redis-0.redis-cluster:6379,redis://redis-1.redis-cluster:6379",
                          "cluster": True, "existingSecret": "redis-cluster-creds"},
        "replica": {"engine": "vllm"},
    },
    "cpu-replicas": {"replica": {"gpu": 0, "replicas": 3, "resources": {"requests": {"cpu": "1"}}}},
    "monitoring-on": {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
                      "otel": {"endpoint": "http://otel-collector.observability:4317"}},
    "one-router-hpa": {"router": {"replicas": 1, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 1}}},
    "three-routers-hpa": {"router": {"replicas": 3, "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 9}}},
    "discovery-kubernetes": {"router": {"discovery": "kubernetes"}},
    "discovery-static": {"router": {"discovery": "static"}, "replica": {"replicas": 2}},
    "gateway-envoy": {"gateway": {"mode": "envoy"}},
    "gateway-inference-pool": {"gateway": {"mode": "inferencePool"}, "router": {"discovery": "redis"}},
    "tls": {"tls": {"enabled": True, "existingSecret": "kvr-tls"}, "router": {"discovery": "static"}},
    "tls-mutual": {"tls": {"enabled": True, "existingSecret": "kvr-tls", "mutual": True}},
    "network-policy": {"networkPolicy": {"enabled": True, "metricsFrom": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]}, "replica": {"priorityClassName": "gpu-serving"},
                       "router": {"priorityClassName": "kvroute-critical"}},
    "tls-everywhere": {"tls": {"enabled": True, "existingSecret": "kvr-tls", "mutual": True, "http": True, "metrics": True},
                       "gateway": {"mode": "envoy"}, "metrics": {"serviceMonitor": {"enabled": True}}},
    "vllm-replicas": {"replica": {"engine": "vllm", "vllm": {"extraArgs": ["--max-model-len", "4096"]}}},
    "vllm-static": {"replica": {"engine": "vllm"}, "router": {"discovery": "static"}},
    "vllm-inference-pool": {"replica": {"engine": "vllm"}, "router": {"discovery": "redis"},
                            "gateway": {"mode": "inferencePool"}},
    "model-download": {"replica": {"model": {"source": "download", "download": {
        "repo": "Qwen/Qwen2.5-0.5B-Instruct", "endpoint": "https://hub.example.com", "tokenSecret": {"name": "hf-token"},
        "image": {"repository": "registry.example.com/hf-downloader", "tag": "1.2", "digest": "sha256:" + "d" * 64}}}}},
    "vllm-model-download": {"replica": {"engine": "vllm", "model": {"source": "download", "download": {
        "repo": "Qwen/Qwen2.5-0.5B-Instruct"}}}},
    "inference-pool-istio-picker-tls": {"gateway": {"mode": "inferencePool", "inferencePool": {
        "istio": {"destinationRule": {"enabled": True}}}}, "tls": {"enabled": True, "existingSecret": "kvr-tls", "mutual": True}},
}


@pytest.fixture(scope="module", params=sorted(MATRIX))
def case(request) -> tuple[str, list[dict]]:
    return request.param, render(MATRIX[request.param])


def test_every_manifest_validates_against_two_kubernetes_versions(case):
    name, docs = case
    checked = 0
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']} on {version}: {path}: {e.message}")
            checked += 1
    assert checked >= 2 * 10, f"{name}: only {checked // 2} manifests validated"


def test_every_kvroute_variable_is_a_setting_the_program_reads(case):
    name, docs = case
    assert unknown_kvroute_env(docs) == [], name


def test_defaults_render_the_whole_release():
    docs = render({})
    assert kinds(docs) == sorted([
        ("ConfigMap", f"{FULLNAME}-dashboard"), ("Deployment", ROUTER), ("PodDisruptionBudget", REPLICA),
        ("PodDisruptionBudget", ROUTER),
        ("Pod", f"{FULLNAME}-test-health"), ("Role", ROUTER), ("RoleBinding", ROUTER), ("Secret", REDIS),
        ("Service", REDIS), ("Service", REPLICA), ("Service", ROUTER), ("ServiceAccount", ROUTER),
        ("StatefulSet", REDIS), ("StatefulSet", REPLICA),
    ])
    for d in docs:
        labels = d["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "kvroute" and labels["app.kubernetes.io/instance"] == "kvr"
        assert labels["app.kubernetes.io/managed-by"] == "Helm" and labels["app.kubernetes.io/version"] == "0.1.0"

    router = find(docs, "Deployment", ROUTER)
    assert router["spec"]["replicas"] == 2
    rc = container(router, "router")
    assert rc["command"] == ["kvroute", "router"] and "args" not in rc
    assert {p["name"]: p["containerPort"] for p in rc["ports"]} == {"grpc": 50050, "http": 8000, "metrics": 9090}
    assert rc["readinessProbe"]["grpc"] == {"port": 50050, "service": "readiness"}
    assert rc["livenessProbe"]["grpc"] == {"port": 50050, "service": "liveness"}
    assert rc["securityContext"]["runAsNonRoot"] is True and rc["securityContext"]["readOnlyRootFilesystem"] is True
    env = env_of(rc)
    assert env["KVROUTE_DISCOVERY"] == "kubernetes" and env["KVROUTE_K8S_SERVICE"] == REPLICA
    assert env["KVROUTE_K8S_PORT_NAME"] == "grpc" and env["KVROUTE_K8S_NAMESPACE"] == "$(POD_NAMESPACE)"
    assert env["KVROUTE_REDIS_URL"] == f"redis://{REDIS}:6379/0"
    assert env["KVROUTE_REDIS_PASSWORD"] == {"secretKeyRef": {"name": REDIS, "key": "redis-password"}}
    assert pod_spec(router)["serviceAccountName"] == ROUTER and pod_spec(router)["automountServiceAccountToken"]
    assert pod_spec(router)["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    role = find(docs, "Role", ROUTER)
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    svc = find(docs, "Service", ROUTER)
    assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == [("grpc", 50050), ("http", 8000), ("metrics", 9090)]

    replica = find(docs, "StatefulSet", REPLICA)
    assert replica["spec"]["serviceName"] == REPLICA and replica["spec"]["replicas"] == 2
    rep = container(replica, "replica")
    assert rep["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert rep["startupProbe"]["grpc"] == {"port": 50051, "service": "readiness"}
    assert rep["startupProbe"]["periodSeconds"] * rep["startupProbe"]["failureThreshold"] == 600  # the load budget
    env = env_of(rep)
    assert env["KVROUTE_REPLICA_ID"] == "$(POD_NAME)" and env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["KVROUTE_ADVERTISE_ADDRESS"] == "$(POD_IP):50051" and env["KVROUTE_DEVICE"] == "cuda"
    assert env["KVROUTE_DRAIN_TIMEOUT"] == "30"
    assert pod_spec(replica)["terminationGracePeriodSeconds"] == 60
    volumes = {v["name"]: v for v in pod_spec(replica)["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert volumes["models"] == {"name": "models", "emptyDir": {}}
    assert container(replica, "generate-model")["command"] == [
        "python", "-m", "kvroute_tools.resolve_model", "", "/models"]
    headless = find(docs, "Service", REPLICA)
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["ports"][0]["name"] == "grpc"
    assert not headless["spec"].get("publishNotReadyAddresses")  # readiness must reach the EndpointSlices

    redis = container(find(docs, "StatefulSet", REDIS), "redis")
    assert redis["args"][redis["args"].index("--save") + 1] == ""
    assert redis["args"][redis["args"].index("--appendonly") + 1] == "no"
    assert redis["args"][redis["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    secret = find(docs, "Secret", REDIS)
    assert len(secret["data"]["redis-password"]) == 44  # 32 random characters, base64

    test_pod = find(docs, "Pod", f"{FULLNAME}-test-health")
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert test_pod["spec"]["containers"][0]["command"] == ["kvroute", "health", "--target", f"{ROUTER}:50050"]


def test_external_redis_uses_the_existing_secret_and_the_ca_and_runs_no_redis():
    docs = render(MATRIX["external-redis-existing-secret"])
    assert not [d for d in docs if "redis" in d["metadata"]["name"]]
    for kind, name, cname in (("Deployment", ROUTER, "router"), ("StatefulSet", REPLICA, "replica")):
        w = find(docs, kind, name)
        env = env_of(container(w, cname))
        assert env["KVROUTE_REDIS_URL"] == "rediss://redis.shared.svc:6380/2"
        assert env["KVROUTE_REDIS_PASSWORD"] == {"secretKeyRef": {"name": "redis-creds", "key": "password"}}
        assert env["KVROUTE_REDIS_CA_FILE"] == "/etc/kvroute/redis-ca/ca.pem"
        assert {"name": "redis-ca", "secret": {"secretName": "redis-ca"}} in pod_spec(w)["volumes"]


def test_an_external_redis_cluster_sets_redis_cluster_on_routers_replicas_and_bridges():
    values = MATRIX["external-redis-cluster"]
    docs = render(values)
    assert not [d for d in docs if "redis" in d["metadata"]["name"]]
    for kind, name, cname in (("Deployment", ROUTER, "router"), ("StatefulSet", REPLICA, "bridge")):
        env = env_of(container(find(docs, kind, name), cname))
        assert env["KVROUTE_REDIS_URL"] == values["externalRedis"]["url"]
        assert env["KVROUTE_REDIS_CLUSTER"] == "true" and env["KVROUTE_EVENT_SHARDS"] == "12"
        assert env["KVROUTE_REDIS_PASSWORD"] == {"secretKeyRef": {"name": "redis-cluster-creds", "key": "redis-password"}}
    assert "Redis Cluster at redis://redis-0.redis-cluster:6379," in notes(values)
    for d in render({}) + render(MATRIX["external-redis-existing-secret"]):  # a single Redis: not set
        if d["kind"] in ("Deployment", "StatefulSet"):
            assert all("KVROUTE_REDIS_CLUSTER" not in env_of(c) for c in pod_spec(d)["containers"])


def test_the_routers_init_container_writes_the_tokenizer_with_the_router_image_not_the_replicas():
    docs = render({})
    router_init = pod_spec(find(docs, "Deployment", ROUTER))["initContainers"][0]
    replica_init = pod_spec(find(docs, "StatefulSet", REPLICA))["initContainers"][0]
    assert router_init["image"] == container(find(docs, "Deployment", ROUTER), "router")["image"]
    assert router_init["command"][-3:] == ["--tokenizer-only", "", "/models"]
    assert replica_init["image"] == container(find(docs, "StatefulSet", REPLICA), "replica")["image"]
    assert "--tokenizer-only" not in replica_init["command"]


IMAGE_REPOSITORIES = {"router": "ghcr.io/kvroute/kvroute-router", "replica": "ghcr.io/kvroute/kvroute-replica",
                      "vllm": "docker.io/vllm/vllm-openai", "envoy": "docker.io/envoyproxy/envoy",
                      "redis": "docker.io/library/redis"}


def test_an_image_digest_pins_every_pod_that_runs_the_image_and_the_tag_is_ignored():
    digest = {image: "sha256:" + hex_digit * 64 for image, hex_digit in zip(IMAGE_REPOSITORIES, "0a1b2", strict=True)}
    pinned = lambda image: {"tag": "ignored", "digest": digest[image]}  # noqa: E731
    values = {"router": {"image": pinned("router")}, "replica": {"image": pinned("replica"), "vllm": {"image": pinned("vllm")}},
              "gateway": {"envoy": {"image": pinned("envoy")}}, "redis": {"image": pinned("redis")}}
    # Which image each container runs: the kvroute engine in proxy mode, then vLLM replicas behind Envoy.
    runs = {("Deployment", ROUTER, "generate-model"): "router", ("Deployment", ROUTER, "router"): "router",
            ("StatefulSet", REPLICA, "generate-model"): "replica", ("StatefulSet", REPLICA, "replica"): "replica",
            ("StatefulSet", REDIS, "redis"): "redis", ("Pod", f"{FULLNAME}-test-health", "health"): "router"}
    vllm_runs = {("StatefulSet", REPLICA, "generate-model"): "replica", ("StatefulSet", REPLICA, "vllm"): "vllm",
                 ("StatefulSet", REPLICA, "bridge"): "router", ("Deployment", f"{FULLNAME}-envoy", "envoy"): "envoy"}
    vllm_behind_envoy = {**values, "gateway": {"mode": "envoy", "envoy": {"image": pinned("envoy")}},
                         "replica": {**values["replica"], "engine": "vllm"}}
    for case_values, expected in ((values, runs), (vllm_behind_envoy, vllm_runs)):
        images = {}
        for d in render(case_values):
            if d["kind"] in ("Deployment", "StatefulSet", "Pod"):
                spec = pod_spec(d)
                images |= {(d["kind"], d["metadata"]["name"], c["name"]): c["image"]
                           for c in spec.get("initContainers", []) + spec["containers"]}
        assert {k: images[k] for k in expected} == {k: f"{IMAGE_REPOSITORIES[v]}@{digest[v]}" for k, v in expected.items()}
        assert not [ref for ref in images.values() if "ignored" in ref or "@" not in ref], images  # none left unpinned
    assert {*runs.values(), *vllm_runs.values()} == set(IMAGE_REPOSITORIES)
    # Unset: repository:tag, kvroute's own images at the chart's appVersion.
    docs = render({})
    assert container(find(docs, "Deployment", ROUTER), "router")["image"] == "ghcr.io/kvroute/kvroute-router:0.1.0"
    assert container(find(docs, "StatefulSet", REDIS), "redis")["image"] == "docker.io/library/redis:7.4-alpine"


def test_the_gpu_resource_name_is_the_operators_and_one_engine_gets_one_gpu():
    from tests.deploy.chart import helm

    docs = render({"replica": {"gpuResourceName": "amd.com/gpu"}})
    replica = find(docs, "StatefulSet", REPLICA)
    assert container(replica, "replica")["resources"]["limits"]["amd.com/gpu"] == 1
    assert "nvidia.com/gpu" not in json.dumps(replica)
    assert {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod_spec(replica)["tolerations"]
    with pytest.raises(helm.HelmRenderError) as err:  # two GPUs, of which kvroute's engine would use one
        render({"replica": {"gpu": 2}})
    assert "replica.gpu: 2, but kvroute's engine runs on one GPU" in str(err.value)
    vllm = find(render({"replica": {"engine": "vllm", "gpu": 2}}), "StatefulSet", REPLICA)  # tensor parallel
    assert container(vllm, "vllm")["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_network_policies_admit_only_the_releases_own_parts_and_the_named_peers():
    docs = render(MATRIX["network-policy"])
    part = lambda component: {"podSelector": {"matchLabels": {  # noqa: E731
        "app.kubernetes.io/name": "kvroute", "app.kubernetes.io/instance": "kvr", "app.kubernetes.io/component": component}}}
    replicas = find(docs, "NetworkPolicy", REPLICA)["spec"]
    assert replicas["podSelector"]["matchLabels"] == part("replica")["podSelector"]["matchLabels"]
    serving, metrics = replicas["ingress"]
    assert serving["from"] == [part("router"), part("envoy")] and serving["ports"] == [{"port": 50051}]
    assert metrics == {"ports": [{"port": 9090}], "from": MATRIX["network-policy"]["networkPolicy"]["metricsFrom"]}
    [redis] = find(docs, "NetworkPolicy", REDIS)["spec"]["ingress"]
    assert redis == {"from": [part("router"), part("replica")], "ports": [{"port": 6379}]}
    # Each policy selects pods that exist with those labels.
    for kind, name, component in (("Deployment", ROUTER, "router"), ("StatefulSet", REPLICA, "replica"),
                                  ("StatefulSet", REDIS, "redis")):
        labels = find(docs, kind, name)["spec"]["template"]["metadata"]["labels"]
        assert part(component)["podSelector"]["matchLabels"].items() <= labels.items(), name
    assert not [d for d in render({}) if d["kind"] == "NetworkPolicy"]
    # The priority classes reach the pods.
    assert pod_spec(find(docs, "StatefulSet", REPLICA))["priorityClassName"] == "gpu-serving"
    assert pod_spec(find(docs, "Deployment", ROUTER))["priorityClassName"] == "kvroute-critical"
    assert "priorityClassName" not in pod_spec(find(render({}), "StatefulSet", REPLICA))


def test_cpu_replicas_request_no_gpu_and_run_on_cpu():
    docs = render(MATRIX["cpu-replicas"])
    replica = find(docs, "StatefulSet", REPLICA)
    rep = container(replica, "replica")
    assert "nvidia.com/gpu" not in json.dumps(rep["resources"])
    assert rep["resources"]["requests"] == {"cpu": "1", "memory": "8Gi"}  # merged with the defaults
    assert env_of(rep)["KVROUTE_DEVICE"] == "cpu"
    assert "tolerations" not in pod_spec(replica) and replica["spec"]["replicas"] == 3


def test_monitoring_on_renders_service_monitors_and_otlp():
    docs = render(MATRIX["monitoring-on"])
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceMonitor"}
    assert sorted(monitors) == [REPLICA, ROUTER]
    for name, sm in monitors.items():
        assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["metadata"]["labels"]["release"] == "prom"
        assert sm["spec"]["endpoints"] == [{"port": "metrics", "interval": "30s", "path": "/metrics"}]
        component = name.rsplit("-", 1)[1]
        assert sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == component
        svc = find(docs, "Service", name)
        assert "metrics" in [p["name"] for p in svc["spec"]["ports"]]
    env = env_of(container(find(docs, "Deployment", ROUTER), "router"))
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert env["OTEL_TRACES_SAMPLER"] == "parentbased_always_on" and "OTEL_TRACES_SAMPLER_ARG" not in env
    sampled = render({"otel": {"endpoint": "http://collector:4318", "protocol": "http/protobuf",
                               "sampler": "parentbased_traceidratio", "samplerArg": "0.1"}})
    for kind, name, cname in (("Deployment", ROUTER, "router"), ("StatefulSet", REPLICA, "replica")):
        env = env_of(container(find(sampled, kind, name), cname))
        assert (env["OTEL_EXPORTER_OTLP_PROTOCOL"], env["OTEL_TRACES_SAMPLER"], env["OTEL_TRACES_SAMPLER_ARG"]) == (
            "http/protobuf", "parentbased_traceidratio", "0.1"), name
    # Offline rendering has no monitoring.coreos.com/v1 API: "auto" renders none.
    assert not [d for d in render({}) if d["kind"] == "ServiceMonitor"]


@pytest.mark.parametrize(("case_name", "replicas"), [("one-router-hpa", 1), ("three-routers-hpa", 3)])
def test_the_hpa_owns_the_router_count(case_name, replicas):
    docs = render(MATRIX[case_name])
    hpa = find(docs, "HorizontalPodAutoscaler", ROUTER)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": ROUTER}
    assert hpa["spec"]["minReplicas"] == replicas
    assert "replicas" not in find(docs, "Deployment", ROUTER)["spec"]


def test_static_discovery_lists_the_statefulset_pods_and_needs_no_rbac():
    docs = render(MATRIX["discovery-static"])
    env = env_of(container(find(docs, "Deployment", ROUTER), "router"))
    assert env["KVROUTE_DISCOVERY"] == "static"
    assert env["KVROUTE_REPLICAS"] == (f"{REPLICA}-0.{REPLICA}.{NAMESPACE}.svc:50051,"
                                       f"{REPLICA}-1.{REPLICA}.{NAMESPACE}.svc:50051")
    rep_env = env_of(container(find(docs, "StatefulSet", REPLICA), "replica"))
    assert rep_env["KVROUTE_ADVERTISE_ADDRESS"] == f"$(POD_NAME).{REPLICA}.$(POD_NAMESPACE).svc:50051"
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]
    assert pod_spec(find(docs, "Deployment", ROUTER))["automountServiceAccountToken"] is False


TLS_DIR = "/etc/kvroute/tls"


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "tls-mutual"])
def test_tls_mounts_the_secret_sets_the_settings_and_probes_over_tls(mutual):
    docs = render(MATRIX["tls-mutual" if mutual else "tls"])
    server = {"KVROUTE_TLS_CERT_FILE": f"{TLS_DIR}/tls.crt", "KVROUTE_TLS_KEY_FILE": f"{TLS_DIR}/tls.key"}
    if mutual:
        server["KVROUTE_TLS_CLIENT_CA_FILE"] = f"{TLS_DIR}/ca.crt"
    to_replicas = {"KVROUTE_REPLICA_TLS_CA_FILE": f"{TLS_DIR}/ca.crt",  # checked by the Service's name, not pod IPs
                   "KVROUTE_REPLICA_TLS_SERVER_NAME": f"{REPLICA}.{NAMESPACE}.svc"}
    if mutual:  # the router presents its own certificate to the replicas
        to_replicas |= {"KVROUTE_REPLICA_TLS_CERT_FILE": f"{TLS_DIR}/tls.crt",
                        "KVROUTE_REPLICA_TLS_KEY_FILE": f"{TLS_DIR}/tls.key"}
    client = ["--tls-ca-file", f"{TLS_DIR}/ca.crt", "--tls-server-name", ROUTER]
    if mutual:
        client += ["--tls-cert-file", f"{TLS_DIR}/tls.crt", "--tls-key-file", f"{TLS_DIR}/tls.key"]
    cases = (("Deployment", ROUTER, "router", server | to_replicas, 50050, "liveness"),
             ("StatefulSet", REPLICA, "replica", server, 50051, "readiness"))
    for kind, name, cname, want_env, port, startup in cases:
        w = find(docs, kind, name)
        c = container(w, cname)
        assert {k: v for k, v in env_of(c).items() if "TLS" in k} == want_env, name
        assert {"name": "tls", "secret": {"secretName": "kvr-tls"}} in pod_spec(w)["volumes"]
        assert {"name": "tls", "mountPath": TLS_DIR, "readOnly": True} in c["volumeMounts"]
        for probe, service in (("startupProbe", startup), ("readinessProbe", "readiness"), ("livenessProbe", "liveness")):
            assert "grpc" not in c[probe] and c[probe]["timeoutSeconds"] == 5
            assert c[probe]["exec"]["command"] == [
                "kvroute", "health", "--service", service, "--target", f"127.0.0.1:{port}", "--timeout", "3", *client]
    assert container(find(docs, "Deployment", ROUTER), "router")["readinessProbe"]["periodSeconds"] == 5
    test_pod = find(docs, "Pod", f"{FULLNAME}-test-health")
    assert test_pod["spec"]["containers"][0]["command"] == ["kvroute", "health", "--target", f"{ROUTER}:50050", *client]
    assert test_pod["spec"]["volumes"] == [{"name": "tls", "secret": {"secretName": "kvr-tls"}}]
    assert test_pod["spec"]["containers"][0]["volumeMounts"] == [{"name": "tls", "mountPath": TLS_DIR, "readOnly": True}]
    # Without tls: no mount, no TLS setting, native gRPC probes (pinned in test_defaults_render_the_whole_release).
    plain = container(find(render({}), "Deployment", ROUTER), "router")
    assert not [k for k in env_of(plain) if "TLS" in k] and "tls" not in [m["name"] for m in plain["volumeMounts"]]


def test_tls_http_and_metrics_serve_https_and_the_service_monitors_scrape_it_with_the_secret():
    docs = render(MATRIX["tls-everywhere"])
    for kind, name, cname in (("Deployment", ROUTER, "router"), ("StatefulSet", REPLICA, "replica")):
        env = env_of(container(find(docs, kind, name), cname))
        assert (env["KVROUTE_HTTP_TLS"], env["KVROUTE_METRICS_TLS"]) == ("true", "true"), name
    secret = lambda key: {"secret": {"name": "kvr-tls", "key": key}}  # noqa: E731
    for name, server_name in ((ROUTER, ROUTER), (REPLICA, f"{REPLICA}.{NAMESPACE}.svc")):
        [endpoint] = find(docs, "ServiceMonitor", name)["spec"]["endpoints"]
        assert endpoint["scheme"] == "https"
        assert endpoint["tlsConfig"] == {"serverName": server_name, "ca": secret("ca.crt"), "cert": secret("tls.crt"),
                                         "keySecret": {"name": "kvr-tls", "key": "tls.key"}}
    # Off unless asked: tls.enabled alone keeps the HTTP and metrics ports plaintext.
    env = env_of(container(find(render(MATRIX["tls-mutual"]), "Deployment", ROUTER), "router"))
    assert "KVROUTE_HTTP_TLS" not in env and "KVROUTE_METRICS_TLS" not in env


def test_disruption_budgets_cover_routers_replicas_and_envoy_and_select_their_pods():
    docs = render({"gateway": {"mode": "envoy"}, "router": {"discovery": "kubernetes"}})
    budgets = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    envoy = f"{FULLNAME}-envoy"
    assert budgets[ROUTER]["minAvailable"] == 1 and budgets[envoy]["minAvailable"] == 1
    assert budgets[REPLICA]["maxUnavailable"] == 1 and "minAvailable" not in budgets[REPLICA]
    for name, kind in ((ROUTER, "Deployment"), (REPLICA, "StatefulSet"), (envoy, "Deployment")):
        pod_labels = find(docs, kind, name)["spec"]["template"]["metadata"]["labels"]
        assert budgets[name]["selector"]["matchLabels"].items() <= pod_labels.items(), name
    custom = render({"replica": {"podDisruptionBudget": {"minAvailable": "75%"}}})
    assert find(custom, "PodDisruptionBudget", REPLICA)["spec"]["minAvailable"] == "75%"
    off = render({"replica": {"podDisruptionBudget": {"enabled": False}}, "router": {"podDisruptionBudget": {"enabled": False}}})
    assert not [d for d in off if d["kind"] == "PodDisruptionBudget"]


def test_the_documented_gitops_values_render_the_same_manifests_every_time():
    from tests.deploy.chart import _rendered

    def twice(values: dict) -> tuple[dict, dict]:  # two real renders (render() caches one per values)
        text = json.dumps(values, sort_keys=True)
        first = _rendered(text)
        _rendered.cache_clear()
        return first, _rendered(text)

    gitops = {"redis": {"auth": {"existingSecret": "redis-creds"}}, "metrics": {"serviceMonitor": {"enabled": True}}}
    first, second = twice(gitops)
    assert first == second
    assert "kind: ServiceMonitor" in "".join(first.values()) and "kind: Secret" not in "".join(first.values())
    # Without them the generated Redis password changes on every offline render (docs/kubernetes.md).
    first, second = twice({})
    assert first != second


def test_every_replica_setting_is_reachable_from_values():
    from tests.deploy.chart import known_settings

    settings = {name.removeprefix("KVROUTE_").lower(): "1" for name in known_settings("replica")}
    env = env_of(container(find(render({"replica": {"settings": settings}}), "StatefulSet", REPLICA), "replica"))
    assert known_settings("replica") <= set(env)
    assert env["KVROUTE_MAX_NUM_SEQS"] == "1"


def test_model_from_a_pvc_or_a_host_path():
    docs = render({"replica": {"model": {"source": "pvc", "claimName": "llama-weights", "path": "llama-3-8b"}}})
    for kind, name, cname in (("Deployment", ROUTER, "router"), ("StatefulSet", REPLICA, "replica")):
        w = find(docs, kind, name)
        assert {"name": "models", "persistentVolumeClaim": {"claimName": "llama-weights", "readOnly": True}} in \
            pod_spec(w)["volumes"]
        assert env_of(container(w, cname))["KVROUTE_MODEL"] == "/models/llama-3-8b"
        assert "initContainers" not in pod_spec(w)
    docs = render({"replica": {"model": {"source": "hostPath", "hostPath": "/mnt/models/tiny"}}})
    vol = next(v for v in pod_spec(find(docs, "StatefulSet", REPLICA))["volumes"] if v["name"] == "models")
    assert vol["hostPath"] == {"path": "/mnt/models/tiny", "type": "Directory"}


def test_the_dashboard_configmap_carries_the_dashboard_file_for_the_grafana_sidecar():
    cm = find(render({}), "ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvroute.json"]) == json.loads((CHART_DIR / "dashboards" / "kvroute.json").read_text())


ENVOY = f"{FULLNAME}-envoy"
TLS_KV = f"--tls-ca-file ca.crt --tls-server-name {ROUTER}"
MTLS_KV = f"--tls-ca-file ca.crt --tls-cert-file tls.crt --tls-key-file tls.key --tls-server-name {ROUTER}"
NOTES_CASES = {  # values -> (port-forward, the front's port, kvroute generate's TLS flags, grpcurl's transport)
    "proxy": ({}, f"svc/{ROUTER} 50050:50050 8000:8000", 50050, "", "-plaintext"),
    "envoy": (MATRIX["gateway-envoy"], f"svc/{ENVOY} 8080:8080", 8080, "", "-plaintext"),
    "tls": (MATRIX["tls"], f"svc/{ROUTER} 50050:50050 8000:8000", 50050, " " + TLS_KV,
            f"-cacert ca.crt -servername {ROUTER}"),
    "tls-mutual": (MATRIX["tls-mutual"], f"svc/{ROUTER} 50050:50050 8000:8000", 50050, " " + MTLS_KV,
                   f"-cacert ca.crt -cert tls.crt -key tls.key -servername {ROUTER}"),
}


@pytest.mark.parametrize("mode", NOTES_CASES)
def test_notes_tell_how_to_reach_and_try_the_front_of_each_mode(mode):
    values, forward, port, kv_tls, grpcurl = NOTES_CASES[mode]
    lines = notes(values).splitlines()
    assert f"  kubectl -n {NAMESPACE} port-forward {forward}" in lines
    assert f'  kvroute generate --target 127.0.0.1:{port}{kv_tls} "The capital of France is"' in lines
    assert f"  grpcurl {grpcurl} -d '{{\"service\": \"readiness\"}}' 127.0.0.1:{port} grpc.health.v1.Health/Check" in lines
    stream = [line for line in lines if "GenerationService/GenerateStream" in line]
    assert len(stream) == 1 and stream[0].startswith(f"  grpcurl {grpcurl} -d ")
    assert stream[0].endswith(f" 127.0.0.1:{port} kvroute.v1.GenerationService/GenerateStream")
    assert "  curl http://127.0.0.1:8000/v1/models" in lines
    fetch = [line for line in lines if "get secret kvr-tls" in line]
    assert len(fetch) == {"tls": 1, "tls-mutual": 3}.get(mode, 0)  # ca.crt (and tls.crt, tls.key) to files
    if mode == "envoy":  # the router's HTTP API still needs its own port-forward
        assert f"  kubectl -n {NAMESPACE} port-forward svc/{ROUTER} 8000:8000" in lines
    assert ("50050" in "".join(lines)) == (mode != "envoy")


@pytest.mark.parametrize("mode", ["proxy", "envoy", "inferencePool"])
def test_the_chart_lints_clean_in_strict_mode(mode):
    for version in ("v1.29.0", "v1.33.0"):
        report = helm.lint(str(CHART_DIR), {"gateway": {"mode": mode}}, strict=True, kube_version=version)
        assert report["errors"] == []
        worse_than_info = [m for m in report["messages"] if m["severity"] >= 2]
        assert worse_than_info == [], worse_than_info


def test_app_version_is_the_package_version():
    pyproject = tomllib.loads((CHART_DIR.parents[2] / "pyproject.toml").read_text())
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["appVersion"] == pyproject["project"]["version"]


def test_the_schema_enums_are_the_codes_choices():
    from kvroute.hashing import HASH_ALGORITHMS
    from router.policies.registry import POLICY_NAMES
    from router.settings import RouterSettings

    schema = json.loads((CHART_DIR / "values.schema.json").read_text())["properties"]
    assert schema["cluster"]["properties"]["hashAlgorithm"]["enum"] == list(HASH_ALGORITHMS)
    assert schema["router"]["properties"]["policy"]["enum"] == list(POLICY_NAMES)
    discovery = next(f for f in RouterSettings.__dataclass_fields__.values() if f.name == "discovery")
    assert sorted(schema["router"]["properties"]["discovery"]["enum"]) == sorted(discovery.metadata["choices"])


def test_every_values_key_is_documented_helm_docs_style():
    """Each key carries a ``# --`` comment, itself or through the map it sits in."""
    undocumented = []
    documented_at: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    comment = False
    for line in (CHART_DIR / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            comment = True
            continue
        if stripped.startswith("#") or not stripped:
            continue
        m = re.match(r"^( *)([A-Za-z_][\w.-]*):(.*)$", line)
        if m is None:  # a list item of a default value
            continue
        indent = len(m.group(1))
        while documented_at and documented_at[-1][0] >= indent:
            documented_at.pop()
        inherited = any(doc for _, doc in documented_at)
        is_leaf = m.group(3).strip() != ""
        if is_leaf and not (comment or inherited):
            undocumented.append(m.group(2))
        documented_at.append((indent, comment))
        comment = False
    assert undocumented == []


def test_the_gateway_modes_are_proxy_envoy_and_inference_pool_with_proxy_the_default():
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    assert schema["properties"]["gateway"]["properties"]["mode"]["enum"] == ["proxy", "envoy", "inferencePool"]
    assert yaml.safe_load((CHART_DIR / "values.yaml").read_text())["gateway"]["mode"] == "proxy"


def test_a_setting_the_programs_do_not_read_is_caught():
    docs = render({"replica": {"settings": {"max_num_seq": 8}}, "router": {"settings": {"polcy": "random"}}})
    assert sorted(unknown_kvroute_env(docs)) == [f"{REPLICA}/replica: KVROUTE_MAX_NUM_SEQ", f"{ROUTER}/router: KVROUTE_POLCY"]


def test_engine_vllm_runs_vllm_and_a_bridge_that_the_routers_find_on_the_http_port():
    docs = render(MATRIX["vllm-replicas"])
    sts = find(docs, "StatefulSet", f"{FULLNAME}-replica")
    vllm, bridge = pod_spec(sts)["containers"]
    assert (vllm["name"], bridge["name"]) == ("vllm", "bridge")
    args = vllm["args"]
    assert args[args.index("--block-size") + 1] == "16"  # cluster.blockSize: the router's too
    assert args[args.index("--served-model-name") + 1] == "kvroute-tiny-llama"
    events = json.loads(args[args.index("--kv-events-config") + 1])
    assert events["endpoint"] == "tcp://*:5557" and events["replay_endpoint"] == "tcp://*:5558"
    assert args[-2:] == ["--max-model-len", "4096"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert vllm["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    env = {e["name"]: e.get("value") for e in bridge["env"]}
    assert env["KVROUTE_VLLM_URL"] == "http://$(POD_IP):8000" and env["KVROUTE_ADVERTISE_ADDRESS"] == "$(POD_IP):8000"
    assert bridge["command"] == ["kvroute", "bridge"]
    service = find(docs, "Service", f"{FULLNAME}-replica")
    assert [p["name"] for p in service["spec"]["ports"]] == ["http"]
    router = find(docs, "Deployment", f"{FULLNAME}-router")
    renv = {e["name"]: e.get("value") for e in pod_spec(router)["containers"][0]["env"]}
    assert renv["KVROUTE_K8S_PORT_NAME"] == "http" and renv["KVROUTE_BLOCK_SIZE"] == "16"
    static = find(render(MATRIX["vllm-static"]), "Deployment", f"{FULLNAME}-router")
    senv = {e["name"]: e.get("value") for e in pod_spec(static)["containers"][0]["env"]}
    assert senv["KVROUTE_REPLICAS"].split(",")[0] == f"{FULLNAME}-replica-0.{FULLNAME}-replica.{NAMESPACE}.svc:8000"
    pool = find(render(MATRIX["vllm-inference-pool"]), "InferencePool", "kvr-kvroute")
    assert pool["spec"]["targetPorts"] == [{"number": 8000}] and "appProtocol" not in pool["spec"]


def test_engine_vllm_with_tls_is_refused_naming_both():
    with pytest.raises(Exception, match="replica.engine vllm"):
        render({"replica": {"engine": "vllm"}, "tls": {"enabled": True, "existingSecret": "kvr-tls"}})
