"""ReplicaRegistry: heartbeats, discovery and hash compatibility decide routability (router/registry.py,
DESIGN.md §2, §5)."""

from __future__ import annotations

import logging

import pytest

from kvroute.hashing import BlockHasher
from kvroute.heartbeat import Heartbeat
from router.model_limits import ReportedLimits
from router.registry import ReplicaRegistry

ROUTER = BlockHasher().identity  # ("sha256_cbor", "9bd96a485ad84efd", 16)


def heartbeat(replica_id: str = "replica-0", address: str = "10.0.0.1:50051", **fields: str) -> Heartbeat:
    """A heartbeat as the consumer reads it from Redis (every field a string)."""
    algorithm, digest, block_size = ROUTER
    return Heartbeat.from_redis({
        "replica_id": replica_id, "address": address, "epoch": "7", "last_seq": "42", "model": "tiny",
        "block_size": str(block_size), "hash_algorithm": algorithm, "hash_seed_digest": digest,
        "num_blocks": "64", "free_blocks": "40", "running": "2", "waiting": "1", "usage": "0.375",
        "queued_prefill_tokens": "96", "ts": "1700000000.0", **fields,
    })


def test_a_heartbeat_is_parsed_and_a_compatible_replica_is_routable():
    registry = ReplicaRegistry(ROUTER, "redis")
    info = registry.update_from_heartbeat(heartbeat(), now=12.5)
    assert (info.epoch, info.last_seq, info.block_size, info.num_blocks, info.free_blocks) == (7, 42, 16, 64, 40)
    assert (info.running, info.waiting, info.usage, info.queued_prefill_tokens) == (2, 1, 0.375, 96)
    assert (info.heartbeat_at, info.model, info.address) == (12.5, "tiny", "10.0.0.1:50051")
    assert info.discovered and info.hash_compatible and info.routable and info.reason == ""
    assert registry.routable() == [info] and registry.get("replica-0") is info and registry.all() == [info]


def test_a_heartbeat_without_the_model_limits_parses_and_leaves_them_unknown():
    # An older replica writes neither vocab_size nor max_model_len (``heartbeat()`` leaves them out).
    beat = heartbeat()
    assert (beat.vocab_size, beat.max_model_len, beat.invalid) == (0, 0, ())
    registry = ReplicaRegistry(ROUTER, "redis")
    info = registry.update_from_heartbeat(beat, now=0.0)
    assert info.routable and (info.vocab_size, info.max_model_len) == (0, 0)
    assert registry.limits() == ReportedLimits(0, 0, vocab_size_unsaid=True, max_model_len_unsaid=True)


def test_the_registry_reports_the_limits_of_the_routable_replicas_only():
    registry = ReplicaRegistry(ROUTER, "redis")
    assert registry.limits() == ReportedLimits()  # nobody routable
    a = registry.update_from_heartbeat(heartbeat("replica-a", vocab_size="529", max_model_len="256"), now=0.0)
    assert (a.vocab_size, a.max_model_len) == (529, 256)
    registry.update_from_heartbeat(heartbeat("replica-b", vocab_size="529", max_model_len="4096", block_size="32"),
                                   now=0.0)  # not routable: its 4096 does not count
    assert registry.limits() == ReportedLimits(529, 256, vocab_size_unsaid=False, max_model_len_unsaid=False)
    registry.update_from_heartbeat(heartbeat("replica-b", vocab_size="529", max_model_len="4096"), now=1.0)
    assert registry.limits() == ReportedLimits(529, 4096, vocab_size_unsaid=False, max_model_len_unsaid=False)
    registry.expire("replica-b")
    assert registry.limits() == ReportedLimits(529, 256, vocab_size_unsaid=False, max_model_len_unsaid=False)


def test_a_model_limit_that_does_not_parse_makes_the_replica_unroutable():
    info = ReplicaRegistry(ROUTER, "redis").update_from_heartbeat(heartbeat(max_model_len="lots"), now=0.0)
    assert not info.routable and info.reason == "bad heartbeat fields: max_model_len='lots'"


def test_a_draining_replica_is_not_routable_says_why_and_its_entries_are_dropped():
    registry = ReplicaRegistry(ROUTER, "redis")
    removed: list[str] = []
    registry.add_listener(removed.append)
    assert registry.update_from_heartbeat(heartbeat("replica-a", draining="0"), now=0.0).routable
    registry.update_from_heartbeat(heartbeat("replica-b", "10.0.0.2:50051"), now=0.0)  # no field: not draining
    info = registry.update_from_heartbeat(heartbeat("replica-a", draining="1"), now=1.0)
    assert info.draining and not info.routable and info.hash_compatible
    assert info.reason == "draining (shutting down: takes no new calls)"
    assert removed == ["replica-a"]
    assert [i.replica_id for i in registry.routable()] == ["replica-b"]


def test_a_draining_field_that_is_neither_0_nor_1_makes_the_replica_unroutable():
    info = ReplicaRegistry(ROUTER, "redis").update_from_heartbeat(heartbeat(draining="yes"), now=0.0)
    assert not info.routable and not info.draining and info.reason == "bad heartbeat fields: draining='yes'"


def test_the_router_identity_is_the_design_default():
    assert ROUTER == ("sha256_cbor", "9bd96a485ad84efd", 16)  # DESIGN.md §2: NONE_HASH starts 9bd96a485ad84efd


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"block_size": "32"}, "block_size 32 != router's 16"),
        ({"hash_seed_digest": "4e1195df020de59e"}, "hash_seed_digest 4e1195df020de59e != router's 9bd96a485ad84efd"),
        ({"hash_algorithm": "xxhash_cbor"}, "hash_algorithm xxhash_cbor != router's sha256_cbor"),
        ({"block_size": "sixteen"}, "bad heartbeat fields: block_size='sixteen'; block_size 0 != router's 16"),
    ],
)
def test_a_replica_with_a_different_hash_triple_is_not_routable_and_says_why(fields, reason):
    registry = ReplicaRegistry(ROUTER, "redis")
    info = registry.update_from_heartbeat(heartbeat(**fields), now=0.0)
    assert not info.routable and not info.hash_compatible and info.discovered
    assert info.reason == reason
    assert registry.routable() == [] and registry.num_incompatible == 1


def test_an_incompatible_replica_is_logged_once_at_error(caplog):
    registry = ReplicaRegistry(ROUTER, "redis")
    with caplog.at_level(logging.ERROR, logger="router.registry"):
        for t in range(5):
            registry.update_from_heartbeat(heartbeat(block_size="32"), now=float(t))
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "replica-0" in errors[0].getMessage() and "block_size 32 != router's 16" in errors[0].getMessage()
    registry.update_from_heartbeat(heartbeat(block_size="16"), now=6.0)  # restarted, fixed
    assert registry.num_incompatible == 0 and registry.get("replica-0").routable


def test_an_id_whose_address_flips_is_logged_and_counted_each_time(caplog):
    registry = ReplicaRegistry(ROUTER, "redis")
    with caplog.at_level(logging.WARNING, logger="router.registry"):
        for t, address in enumerate(["10.0.0.1:50051", "10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.1:50051"]):
            registry.update_from_heartbeat(heartbeat(address=address), now=float(t))
    assert registry.address_changes == 2
    flips = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(flips) == 2
    assert "replica-0: address changed from 10.0.0.1:50051 (epoch 7) to 10.0.0.2:50051 (epoch 7)" in flips[0]


def test_static_discovery_needs_the_heartbeat_address_in_the_discovered_set():
    registry = ReplicaRegistry(ROUTER, "static")
    a = registry.update_from_heartbeat(heartbeat("replica-a", "10.0.0.1:50051"), now=0.0)
    assert not a.routable and a.reason == "address 10.0.0.1:50051 not discovered (static discovery)"
    registry.set_discovered({"10.0.0.1:50051", "10.0.0.9:50051"})
    assert [i.replica_id for i in registry.routable()] == ["replica-a"]
    b = registry.update_from_heartbeat(heartbeat("replica-b", "10.0.0.2:50051"), now=0.0)
    assert not b.discovered
    registry.set_discovered({"10.0.0.2:50051"})
    assert [i.replica_id for i in registry.routable()] == ["replica-b"]


def test_redis_discovery_discovers_every_heartbeating_replica():
    registry = ReplicaRegistry(ROUTER, "redis")
    registry.set_discovered(set())  # ignored in this mode
    assert registry.update_from_heartbeat(heartbeat(address="anywhere:1"), now=0.0).routable


def test_on_removed_runs_when_a_replica_expires_or_stops_being_routable():
    registry = ReplicaRegistry(ROUTER, "kubernetes")
    removed: list[str] = []
    registry.add_listener(removed.append)
    registry.set_discovered({"10.0.0.1:50051", "10.0.0.2:50051"})
    registry.update_from_heartbeat(heartbeat("replica-a", "10.0.0.1:50051"), now=0.0)
    registry.update_from_heartbeat(heartbeat("replica-b", "10.0.0.2:50051"), now=0.0)
    registry.update_from_heartbeat(heartbeat("replica-c", "10.0.0.3:50051"), now=0.0)  # never routable
    assert removed == []
    registry.set_discovered({"10.0.0.2:50051"})  # discovery dropped replica-a
    assert removed == ["replica-a"]
    registry.update_from_heartbeat(heartbeat("replica-b", "10.0.0.2:50051", block_size="32"), now=1.0)
    assert removed == ["replica-a", "replica-b"]  # restarted with another block_size
    registry.expire("replica-c")
    registry.expire("replica-unknown")  # nothing to do
    assert removed == ["replica-a", "replica-b", "replica-c"]
    assert registry.get("replica-c") is None and {i.replica_id for i in registry.all()} == {"replica-a", "replica-b"}


def test_a_listener_that_raises_does_not_stop_the_others():
    registry = ReplicaRegistry(ROUTER, "redis")
    removed: list[str] = []

    def broken(replica_id: str) -> None:
        raise RuntimeError("boom")

    registry.add_listener(broken)
    registry.add_listener(removed.append)
    registry.update_from_heartbeat(heartbeat(), now=0.0)
    registry.expire("replica-0")
    assert removed == ["replica-0"]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="discovery: unknown mode"):
        ReplicaRegistry(ROUTER, "dns")
    with pytest.raises(ValueError, match="missing replica_id"):
        ReplicaRegistry(ROUTER).update_from_heartbeat(Heartbeat.from_redis({"address": "x:1"}), now=0.0)
    with pytest.raises(ValueError, match="missing replica_id"):
        ReplicaRegistry(ROUTER).update_from_heartbeat(Heartbeat(replica_id=""), now=0.0)


def test_a_replica_serving_another_model_is_not_routable_and_the_reason_names_both():
    registry = ReplicaRegistry(ROUTER, "redis", model="tiny")
    assert registry.update_from_heartbeat(heartbeat("replica-a"), now=0.0).routable
    other = registry.update_from_heartbeat(heartbeat("replica-b", model="llama-8b"), now=0.0)
    assert not other.routable and other.reason == "model 'llama-8b' != router's 'tiny'"
    assert [i.replica_id for i in registry.routable()] == ["replica-a"] and registry.num_incompatible == 1
    # a router without a model name (and a heartbeat that names none) accepts any
    assert ReplicaRegistry(ROUTER, "redis").update_from_heartbeat(heartbeat(model="llama-8b"), now=0.0).routable
    assert registry.update_from_heartbeat(heartbeat("replica-c", model=""), now=0.0).routable
