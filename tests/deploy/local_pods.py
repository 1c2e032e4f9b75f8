"""Rendered pods run as local processes: a small kubelet, kube-dns and EndpointSlice controller for
the chart test that runs the chart (``from tests.deploy.local_pods import ...``).

    rendered Deployment / StatefulSet ──▶ LocalPod(name, ip, template)  one loopback IP per pod
        initContainers then containers  ──▶ subprocesses with the container's command, args and env
        probes (grpc / tcpSocket / httpGet / exec) ─▶ run exactly as declared, against the pod IP (an exec
                                             probe's 127.0.0.1 is the pod's IP, its mount paths the
                                             pod's folders)
    rendered Services                   ──▶ DNS names → a ready pod's IP (ports unchanged)
    the replica headless Service        ──▶ EndpointSlices (ready / serving / terminating) on a
                                             loopback API server (tests.support_kube.FakeKubeAPI)

What a kubelet does and is done here too: ``$(VAR)`` expansion in env values and args, env from
``fieldRef`` (pod name, namespace, IP) and ``secretKeyRef`` (the rendered Secrets), volumes
(emptyDir, Secret and ConfigMap volumes become folders; mount paths in env values and args are
mapped to them; in a ConfigMap's files a quoted ``"0.0.0.0"`` is the pod's IP and a quoted Service
name its IP, as DNS would answer). A pod has its own IP: a process listening on ``0.0.0.0`` in a pod listens on that IP here.
Nothing from this process's environment reaches a container but PATH, PYTHONPATH, HOME and the
KUBECONFIG of the fake API server (a pod's service account access).
"""

from __future__ import annotations

import base64
import contextlib
import random
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute_tools.envoy import envoy_binary
from kvroute_tools.redis_server import find_redis_server
from tests.support_kube import FakeKubeAPI

SERVING = health_pb2.HealthCheckResponse.SERVING
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def program(command: list[str], image: str = "") -> list[str]:
    """A container's command with the image's programs replaced by this machine's (a vLLM image's
    ``python``: the interpreter that has vllm, tests.vllm.conftest.vllm_python)."""
    head, rest = command[0], command[1:]
    if head == "python" and "vllm" in image.rsplit("/", 1)[-1]:
        from tests.vllm.conftest import vllm_python

        python = vllm_python()
        assert python is not None, "a vLLM image's container needs vLLM here (make test-vllm)"
        return [python, *rest]
    if head == "kvroute":
        return [sys.executable, "-m", "kvroute_tools", *rest]
    if head == "python":
        return [sys.executable, *rest]
    if head == "redis-server":
        return [find_redis_server(), *rest]
    if head == "envoy":
        return [envoy_binary(), *rest]
    raise AssertionError(f"no local program for the image's {head!r}")


def secrets_of(docs: list[dict]) -> dict[str, dict[str, str]]:
    """Rendered Secrets as name -> key -> decoded value."""
    return {d["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in d.get("data", {}).items()}
            for d in docs if d["kind"] == "Secret"}


@dataclass
class LocalPod:
    """One pod of a rendered workload: its name, IP, pod template, folders, and running processes."""

    name: str
    ip: str
    namespace: str
    template: dict
    root: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ready: bool = False
    terminating: bool = False

    @property
    def labels(self) -> dict[str, str]:
        return self.template["metadata"]["labels"]

    @property
    def spec(self) -> dict:
        return self.template["spec"]

    def container(self, name: str) -> dict:
        return next(c for c in self.spec["containers"] if c["name"] == name)

    def port(self, container: dict, port: int | str) -> int:
        """A probe's or Service's port: a number, or a container port's name."""
        if isinstance(port, int):
            return port
        return next(p["containerPort"] for p in container["ports"] if p["name"] == port)

    def volume_dirs(self, secrets: dict[str, dict[str, str]], configmaps: dict[str, dict[str, str]]) -> dict[str, Path]:
        """Volume name -> folder (emptyDir: empty; Secret, ConfigMap: their keys as files)."""
        out = {}
        for v in self.spec.get("volumes", []):
            path = self.root / "volumes" / v["name"]
            path.mkdir(parents=True, exist_ok=True)
            if "secret" in v or "configMap" in v:
                data = secrets[v["secret"]["secretName"]] if "secret" in v else configmaps[v["configMap"]["name"]]
                for key, value in data.items():
                    (path / key).write_text(value)
            else:
                assert "emptyDir" in v, f"{self.name}: volume {v['name']} is neither emptyDir, Secret nor ConfigMap"
            out[v["name"]] = path
        return out


class LocalCluster:
    """The rendered release on this machine (see the module docstring). ``dns`` maps a Service's
    names to the IP of one of its ready pods; pods get IPs ``{subnet}.10``, ``.11``, ..."""

    def __init__(self, docs: list[dict], namespace: str, root: Path, subnet: str, kubeconfig: Path):
        self.docs = docs
        self.namespace = namespace
        self.root = root
        self.subnet = subnet
        self.kubeconfig = kubeconfig
        self.secrets = secrets_of(docs)
        self.pods: list[LocalPod] = []
        self.services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}

    # -- pods -------------------------------------------------------------------------------------
    def add_pods(self, workload: dict) -> list[LocalPod]:
        """The pods of a Deployment (``name-<i>``) or StatefulSet (``name-<ordinal>``)."""
        name = workload["metadata"]["name"]
        pods = []
        for i in range(workload["spec"].get("replicas", 1)):
            ip = f"{self.subnet}.{10 + len(self.pods)}"
            pod = LocalPod(f"{name}-{i}", ip, self.namespace, workload["spec"]["template"], self.root / f"{name}-{i}")
            self.pods.append(pod)
            pods.append(pod)
        return pods

    def pods_of(self, selector: dict[str, str]) -> list[LocalPod]:
        return [p for p in self.pods if all(p.labels.get(k) == v for k, v in selector.items())]

    def dns(self) -> dict[str, str]:
        """Every name of every Service (``svc``, ``svc.ns``, ``svc.ns.svc``, ``svc.ns.svc.cluster.local``)
        and of every StatefulSet pod (``pod.svc...``) -> an IP."""
        names = {}
        for svc_name, svc in self.services.items():
            pods = self.pods_of(svc["spec"]["selector"])
            ready = [p for p in pods if p.ready] or pods
            for suffix in ("", f".{self.namespace}", f".{self.namespace}.svc", f".{self.namespace}.svc.cluster.local"):
                if ready:
                    names[svc_name + suffix] = ready[0].ip
                for p in pods:
                    names[f"{p.name}.{svc_name}{suffix}"] = p.ip
        return names

    def resolve(self, text: str, pod: LocalPod, env: dict[str, str], mounts: dict[str, Path]) -> str:
        """What the container sees of a value of its env or args: ``$(VAR)`` expanded, ``0.0.0.0``
        the pod's IP, mount paths mapped to the pod's folders, Service names in ``host:port`` resolved."""
        text = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)
        if text == "0.0.0.0":
            return pod.ip
        for mount, path in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            if text == mount or text.startswith(mount + "/"):
                return str(path) + text[len(mount):]
        for name, ip in sorted(self.dns().items(), key=lambda kv: -len(kv[0])):
            text = re.sub(rf"(?<![\w.-]){re.escape(name)}(?=:\d)", ip, text)  # host:port only
        return text

    def configmaps(self, pod: LocalPod) -> dict[str, dict[str, str]]:
        """The rendered ConfigMaps as this pod reads them: quoted ``"0.0.0.0"`` -> the pod's IP,
        quoted Service names -> their IPs."""
        names = {f'"{name}"': f'"{ip}"' for name, ip in self.dns().items()} | {'"0.0.0.0"': f'"{pod.ip}"'}
        pattern = re.compile("|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)))
        return {d["metadata"]["name"]: {k: pattern.sub(lambda m: names[m.group(0)], v) for k, v in d["data"].items()}
                for d in self.docs if d["kind"] == "ConfigMap" and "data" in d}

    def container_env(self, pod: LocalPod, c: dict, mounts: dict[str, Path]) -> dict[str, str]:
        env: dict[str, str] = {}
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = self.resolve(e["value"], pod, env, mounts)
                continue
            ref = e["valueFrom"]
            if "fieldRef" in ref:
                path = ref["fieldRef"]["fieldPath"]
                env[e["name"]] = {"metadata.name": pod.name, "metadata.namespace": pod.namespace,
                                  "status.podIP": pod.ip}[path]
            else:
                key = ref["secretKeyRef"]
                env[e["name"]] = self.secrets[key["name"]][key["key"]]
        return env

    def start(self, pod: LocalPod, *, init_timeout: float = 180.0) -> None:
        """Run the init containers to completion (each must exit 0), then start the containers."""
        vols = pod.volume_dirs(self.secrets, self.configmaps(pod))
        for c in pod.spec.get("initContainers", []):
            proc = self._spawn(pod, c, vols)
            try:
                rc = proc.wait(init_timeout)
            finally:
                if proc.poll() is None:
                    proc.kill()
            assert rc == 0, f"{pod.name}: init container {c['name']} exited {rc}:\n{self.log(pod, c['name'])}"
        for c in pod.spec["containers"]:
            pod.procs[c["name"]] = self._spawn(pod, c, vols)

    def _spawn(self, pod: LocalPod, c: dict, vols: dict[str, Path]) -> subprocess.Popen:
        mounts = {m["mountPath"]: vols[m["name"]] for m in c.get("volumeMounts", []) if m["mountPath"] != "/dev/shm"}
        env = self.container_env(pod, c, mounts)
        argv = [self.resolve(a, pod, env, mounts) for a in (*c.get("command", []), *c.get("args", []))]
        base = self.base_env(mounts.get("/tmp", pod.root))
        log = open(pod.root / f"{c['name']}.log", "wb")  # noqa: SIM115 - closed with the process
        try:
            return subprocess.Popen(program(argv, c.get("image", "")), env={**base, **env}, stdout=log,
                                    stderr=subprocess.STDOUT,
                                    cwd=pod.root)
        finally:
            log.close()

    def base_env(self, home: Path) -> dict[str, str]:
        """What every container gets besides its own env: PATH, PYTHONPATH (this checkout), HOME and
        KUBECONFIG (the service account's access to the API server)."""
        return {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
                "HOME": str(home), "KUBECONFIG": str(self.kubeconfig)}

    def run_pod(self, pod_doc: dict, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run a bare Pod's (``helm test``'s) one container to completion: its command with Service
        names resolved; returns the completed process (stdout, stderr as text)."""
        [c] = pod_doc["spec"]["containers"]
        pod = LocalPod(pod_doc["metadata"]["name"], "", self.namespace, {"spec": pod_doc["spec"]},
                       self.root / pod_doc["metadata"]["name"])
        vols = pod.volume_dirs(self.secrets, self.configmaps(pod))
        mounts = {m["mountPath"]: vols[m["name"]] for m in c.get("volumeMounts", [])}
        argv = [self.resolve(a, pod, {}, mounts) for a in (*c.get("command", []), *c.get("args", []))]
        return subprocess.run(program(argv), capture_output=True, text=True, timeout=timeout,
                              env=self.base_env(self.root), cwd=self.root)

    def log(self, pod: LocalPod, container: str, tail: int = 40) -> str:
        path = pod.root / f"{container}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-tail:]) if path.exists() else ""

    # -- probes ------------------------------------------------------------------------------------
    def probe(self, pod: LocalPod, container: str, kind: str) -> bool:
        """Run the container's ``kind`` probe (``startupProbe``...) once, as declared."""
        c = pod.container(container)
        p = c[kind]
        if "grpc" in p:
            target = f"{pod.ip}:{pod.port(c, p['grpc']['port'])}"
            with grpc.insecure_channel(target) as ch:
                try:
                    resp = health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service=p["grpc"].get("service", "")),
                        timeout=p.get("timeoutSeconds", 1))
                except grpc.RpcError:
                    return False
            return resp.status == SERVING
        if "exec" in p:
            mounts = {m["mountPath"]: pod.root / "volumes" / m["name"] for m in c.get("volumeMounts", [])}
            argv = [self.resolve(a, pod, {}, mounts).replace("127.0.0.1:", f"{pod.ip}:") for a in p["exec"]["command"]]
            try:
                done = subprocess.run(program(argv), capture_output=True, timeout=p.get("timeoutSeconds", 1),
                                      env=self.base_env(pod.root), cwd=pod.root)
            except subprocess.TimeoutExpired:
                return False
            return done.returncode == 0
        if "tcpSocket" in p:
            import socket

            try:
                socket.create_connection((pod.ip, pod.port(c, p["tcpSocket"]["port"])), 1).close()
            except OSError:
                return False
            return True
        if "httpGet" in p:
            url = f"http://{pod.ip}:{pod.port(c, p['httpGet']['port'])}{p['httpGet'].get('path', '/')}"
            try:
                with urllib.request.urlopen(url, timeout=p.get("timeoutSeconds", 1)) as r:
                    return 200 <= r.status < 400
            except OSError:
                return False
        raise AssertionError(f"{pod.name}/{container}: {kind} of an unknown kind: {p}")

    def wait_started_and_ready(self, pod: LocalPod, container: str) -> None:
        """Probe like the kubelet: the startup probe within its budget (periodSeconds x
        failureThreshold, polled faster), then the readiness probe. Raises AssertionError with
        the container's log when the process exits or the budget runs out."""
        c = pod.container(container)
        for kind in ("startupProbe", "readinessProbe"):
            if kind not in c:
                continue
            budget = c[kind].get("periodSeconds", 10) * c[kind].get("failureThreshold", 3)
            deadline = time.monotonic() + budget
            while not self.probe(pod, container, kind):
                proc = pod.procs[container]
                assert proc.poll() is None, f"{pod.name}/{container} exited {proc.returncode}:\n{self.log(pod, container)}"
                assert time.monotonic() < deadline, f"{pod.name}/{container}: {kind} failing after {budget}s:\n" \
                                                    f"{self.log(pod, container)}"
                time.sleep(0.2)
        pod.ready = True

    def stop_all(self, timeout: float = 15.0) -> None:
        for pod in self.pods:
            for proc in pod.procs.values():
                if proc.poll() is None:
                    proc.terminate()
        for pod in self.pods:
            for proc in pod.procs.values():
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    # -- EndpointSlices ----------------------------------------------------------------------------
    def endpoint_slice(self, service: str) -> dict:
        """The EndpointSlice the controller would write for ``service``: its pods with ready /
        serving / terminating, and the Service's ports resolved to container ports."""
        svc = self.services[service]
        pods = self.pods_of(svc["spec"]["selector"])
        c0 = pods[0].spec["containers"][0]
        return {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": f"{service}-x7k2p", "namespace": self.namespace,
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [p.ip], "targetRef": {"kind": "Pod", "name": p.name},
                           "conditions": {"ready": p.ready and not p.terminating, "serving": p.ready,
                                          "terminating": p.terminating}} for p in pods],
            "ports": [{"name": sp["name"], "port": pods[0].port(c0, sp.get("targetPort", sp["port"])),
                       "protocol": sp.get("protocol", "TCP")} for sp in svc["spec"]["ports"]],
        }


def write_kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig for an unauthenticated API server at ``server``."""
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: local\n"
        f"clusters:\n- name: local\n  cluster:\n    server: {server}\n"
        "contexts:\n- name: local\n  context:\n    cluster: local\n    user: local\n"
        "users:\n- name: local\n  user: {}\n"
    )
    return path


@contextlib.contextmanager
def local_cluster(docs: list[dict], namespace: str, root: Path):
    """A :class:`LocalCluster` of ``docs`` on a random loopback subnet, with its loopback API
    server (a :class:`tests.support_kube.FakeKubeAPI`); yields ``(cluster, api)``, stops both."""
    api = FakeKubeAPI(namespace=namespace)
    subnet = f"127.{random.randint(100, 250)}.{random.randint(0, 250)}"
    local = LocalCluster(docs, namespace, root, subnet,
                         write_kubeconfig(root / "kubeconfig", f"http://127.0.0.1:{api.port}"))
    try:
        yield local, api
    finally:
        local.stop_all()
        api.close()
