"""kvroute.settings: flags over KVROUTE_* variables over defaults; secrets stay out of reprs."""

from __future__ import annotations

import pytest

from kvroute.settings import load_settings
from router.settings import RouterSettings


def test_the_redis_password_comes_from_the_environment_and_never_shows_in_the_repr():
    s = load_settings(RouterSettings, [], env={"KVROUTE_REDIS_PASSWORD": "hunter2", "KVROUTE_PORT": "7000"})
    assert (s.redis_password, s.port) == ("hunter2", 7000)
    assert "hunter2" not in repr(s) and "redis_password=" not in repr(s)  # (redis_password_file= is shown)
    assert load_settings(RouterSettings, ["--port", "7001"], env={"KVROUTE_PORT": "7000"}).port == 7001


def test_the_shared_redis_and_serving_settings_are_declared_once_for_both_processes():
    import dataclasses

    from kvroute.shared_settings import RedisSettings, ServingSettings
    from replica.settings import ReplicaSettings
    from router.settings import RouterSettings

    shared = {f.name: f for base in (RedisSettings, ServingSettings) for f in dataclasses.fields(base)}
    assert {"redis_password", "redis_password_file", "redis_ca_file", "redis_cluster", "namespace", "event_shards",
            "http_port", "metrics_port", "metrics_host", "tls_cert_file", "tls_key_file", "tls_client_ca_file", "http_tls",
            "metrics_tls"} == set(shared)
    for cls in (RouterSettings, ReplicaSettings):
        assert not set(cls.__annotations__) & set(shared), f"{cls.__name__} declares a shared setting again"
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name, f in shared.items():
            assert (fields[name].default, fields[name].metadata) == (f.default, f.metadata)


def test_a_boolean_setting_is_a_switch_as_vllms_are_and_its_variable_takes_true_or_false():
    from replica.settings import ReplicaSettings

    assert load_settings(ReplicaSettings, ["--enforce-eager"], env={}).enforce_eager is True
    assert load_settings(ReplicaSettings, ["--no-engine-process"], env={}).engine_process is False
    assert load_settings(ReplicaSettings, [], env={}).engine_process is True  # the default
    env = {"KVROUTE_ENFORCE_EAGER": "true", "KVROUTE_ENABLE_PREFIX_CACHING": "false"}
    s = load_settings(ReplicaSettings, [], env=env)
    assert (s.enforce_eager, s.enable_prefix_caching) == (True, False)
    assert load_settings(ReplicaSettings, ["--no-enforce-eager"], env=env).enforce_eager is False  # flag wins
    with pytest.raises(SystemExit) as exc:  # a switch takes no value
        load_settings(ReplicaSettings, ["--enforce-eager", "true"], env={})
    assert exc.value.code == 2
