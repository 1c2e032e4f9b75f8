"""kvroute.redis_connect without a server: where the password comes from, that it never shows."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import redis

from kvroute.redis_connect import RedisAuth, connect, redact
from kvroute.settings import load_settings


@dataclass
class _S:
    redis_password: str = ""
    redis_password_file: str = ""
    redis_ca_file: str = ""
    redis_cluster: bool = False


def test_password_from_file_first_line(tmp_path):
    f = tmp_path / "pw"
    f.write_text("hunter2\nignored\n")
    assert RedisAuth.from_settings(_S(redis_password_file=str(f))) == RedisAuth(password="hunter2")


def test_password_and_file_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="redis_password, redis_password_file"):
        RedisAuth.from_settings(_S(redis_password="a", redis_password_file=str(tmp_path / "pw")))


@pytest.mark.parametrize("content", [None, ""])
def test_a_missing_or_empty_file_names_the_setting(tmp_path, content):
    f = tmp_path / "pw"
    if content is not None:
        f.write_text(content)
    with pytest.raises(ValueError, match="redis_password_file"):
        RedisAuth.from_settings(_S(redis_password_file=str(f)))


def test_the_settings_repr_has_no_password():
    from replica.settings import ReplicaSettings
    from router.settings import RouterSettings

    for cls in (RouterSettings, ReplicaSettings):
        s = load_settings(cls, [], env={"KVROUTE_REDIS_PASSWORD": "hunter2"})
        assert s.redis_password == "hunter2" and "hunter2" not in repr(s)
        assert "hunter2" not in repr(RedisAuth.from_settings(s))


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:hunter2@10.0.0.1:6379/0", "redis://:***@10.0.0.1:6379/0"),
    ("redis://:hunter2@a:7000, redis://b:7001", "redis://:***@a:7000,redis://b:7001"),
    ("rediss://default:hunter2@cache:6380/1", "rediss://default:***@cache:6380/1"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
])
def test_redact(url, shown):
    assert redact(url) == shown


def test_connect_passes_password_and_ca():
    client = connect("rediss://cache:6380/0", RedisAuth(password="hunter2", ca_file="/ca.pem"))
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["password"] == "hunter2" and kwargs["ssl_ca_certs"] == "/ca.pem"


def test_a_bad_url_names_redis_url_without_the_password():
    with pytest.raises(ValueError, match=r"redis_url http://:\*\*\*@h:1") as err:
        connect("http://:hunter2@h:1/0")
    assert "hunter2" not in str(err.value)


def test_settings_name_a_cluster_by_flag_or_environment():
    from router.settings import RouterSettings

    assert RedisAuth.from_settings(load_settings(RouterSettings, ["--redis-cluster"], env={})).cluster
    assert RedisAuth.from_settings(load_settings(RouterSettings, [], env={"KVROUTE_REDIS_CLUSTER": "true"})).cluster
    assert not RedisAuth.from_settings(load_settings(RouterSettings, [], env={})).cluster


@pytest.mark.parametrize(("url", "cluster"), [("redis://127.0.0.1:1/0", True),
                                               ("redis://127.0.0.1:1,redis://127.0.0.1:2", False)])
def test_a_cluster_none_of_whose_seeds_answers_is_a_connection_error(url, cluster):
    with pytest.raises(redis.ConnectionError, match="Redis Cluster"):
        connect(url, RedisAuth(cluster=cluster), socket_connect_timeout=0.5)


def test_a_cluster_url_without_a_usable_seed_is_refused_naming_redis_url_without_the_password():
    with pytest.raises(ValueError, match=r"redis_url rediss://:\*\*\*@a:1,redis://b:2: every seed") as err:
        connect("rediss://:hunter2@a:1,redis://b:2")
    assert "hunter2" not in str(err.value)
    with pytest.raises(ValueError, match="redis_url: a Redis Cluster needs the URL of a seed node"):
        connect("", RedisAuth(cluster=True))
