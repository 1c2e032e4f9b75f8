"""kvroute.redis_layout: the key names (DESIGN.md §4's table, verbatim) and their hash slots."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from kvroute.redis_layout import RedisLayout


def test_the_key_names_of_design_section_4():
    layout = RedisLayout("default", num_shards=4)
    k = layout.shard("replica-0")
    assert layout.events_stream("replica-0") == f"kvroute:{{default:{k}}}:events"
    assert layout.heartbeat_key("replica-0") == f"kvroute:{{default:{k}}}:replica:replica-0"
    assert layout.snapshot_key("replica-0") == f"kvroute:{{default:{k}}}:snapshot:replica-0"
    assert layout.snapshot_requests_channel("replica-0") == f"kvroute:{{default:{k}}}:snapshot-requests"
    assert layout.router_load_key("router-a") == "kvroute:default:router-load:router-a"
    assert layout.all_event_streams() == [f"kvroute:{{default:{i}}}:events" for i in range(4)]
    assert RedisLayout().events_stream("anyone") == "kvroute:{default:0}:events"


def test_a_replicas_stream_heartbeat_and_snapshot_share_one_hash_slot_per_shard():
    layout = RedisLayout("prod", num_shards=8)
    ids = [f"replica-{i}" for i in range(64)]
    for rid in ids:
        slots = {key_slot(k.encode()) for k in (layout.events_stream(rid), layout.heartbeat_key(rid),
                                                layout.snapshot_key(rid))}
        assert slots == {key_slot(layout.all_event_streams()[layout.shard(rid)].encode())}
    assert len({key_slot(s.encode()) for s in layout.all_event_streams()}) == 8  # the shards spread


def test_a_heartbeat_key_names_its_replica_and_whether_it_is_in_the_replicas_shard():
    layout = RedisLayout("ns", num_shards=4)
    key = layout.heartbeat_key("a:b{c}")
    assert layout.heartbeat_replica(key) == ("a:b{c}", True)
    other_shard = (layout.shard("r") + 1) % 4
    assert layout.heartbeat_replica(f"kvroute:{{ns:{other_shard}}}:replica:r") == ("r", False)
    assert layout.heartbeat_replica("kvroute:{ns.x:0}:replica:r") is None  # another namespace
    assert layout.heartbeat_replica("kvroute:{ns:0}:snapshot:r") is None


def test_scan_patterns_match_a_namespace_with_glob_characters_literally():
    layout = RedisLayout("a*[b]?")
    assert layout.heartbeat_pattern() == r"kvroute:{a\*\[b\]\?:*}:replica:*"
    assert layout.router_load_pattern() == r"kvroute:a\*\[b\]\?:router-load:*"


@pytest.mark.parametrize("namespace", ["", "a b", "a:b", "a{b", "a}b"])
def test_a_namespace_that_would_break_the_hash_tag_is_refused(namespace):
    with pytest.raises(ValueError, match="namespace"):
        RedisLayout(namespace)
