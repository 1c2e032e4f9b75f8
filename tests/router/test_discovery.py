"""Replica discovery (router/discovery.py, DESIGN.md §5).

KubernetesDiscovery runs the official kubernetes client against a real HTTP server on loopback that
speaks the EndpointSlice list/watch protocol (tests.support_kube.FakeKubeAPI).
"""

from __future__ import annotations

import contextlib

import kubernetes.client
import pytest

from kvroute.hashing import BlockHasher
from kvroute.heartbeat import Heartbeat
from router.discovery import KubernetesDiscovery, RedisDiscovery, StaticDiscovery, parse_address
from router.registry import ReplicaRegistry
from tests.support import wait_for
from tests.support_kube import NAMESPACE, SERVICE, FakeKubeAPI, endpoint_slice


@pytest.fixture
def api():
    server = FakeKubeAPI()
    yield server
    server.close()


@pytest.fixture
def discovery(api):
    """Makes KubernetesDiscovery objects on the fake API server (``port_name`` "grpc" unless given),
    each stopped after the test."""
    with contextlib.ExitStack() as stops:

        def make(**kw) -> KubernetesDiscovery:
            client = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=f"http://127.0.0.1:{api.port}"))
            d = KubernetesDiscovery(NAMESPACE, SERVICE, api_client=client, **{"port_name": "grpc", **kw})
            stops.callback(d.stop)
            return d

        yield make


@pytest.fixture
def watching(api, discovery) -> KubernetesDiscovery:
    """A started discovery that listed one slice (replicas-a: 10.0.0.1 ready) and opened its watch."""
    api.put(endpoint_slice("replicas-a", [("10.0.0.1", True)]))
    d = discovery()
    d.start()
    assert d.wait_listed(5)
    wait_for(lambda: any(r.startswith("watch") for r in api.requests), what="the watch")
    return d


# -- Kubernetes ---------------------------------------------------------------------------------------
def test_initial_list_gives_the_ready_endpoints_with_the_named_port(api, discovery):
    api.put(endpoint_slice("replicas-a", [("10.0.0.1", True), ("10.0.0.2", None), ("10.0.0.3", False)]))
    api.put(endpoint_slice("replicas-b", [("10.0.1.1", True)]))
    api.put(endpoint_slice("other-x", [("10.9.9.9", True)], service="something-else"))
    d = discovery()
    seen: list[frozenset[str]] = []
    d.add_listener(seen.append)
    d.start()
    assert d.wait_listed(5)
    expected = {"10.0.0.1:50051", "10.0.0.2:50051", "10.0.1.1:50051"}
    assert d.addresses() == expected
    assert seen == [expected]
    assert api.requests[0] == "list" and d.lists == 1


def test_the_watch_follows_an_endpoint_becoming_ready_then_unready(api, discovery):
    api.put(endpoint_slice("replicas-a", [("10.0.0.1", True), ("10.0.0.2", False)]))
    d = discovery()
    d.start()
    assert d.wait_listed(5)
    assert d.addresses() == {"10.0.0.1:50051"}
    api.put(endpoint_slice("replicas-a", [("10.0.0.1", True), ("10.0.0.2", True)]))
    wait_for(lambda: d.addresses() == {"10.0.0.1:50051", "10.0.0.2:50051"}, what="10.0.0.2 ready")
    api.put(endpoint_slice("replicas-a", [("10.0.0.1", False), ("10.0.0.2", True)]))
    wait_for(lambda: d.addresses() == {"10.0.0.2:50051"}, what="10.0.0.1 unready")
    api.put(endpoint_slice("replicas-new", [("10.0.2.1", True)]))
    wait_for(lambda: d.addresses() == {"10.0.0.2:50051", "10.0.2.1:50051"}, what="a new slice")
    assert d.lists == 1, "followed by watching, not by listing again"


def test_a_terminating_endpoint_gets_no_new_traffic_even_while_serving(api, discovery):
    api.put(endpoint_slice("replicas-a", [
        ("10.0.0.1", {"ready": True, "serving": True, "terminating": False}),
        ("10.0.0.2", {"ready": False, "serving": True, "terminating": True}),  # draining
        ("10.0.0.3", {"serving": True, "terminating": True}),  # ready unset, but terminating
        ("10.0.0.4", {"ready": False, "serving": False, "terminating": False}),
    ]))
    d = discovery()
    d.start()
    assert d.wait_listed(5)
    assert d.addresses() == {"10.0.0.1:50051"}


def test_a_deleted_slice_drops_its_addresses(api, discovery):
    api.put(endpoint_slice("replicas-a", [("10.0.0.1", True)]))
    api.put(endpoint_slice("replicas-b", [("10.0.1.1", True)]))
    d = discovery()
    d.start()
    assert d.wait_listed(5)
    api.delete("replicas-a")
    wait_for(lambda: d.addresses() == {"10.0.1.1:50051"}, what="replicas-a gone")


def test_an_expired_watch_410_relists(api, watching):
    d = watching
    api.put_while_compacting(endpoint_slice("replicas-a", [("10.0.0.1", True), ("10.0.0.7", True)]))
    wait_for(lambda: d.addresses() == {"10.0.0.1:50051", "10.0.0.7:50051"}, what="the relisted change")
    assert d.lists == 2
    api.put(endpoint_slice("replicas-b", [("10.0.1.1", True)]))  # and watching resumes after the relist
    wait_for(lambda: "10.0.1.1:50051" in d.addresses(), what="a change after the relist")


def test_a_dropped_watch_resumes_from_the_last_resource_version(api, watching):
    d = watching
    api.drop_watches()
    api.put(endpoint_slice("replicas-a", [("10.0.0.1", True), ("10.0.0.2", True)]))
    wait_for(lambda: d.addresses() == {"10.0.0.1:50051", "10.0.0.2:50051"}, what="the change after the drop")
    assert d.lists == 1
    assert len([r for r in api.requests if r.startswith("watch")]) >= 2


def test_a_fixed_port_overrides_slice_ports_and_a_slice_without_the_named_port_is_skipped(api, discovery):
    api.put(endpoint_slice("replicas-a", [("10.0.0.1", True)]))
    api.put(endpoint_slice("replicas-b", [("10.0.1.1", True)], ports=(("http", 8080),)))
    fixed = discovery(port=7000, port_name=None)
    named = discovery()
    fixed.start()
    named.start()
    assert fixed.wait_listed(5) and named.wait_listed(5)
    assert fixed.addresses() == {"10.0.0.1:7000", "10.0.1.1:7000"}
    assert named.addresses() == {"10.0.0.1:50051"}


def test_an_unreachable_api_server_is_retried_without_crashing():
    client = kubernetes.client.ApiClient(kubernetes.client.Configuration(host="http://127.0.0.1:9"))
    d = KubernetesDiscovery(NAMESPACE, SERVICE, port=7000, api_client=client, backoff_max_s=0.2)
    d.start()
    try:
        wait_for(lambda: d.errors >= 2, what="retries")
        assert not d.wait_listed(0) and d.addresses() == frozenset()
    finally:
        d.stop()


def test_kubernetes_discovery_makes_heartbeating_replicas_routable(api, discovery):
    registry = ReplicaRegistry(BlockHasher().identity, "kubernetes")
    algorithm, digest, block_size = BlockHasher().identity
    registry.update_from_heartbeat(Heartbeat(replica_id="replica-0", address="10.0.0.1:50051", epoch=1,
                                             hash_algorithm=algorithm, hash_seed_digest=digest,
                                             block_size=block_size), now=0.0)
    assert registry.routable() == []
    api.put(endpoint_slice("replicas-a", [("10.0.0.1", True)]))
    d = discovery()
    d.attach(registry)
    d.start()
    wait_for(lambda: [i.replica_id for i in registry.routable()] == ["replica-0"], what="routable")
    api.put(endpoint_slice("replicas-a", [("10.0.0.1", False)]))
    wait_for(lambda: registry.routable() == [], what="unready: not routable")


# -- static and redis ---------------------------------------------------------------------------------------
def test_static_discovery_validates_and_publishes_its_addresses():
    d = StaticDiscovery(["10.0.0.1:50051", " replica-1:50051 ", "[fd00::1]:50051", ""])
    seen: list[frozenset[str]] = []
    d.add_listener(seen.append)
    assert seen == [frozenset({"10.0.0.1:50051", "replica-1:50051", "[fd00::1]:50051"})]
    assert d.addresses() == seen[0]
    assert parse_address("[fd00::1]:50051") == ("[fd00::1]", 50051)
    for bad in ("10.0.0.1", "10.0.0.1:http", ":50051", "host:70000"):
        with pytest.raises(ValueError, match="discovery: address"):
            StaticDiscovery([bad])


def test_redis_discovery_is_every_heartbeating_replica():
    registry = ReplicaRegistry(BlockHasher().identity, "redis")
    d = RedisDiscovery(registry)
    registry.update_from_heartbeat(Heartbeat(replica_id="replica-0", address="10.0.0.1:50051"), now=0.0)
    assert d.addresses() == {"10.0.0.1:50051"}
    assert registry.get("replica-0").discovered
