"""``replica.model.source: download``: an init container in every replica pod fetches a Hugging Face
repo (huggingface_hub's ``snapshot_download``, from ``HF_ENDPOINT``: the Hub or a Hub-compatible
mirror) into the model emptyDir, and the engine (kvroute's or vLLM) reads that folder as it reads a
PVC's; the routers' init container fetches the same repo's tokenizer files only, with the router
image (no torch). Rendered by Helm's engine."""

from __future__ import annotations

import pytest

from tests.deploy.chart import (
    FULLNAME,
    container,
    env_of,
    find,
    pod_spec,
    render,
    unknown_kvroute_env,
)

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
