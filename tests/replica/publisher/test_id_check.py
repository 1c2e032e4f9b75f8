"""A replica refuses a replica id that a live replica at another address heartbeats under in the
same namespace (replica/publisher/id_check.py), against a real redis-server and a real publisher."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from replica.publisher import ReplicaIdInUseError
from replica.publisher.id_check import check_replica_id_free
from tests import support_redis
from tests.support import wait_for

server = support_redis.redis_server
layout = support_redis.redis_layout
r = support_redis.redis_client
fake_replicas = support_redis.fake_replicas


def test_a_replica_refuses_to_start_under_the_id_of_a_live_replica_elsewhere(server, layout, fake_replicas, r,
                                                                            tmp_path):
    fake_replicas("replica-0", port=50051)  # heartbeats every 0.2 s as 127.0.0.1:50051
    wait_for(lambda: r.exists(layout.heartbeat_key("replica-0")), what="the first heartbeat")
    proc = subprocess.run(
        [sys.executable, "-m", "replica", "--host", "127.0.0.1", "--port", "0", "--redis-url", server.url,
         "--namespace", layout.namespace, "--replica-id", "replica-0", "--model-cache-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1
    assert "replica_id 'replica-0' is in use: a live replica at 127.0.0.1:50051" in proc.stderr
    assert f"namespace {layout.namespace!r}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_live_heartbeat_at_another_address_is_refused_and_the_same_address_is_ours(server, layout, fake_replicas, r):
    fake_replicas("replica-0", port=50051)
    wait_for(lambda: r.exists(layout.heartbeat_key("replica-0")), what="the first heartbeat")
    with pytest.raises(ReplicaIdInUseError, match="at 127.0.0.1:50051 .* namespace 'test'"):
        check_replica_id_free(r, layout, "replica-0", "127.0.0.1:50999")
    t0 = time.monotonic()
    check_replica_id_free(r, layout, "replica-0", "127.0.0.1:50051")  # our own restart: no wait
    assert time.monotonic() - t0 < 0.1
    check_replica_id_free(r, layout, "replica-1", "127.0.0.1:50999")  # nobody under that id


def test_a_dead_replica_last_heartbeat_does_not_block_its_id(layout, r):
    key = layout.heartbeat_key("replica-0")
    r.hset(key, mapping={"replica_id": "replica-0", "address": "127.0.0.1:50051", "ts": "1"})
    r.pexpire(key, 300)  # never refreshed: it expires
    check_replica_id_free(r, layout, "replica-0", "127.0.0.1:50999")
    assert not r.exists(key)
