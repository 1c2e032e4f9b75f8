"""``replica.model.source: download``: an init container in every replica pod fetches a Hugging Face
repo (huggingface_hub's ``snapshot_download``, from ``HF_ENDPOINT``: the Hub or a Hub-compatible
mirror) into the model emptyDir, and the engine (kvroute's or vLLM) reads that folder as it reads a
PVC's; the routers' init container fetches the same repo's tokenizer files only, with the router
image (no torch). Rendered by Helm's engine, then run: the rendered init containers against a local
Hub-compatible server, a replica serving the downloaded model and a router tokenizing with the
files it fetched."""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import pytest

from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute_tools.health import check_health
from tests.deploy.chart import (
    FULLNAME,
    NAMESPACE,
    container,
    env_of,
    find,
    pod_spec,
    render,
    unknown_kvroute_env,
)
from tests.deploy.local_pods import local_cluster
from tests.support import wait_for

ROUTER, REPLICA, REDIS = f"{FULLNAME}-router", f"{FULLNAME}-replica", f"{FULLNAME}-redis"
QWEN = {"repo": "Qwen/Qwen2.5-0.5B-Instruct", "endpoint": "https://artifactory.example.com/api/huggingfaceml/hf",
        "tokenSecret": {"name": "hf-token"}}
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "config.json"]


def _download(download: dict, **values) -> list[dict]:
    """The release with ``source: download`` of ``download``, and ``values`` (``replica.model`` merged)."""
    model = values.setdefault("replica", {}).setdefault("model", {})
    model |= {"source": "download", "download": download}
    return render(values)


def _init(workload: dict) -> dict:
    [init] = pod_spec(workload)["initContainers"]
    assert init["name"] == "download-model"
    return init


def test_download_fetches_the_repo_into_the_folder_the_engine_reads():
    docs = _download(QWEN)
    replica = find(docs, "StatefulSet", REPLICA)
    init = _init(replica)
    assert init["command"][:3] == ["python", "-c", "import sys; from huggingface_hub import snapshot_download; "
                                   "snapshot_download(repo_id=sys.argv[1], revision=sys.argv[2], "
                                   "local_dir=sys.argv[3], allow_patterns=sys.argv[4:] or None)"]
    assert init["command"][3:] == ["Qwen/Qwen2.5-0.5B-Instruct", "main", "/models/Qwen2.5-0.5B-Instruct"]
    env = env_of(init)
    assert env["HF_ENDPOINT"] == QWEN["endpoint"]
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert env["HF_HUB_DISABLE_TELEMETRY"] == "1" and env["HF_HOME"] == "/models/.huggingface"  # the volume: a read-only root
    assert init["securityContext"] == container(replica, "replica")["securityContext"]
    assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]
    assert init["resources"] == {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "4Gi"}}
    assert {"name": "models", "emptyDir": {"sizeLimit": "50Gi"}} in pod_spec(replica)["volumes"]
    engine = container(replica, "replica")
    assert env_of(engine)["KVROUTE_MODEL"] == init["command"][5]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in engine["volumeMounts"]
    assert unknown_kvroute_env(docs) == []

    # No endpoint, no token: the public Hub, anonymously; a path, a revision and a size of one's own.
    docs = _download({"repo": "gpt2", "revision": "607a30d", "sizeLimit": "8Gi"}, replica={"model": {"path": "gpt"}})
    init = _init(find(docs, "StatefulSet", REPLICA))
    assert init["command"][3:] == ["gpt2", "607a30d", "/models/gpt"]
    assert not {"HF_ENDPOINT", "HF_TOKEN"} & set(env_of(init))
    assert env_of(container(find(docs, "StatefulSet", REPLICA), "replica"))["KVROUTE_MODEL"] == "/models/gpt"
    assert {"name": "models", "emptyDir": {"sizeLimit": "8Gi"}} in pod_spec(find(docs, "StatefulSet", REPLICA))["volumes"]


def test_vllm_replicas_serve_the_downloaded_folder():
    docs = _download({"repo": "Qwen/Qwen2.5-0.5B-Instruct", "tokenSecret": {"name": "hf", "key": "hf_token"}},
                     replica={"engine": "vllm"})
    replica = find(docs, "StatefulSet", REPLICA)
    init = _init(replica)
    assert env_of(init)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "hf_token"}}
    args = container(replica, "vllm")["args"]
    assert args[args.index("--model") + 1] == init["command"][5] == "/models/Qwen2.5-0.5B-Instruct"
    assert args[args.index("--served-model-name") + 1] == "Qwen2.5-0.5B-Instruct"
    assert env_of(container(replica, "bridge"))["KVROUTE_MODEL"] == init["command"][5]


def test_the_routers_download_only_the_tokenizer_files_with_the_router_image():
    docs = _download(QWEN)
    router = find(docs, "Deployment", ROUTER)
    init = _init(router)
    assert init["image"] == container(router, "router")["image"] == "ghcr.io/kvroute/kvroute-router:0.1.0"
    assert init["command"][3:] == ["Qwen/Qwen2.5-0.5B-Instruct", "main", "/models/Qwen2.5-0.5B-Instruct",
                                   *TOKENIZER_FILES]
    assert env_of(init)["HF_ENDPOINT"] == QWEN["endpoint"] and env_of(init)["HF_TOKEN"]["secretKeyRef"]["name"] == "hf-token"
    # The same folder name as the replicas': the router serves the model under the folder's name.
    assert env_of(container(router, "router"))["KVROUTE_MODEL"] == init["command"][5]


def test_the_download_image_is_the_pods_own_unless_one_is_named_and_a_digest_pins_it():
    digest = "sha256:" + "c" * 64
    docs = _download(QWEN, replica={"image": {"digest": digest}})
    assert _init(find(docs, "StatefulSet", REPLICA))["image"] == f"ghcr.io/kvroute/kvroute-replica@{digest}"
    assert _init(find(docs, "Deployment", ROUTER))["image"] == "ghcr.io/kvroute/kvroute-router:0.1.0"
    image = {"repository": "registry.example.com/hf-downloader", "tag": "1.2", "pullPolicy": "Always"}
    for pinned, ref in (({}, "registry.example.com/hf-downloader:1.2"),
                        ({"digest": digest}, f"registry.example.com/hf-downloader@{digest}")):
        docs = _download({**QWEN, "image": {**image, **pinned}})
        for kind, name in (("StatefulSet", REPLICA), ("Deployment", ROUTER)):
            init = _init(find(docs, kind, name))
            assert (init["image"], init["imagePullPolicy"]) == (ref, "Always"), name


def test_download_without_a_repo_is_refused_naming_the_key():
    with pytest.raises(Exception, match=r"replica\.model\.download\.repo is required"):
        render({"replica": {"model": {"source": "download"}}})
    with pytest.raises(Exception, match=r"replica\.model\.download\.repo is required"):
        render({"replica": {"model": {"source": "download", "path": "llama"}}})


# -- the rendered pods run against a local Hub-compatible server -----------------------------------

@contextlib.contextmanager
def _hub(repo: str, files: dict[str, bytes]) -> Iterator[tuple[str, list[tuple[str, str | None]]]]:
    """A Hub-compatible server of one repo at one commit, serving what snapshot_download asks (the
    revision and tree APIs, HEAD and GET of ``resolve``). Yields its URL and the (path,
    Authorization) of each request; stops it."""
    sha, seen = "1" * 40, []
    tree = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()} for f, b in files.items()]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self, head: bool = False) -> None:
            seen.append((self.path, self.headers.get("Authorization")))
            path, api = urlsplit(self.path).path, f"/api/models/{repo}/"
            name = path.removeprefix(f"/{repo}/resolve/{sha}/")
            if path.startswith(api + "revision/"):
                body, headers = json.dumps({"id": repo, "sha": sha}).encode(), {}
            elif path.startswith(api + "tree/"):
                body, headers = json.dumps(tree).encode(), {}
            elif name in files:
                body, headers = files[name], {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha1(files[name]).hexdigest()}"'}
            else:
                return self.send_error(404)
            self.send_response(200)
            for key, value in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(key, value)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def do_HEAD(self) -> None:
            self.do_GET(head=True)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", seen
    finally:
        server.shutdown()


@pytest.mark.slow  # about 10 s: one model load on the CPU
def test_the_rendered_download_runs_against_a_hub_mirror_and_the_router_serves_the_replicas_model(tmp_path: Path):
    from replica.model.default_model import build_default_model_files

    files = {**build_default_model_files(0, weights=True), "README.md": b"# tiny llama\n"}
    values = {"router": {"replicas": 1, "discovery": "static", "autoscaling": {"enabled": False}},
              "replica": {"replicas": 1, "gpu": 0, "settings": {"num_blocks": 256, "torch_threads": 1}}}
    with _hub("kvroute/tiny-llama", files) as (url, seen):
        docs = _download({"repo": "kvroute/tiny-llama", "endpoint": url, "tokenSecret": {"name": "hf-token"}}, **values)
        with local_cluster(docs, NAMESPACE, tmp_path) as (local, _):
            # kubectl create secret generic hf-token --from-literal=token=...
            local.secrets["hf-token"] = {"token": "hf_mirror_token"}
            [redis_pod] = local.add_pods(find(docs, "StatefulSet", REDIS))
            [replica] = local.add_pods(find(docs, "StatefulSet", REPLICA))
            [router] = local.add_pods(find(docs, "Deployment", ROUTER))
            for pod, name in ((redis_pod, "redis"), (replica, "replica"), (router, "router")):
                local.start(pod)  # the init containers first: the downloads
                local.wait_started_and_ready(pod, name)

            replica_files, router_files = ({p.name for p in (pod.root / "volumes" / "models" / "tiny-llama").iterdir()
                                            if not p.name.startswith(".")} for pod in (replica, router))
            assert replica_files == set(files) and router_files == set(files) & set(TOKENIZER_FILES)
            assert seen and {auth for _, auth in seen} == {"Bearer hf_mirror_token"}
            # Routable: the replica's heartbeat names the model the router's folder does.
            wait_for(lambda: "1 routable" in check_health(f"{router.ip}:50050").line, 60, "the replica routable")
            with grpc.insecure_channel(f"{router.ip}:50050") as ch:
                stub = gen_grpc.GenerationServiceStub(ch)
                assert stub.GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=10).model == "tiny-llama"
                resp = stub.Generate(gen_pb.GenerateRequest(text="a downloaded model", sampling=gen_pb.SamplingParams(
                    max_tokens=3, temperature=0.0, ignore_eos=True)), timeout=60)
            assert resp.usage.completion_tokens == 3 and resp.routing.replica_id == replica.name
