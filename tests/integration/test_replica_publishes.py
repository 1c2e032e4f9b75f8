"""A replica with ``redis_url`` publishes its KV events, heartbeats and snapshots (real Redis, real gRPC)."""

from __future__ import annotations

import grpc
import pytest
import redis

from kvroute.events import AllBlocksCleared, BlockStored, decode_batch
from kvroute.hashing import BlockHasher, to_event_int
from kvroute.heartbeat import Heartbeat
from kvroute.redis_layout import RedisLayout
from kvroute.snapshot import decode_snapshot
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import replica_pb2 as rep_pb
from kvroute.v1 import replica_pb2_grpc as rep_grpc
from kvroute_tools.redis_server import RedisServer
from replica.server import BackgroundReplica
from replica.settings import ReplicaSettings
from tests.support import wait_for

BLOCK = 16
PROMPT = [(13 * i + 1) % 500 for i in range(3 * BLOCK + 2)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with RedisServer() as rs:
        settings = ReplicaSettings(
            host="127.0.0.1", port=0, model_cache_dir=str(tmp_path_factory.mktemp("models")), num_blocks=64,
            torch_threads=1, replica_id="pub-replica", redis_url=rs.url, namespace="svc", heartbeat_interval=0.2,
            heartbeat_ttl=4.0, engine_process=False,  # the tests read the LLMEngine and the publisher in this process
        )
        with BackgroundReplica(settings) as replica:
            channel = grpc.insecure_channel(replica.target)
            yield replica, rep_grpc.ReplicaServiceStub(channel), redis.Redis.from_url(rs.url)
            channel.close()


def _stream_events(r: redis.Redis, layout: RedisLayout) -> list:
    out = []
    for _id, fields in r.xrange(layout.events_stream("pub-replica")):
        assert fields[b"replica_id"] == b"pub-replica"
        out.append((int(fields[b"seq"]), decode_batch(fields[b"batch"])[1]))
    return out


def test_heartbeat_carries_the_engine_identity_and_address(cluster):
    replica, stub, r = cluster
    key = RedisLayout("svc").heartbeat_key("pub-replica")
    beat = Heartbeat.from_redis(wait_for(lambda: r.hgetall(key)))
    eng = replica.server.engine.engine
    assert beat.address == replica.server.address
    assert beat.hash_identity == eng.hasher.identity
    assert beat.num_blocks == eng.num_blocks == 64
    assert beat.model == "kvroute-tiny-llama"
    info = stub.GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=30)
    assert (beat.vocab_size, beat.max_model_len) == (info.vocab_size, info.max_model_len)  # the model limits
    assert beat.max_model_len == 64 * BLOCK - BLOCK  # the model's 8192, capped by the 64-block KV cache
    assert beat.invalid == ()


def test_the_heartbeat_key_lives_the_heartbeat_ttl_setting_not_three_intervals(cluster):
    _replica, _stub, r = cluster
    key = RedisLayout("svc").heartbeat_key("pub-replica")
    wait_for(lambda: r.exists(key))
    # Refreshed every 0.2 s with a 4 s TTL; the default (3 intervals) would leave at most 600 ms.
    assert 3000 < r.pttl(key) <= 4000


def test_request_blocks_are_published_as_block_stored_after_the_epoch_clear(cluster):
    replica, stub, r = cluster
    stub.Generate(rep_pb.ReplicaGenerateRequest(
        token_ids=PROMPT, sampling=gen_pb.SamplingParams(max_tokens=2, temperature=0.0)
    ))
    hasher = BlockHasher(block_size=BLOCK)
    want = [to_event_int(d) for d in hasher.hash_blocks(PROMPT)]
    assert len(want) == 3

    def stored() -> list[int]:
        return [h for _seq, evs in _stream_events(r, RedisLayout("svc")) for e in evs
                if isinstance(e, BlockStored) for h in e.block_hashes]

    assert wait_for(lambda: set(want) <= set(stored()))
    batches = _stream_events(r, RedisLayout("svc"))
    assert batches[0] == (1, [AllBlocksCleared(None)])  # the warm-up left nothing behind
    assert [seq for seq, _ in batches] == list(range(1, len(batches) + 1))


def test_request_snapshot_writes_the_cached_set(cluster):
    replica, stub, r = cluster
    seq = stub.RequestSnapshot(rep_pb.RequestSnapshotRequest()).seq
    assert seq >= 2
    key = RedisLayout("svc").snapshot_key("pub-replica")

    def snapshot_at_seq():
        raw = r.get(key)
        if raw is None:
            return None
        snap = decode_snapshot(raw)
        return snap if snap.seq >= seq else None

    snap = wait_for(snapshot_at_seq)
    cached = {h for hashes in snap.media.values() for h in hashes}
    want = {to_event_int(d) for d in BlockHasher(block_size=BLOCK).hash_blocks(PROMPT)}
    assert want <= cached
    assert replica.server.publisher.batches_dropped == 0
