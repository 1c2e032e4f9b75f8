"""Replica discovery (router/discovery.py, DESIGN.md §5).

KubernetesDiscovery runs the official kubernetes client against a real HTTP server on loopback that
speaks the EndpointSlice list/watch protocol: a list returns an EndpointSliceList with a
resourceVersion; a watch streams newline-delimited ADDED / MODIFIED / DELETED events (chunked) after
the requested resourceVersion, or one ERROR event with code 410 when that version was compacted.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import kubernetes.client
import pytest

from kvroute.hashing import BlockHasher
from kvroute.heartbeat import Heartbeat
from router.discovery import KubernetesDiscovery, RedisDiscovery, StaticDiscovery, parse_address
from router.registry import ReplicaRegistry
from tests.support import wait_for

NAMESPACE = "kvroute"
SERVICE = "kvroute-replicas"


# -- a fake Kubernetes API server ------------------------------------------------------------------------
def endpoint_slice(name: str, endpoints: list[tuple[str, bool | None]], *, service: str = SERVICE,
                   ports: tuple[tuple[str, int], ...] = (("grpc", 50051), ("metrics", 9090))) -> dict:
    """An EndpointSlice object; ``ready`` None leaves the condition unset."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": [ip], "conditions": {} if ready is None else {"ready": ready}}
            for ip, ready in endpoints
        ],
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports],
    }


class FakeKubeAPI:
    """EndpointSlices of one namespace with resourceVersions, an event log and watch compaction."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.slices: dict[str, dict] = {}
        self.rv = 100
        self.events: list[tuple[int, str, dict]] = []  # (resourceVersion, type, object)
        self.compacted = 0  # a watch from a resourceVersion below this gets 410 Gone
        self.generation = 0  # bumped to end every open watch
        self.closed = False
        self.requests: list[str] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                q = {k: v[0] for k, v in parse_qs(url.query).items()}
                if url.path != f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices":
                    self.send_error(404)
                    return
                selector = q.get("labelSelector", "")
                if q.get("watch") == "true":
                    api.serve_watch(self, selector, int(q.get("resourceVersion", "0")),
                                    float(q.get("timeoutSeconds", "30")))
                else:
                    api.requests.append("list")
                    api.serve_list(self, selector)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    # -- state changes (the test's side) ---------------------------------------------------------------
    def put(self, obj: dict, *, record: bool = True) -> None:
        with self.cond:
            self.rv += 1
            obj = json.loads(json.dumps(obj))
            obj["metadata"]["resourceVersion"] = str(self.rv)
            name = obj["metadata"]["name"]
            kind = "MODIFIED" if name in self.slices else "ADDED"
            self.slices[name] = obj
            if record:
                self.events.append((self.rv, kind, obj))
            self.cond.notify_all()

    def delete(self, name: str) -> None:
        with self.cond:
            self.rv += 1
            obj = self.slices.pop(name)
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self.events.append((self.rv, "DELETED", obj))
            self.cond.notify_all()

    def put_while_compacting(self, obj: dict) -> None:
        """Apply ``obj`` as a change no watch will ever see (compacted away), and end open watches:
        the client's next watch is from a version that is gone, so it must relist."""
        with self.cond:
            self.put(obj, record=False)
            self.compacted = self.rv
            self.generation += 1
            self.cond.notify_all()

    def drop_watches(self) -> None:
        """End every open watch (an API server restart, a load balancer timeout)."""
        with self.cond:
            self.generation += 1
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- requests (the server's side) ------------------------------------------------------------------
    @staticmethod
    def _selected(obj: dict, selector: str) -> bool:
        key, _, value = selector.partition("=")
        return not selector or obj["metadata"].get("labels", {}).get(key) == value

    def serve_list(self, h: BaseHTTPRequestHandler, selector: str) -> None:
        with self.cond:
            body = json.dumps({
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": str(self.rv)},
                "items": [o for o in self.slices.values() if self._selected(o, selector)],
            }).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def serve_watch(self, h: BaseHTTPRequestHandler, selector: str, since: int, timeout: float) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def chunk(event: dict) -> None:
            line = json.dumps(event).encode() + b"\n"
            h.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            h.wfile.flush()

        deadline = time.monotonic() + timeout
        with self.cond:
            gone = since < self.compacted
            generation = self.generation
            # Recorded only once the watch is open (its generation taken), so a test that waits for
            # the request and then drops watches really ends this one.
            self.requests.append(f"watch {since}")
        try:
            if gone:
                chunk({"type": "ERROR", "object": {
                    "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired",
                    "message": f"too old resource version: {since} ({self.compacted})", "code": 410}})
            else:
                while True:
                    with self.cond:
                        new = [e for e in self.events if e[0] > since]
                        if not new and generation == self.generation and not self.closed:
                            self.cond.wait(0.1)
                            new = [e for e in self.events if e[0] > since]
                        dropped = generation != self.generation
                        if dropped:
                            # A dropped connection delivers nothing more: events put after (or
                            # racing with) the drop reach the client only through its next watch,
                            # resumed from the last resourceVersion it saw.
                            new = []
                        ended = dropped or self.closed or time.monotonic() > deadline
                    for rv, kind, obj in new:
                        since = rv
                        if self._selected(obj, selector):
                            chunk({"type": kind, "object": obj})
                    if ended:
                        break
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        except OSError:  # the client went away
            h.close_connection = True


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
