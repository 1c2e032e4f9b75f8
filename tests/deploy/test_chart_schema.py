"""values.schema.json, as Helm enforces it when it renders: bad values fail before any manifest
exists, with a message naming the key (one test per case)."""

from __future__ import annotations

import pytest

from tests.deploy.chart import helm, render


def _rejection(values: dict) -> str:
    with pytest.raises(helm.HelmValuesError) as err:
        render(values)
    return str(err.value)


def test_a_negative_replica_count_is_rejected_naming_the_key():
    assert "at '/replica/replicas': minimum: got -1, want 0" in _rejection({"replica": {"replicas": -1}})
    assert "at '/router/replicas': minimum: got -2, want 1" in _rejection({"router": {"replicas": -2}})


def test_a_gpu_count_that_is_not_a_number_is_rejected_naming_the_key():
    assert "at '/replica/gpu': got string, want integer" in _rejection({"replica": {"gpu": "two"}})


def test_an_unknown_discovery_mode_is_rejected_naming_the_key():
    message = _rejection({"router": {"discovery": "consul"}})
    assert "at '/router/discovery': value must be one of 'kubernetes', 'static', 'redis'" in message


def test_redis_disabled_without_external_redis_is_rejected_naming_the_key():
    assert "at '/externalRedis/url'" in _rejection({"redis": {"enabled": False}})
    # With a URL it renders; a URL that is not redis:// or rediss:// does not.
    assert render({"redis": {"enabled": False}, "externalRedis": {"url": "redis://r:6379/0"}})
    assert "at '/externalRedis/url'" in _rejection({"redis": {"enabled": False}, "externalRedis": {"url": "r:6379"}})


def test_an_external_redis_cluster_with_the_bundled_redis_is_rejected_naming_the_key():
    assert "at '/redis/enabled'" in _rejection({"externalRedis": {"url": "redis://a:6379", "cluster": True}})
    assert "at '/externalRedis/cluster'" in _rejection({"redis": {"enabled": False},
                                                        "externalRedis": {"url": "redis://a:6379", "cluster": "yes"}})


def test_a_misspelt_key_is_rejected_naming_it():
    assert "'replicaz'" in _rejection({"router": {"replicaz": 3}})


def test_an_unknown_gateway_mode_is_rejected_naming_the_key():
    message = _rejection({"gateway": {"mode": "nginx"}})
    assert "at '/gateway/mode': value must be one of 'proxy', 'envoy', 'inferencePool'" in message


def test_a_gateway_mode_that_dials_pod_ips_rejects_static_discovery():
    # Envoy's ORIGINAL_DST and an InferencePool's gateway dial the pod IP the picker names.
    for mode in ("envoy", "inferencePool"):
        message = _rejection({"gateway": {"mode": mode}, "router": {"discovery": "static"}})
        assert "at '/router/discovery': value must be one of 'kubernetes', 'redis'" in message
    assert render({"gateway": {"mode": "envoy"}, "router": {"discovery": "redis"}})
    assert render({"router": {"discovery": "static"}})  # the proxy dials names


def test_tls_enabled_without_its_secret_is_rejected_naming_the_key():
    assert "at '/tls/existingSecret'" in _rejection({"tls": {"enabled": True}})
    assert "at '/tls/existingSecret'" in _rejection({"tls": {"enabled": True, "existingSecret": ""}})
    assert render({"tls": {"enabled": True, "existingSecret": "kvr-tls"}})
    assert "'mutal'" in _rejection({"tls": {"enabled": True, "existingSecret": "kvr-tls", "mutal": True}})


def test_a_malformed_image_digest_is_rejected_naming_the_key():
    good = "sha256:" + "0" * 64
    for bad in ("sha256:abc", "sha256:" + "A" * 64, "0" * 64, "sha512:" + "0" * 128, f"@{good}"):
        message = _rejection({"router": {"image": {"digest": bad}}})
        assert f"at '/router/image/digest': '{bad}' does not match pattern" in message
    for key, values in (("/gateway/envoy/image/digest", {"gateway": {"envoy": {"image": {"digest": "latest"}}}}),
                        ("/replica/vllm/image/digest", {"replica": {"vllm": {"image": {"digest": "latest"}}}}),
                        ("/redis/image/digest", {"redis": {"image": {"digest": "latest"}}})):
        assert f"at '{key}'" in _rejection(values)
    assert render({"router": {"image": {"digest": good}}, "replica": {"image": {"digest": ""}}})


def test_a_third_party_image_without_a_tag_is_rejected_naming_the_key():
    # Only kvroute's own images default an empty tag (to the chart's appVersion).
    assert "at '/redis/image/tag': minLength" in _rejection({"redis": {"image": {"tag": ""}}})
    assert "at '/replica/vllm/image/tag': minLength" in _rejection({"replica": {"vllm": {"image": {"tag": ""}}}})


def test_a_model_download_value_of_the_wrong_shape_is_rejected_naming_the_key():
    def download(**values) -> dict:
        return {"replica": {"model": {"source": "download", "download": {"repo": "Qwen/Qwen2.5-0.5B-Instruct", **values}}}}

    assert "at '/replica/model/source': value must be one of" in _rejection({"replica": {"model": {"source": "s3"}}})
    # A URL where the repo id goes (the Hub's URL is `endpoint`), and an endpoint without its scheme.
    assert "at '/replica/model/download/repo'" in _rejection(download(repo="https://huggingface.co/Qwen/Qwen2.5-0.5B"))
    assert "at '/replica/model/download/endpoint'" in _rejection(download(endpoint="hub.example.com"))
    assert "at '/replica/model/download/revision': minLength" in _rejection(download(revision=""))
    assert "additional properties 'tokensecret'" in _rejection(download(tokensecret={"name": "hf"}))
    # An image of one's own needs its tag (only kvroute's own images default theirs).
    image = {"repository": "registry.example.com/hf-downloader"}
    assert "at '/replica/model/download/image/tag'" in _rejection(download(image=image))
    assert "at '/replica/model/download/image/digest'" in _rejection(download(image={**image, "tag": "1", "digest": "1"}))
    assert render(download(image={**image, "tag": "1.2"}, endpoint="http://hub.internal:8080/hf"))
