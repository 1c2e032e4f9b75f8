"""Replica discovery: which ``host:port`` addresses may get traffic (DESIGN.md §5).

    StaticDiscovery(addresses)            a fixed list (flags / settings)
    RedisDiscovery(registry)              every heartbeating replica (the registry's "redis" mode)
    KubernetesDiscovery(ns, service, …)   ready endpoints of the Service's EndpointSlices (list + watch)
                    │
                    └── listeners(frozenset of "host:port") ──▶ ReplicaRegistry.set_discovered

A replica is discovered when the ``address`` in its heartbeat is in the set, so replicas must
advertise the address discovery sees (in Kubernetes: the pod IP and the named port). The set is
only ever replaced whole; listeners are called on the discovery's own thread, once per change
(and once at ``add_listener`` if a set was already published).

KubernetesDiscovery keeps ``slice name -> EndpointSlice`` for the slices labelled
``kubernetes.io/service-name=<service>`` from a list and then a watch from the list's
resourceVersion; an expired watch (410 Gone) relists, a broken connection resumes the watch from
the last resourceVersion seen after a backoff. An endpoint counts when its ``ready`` condition is
true or unset (the API's rule) and it is not ``terminating`` (a draining pod may still be
``serving`` the calls it has, but gets no new ones), with the port named ``port_name`` in its slice
(or ``port``). The API server is the in-cluster one (the pod's service account) or, outside a
cluster, the one the kubeconfig names (``KUBECONFIG``, read by the kubernetes client itself).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from router.registry import ReplicaRegistry

log = logging.getLogger(__name__)

Listener = Callable[[frozenset[str]], None]

_MIN_BACKOFF_S = 0.1
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) as (host, port).

    Raises:
        ValueError: no port, or a port outside 1..65535.
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"discovery: address {address!r} is not host:port")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"discovery: address {address!r} has no numeric port") from None
    if not 0 < port < 65536:
        raise ValueError(f"discovery: address {address!r}: port out of range")
    return host, port


class Discovery:
    """The current set of discovered ``"host:port"`` addresses, and listeners for its changes.

    The base class holds the set and the listeners; implementations call ``_publish`` with each new
    set and override ``start`` / ``stop`` when they run a thread."""

    mode: str = ""  # the ReplicaRegistry discovery_mode this implementation goes with

    def __init__(self) -> None:
        self._addresses: frozenset[str] = frozenset()
        self._published = False
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start discovering (non-blocking)."""

    def stop(self) -> None:
        """Stop discovering; the last set stays readable."""

    def addresses(self) -> frozenset[str]:
        """The current set."""
        return self._addresses

    def add_listener(self, callback: Listener) -> None:
        """Call ``callback(addresses)`` on every change (now too, if a set was already published)."""
        with self._lock:
            self._listeners.append(callback)
            current = self._addresses if self._published else None
        if current is not None:
            callback(current)

    def attach(self, registry: ReplicaRegistry) -> None:
        """Feed ``registry.set_discovered`` with this discovery's sets."""
        self.add_listener(registry.set_discovered)

    def _publish(self, addresses: Iterable[str]) -> None:
        addresses = frozenset(addresses)
        with self._lock:
            if self._published and addresses == self._addresses:
                return
            self._addresses, self._published = addresses, True
            listeners = list(self._listeners)
        log.info("discovery (%s): %d replica address(es): %s", self.mode, len(addresses),
                 ", ".join(sorted(addresses)) or "none")
        for cb in listeners:
            try:
                cb(addresses)
            except Exception:  # noqa: BLE001 - one broken listener must not starve the others
                log.exception("discovery: listener failed")


class StaticDiscovery(Discovery):
    """A fixed set of addresses.

    Raises:
        ValueError: an address that is not ``host:port``.
    """

    mode = "static"

    def __init__(self, addresses: Iterable[str]):
        super().__init__()
        self._static = frozenset(a.strip() for a in addresses if a.strip())
        for a in self._static:
            parse_address(a)
        self._publish(self._static)


class RedisDiscovery(Discovery):
    """Every heartbeating replica: membership is the registry's own (mode "redis"), so there is
    nothing to watch and no listener is ever called; ``addresses()`` reads the registry."""

    mode = "redis"

    def __init__(self, registry: ReplicaRegistry):
        super().__init__()
        self._registry = registry

    def addresses(self) -> frozenset[str]:
        return frozenset(i.address for i in self._registry.all() if i.address)


class KubernetesDiscovery(Discovery):
    """Ready endpoints of a Service's ``discovery.k8s.io/v1`` EndpointSlices, listed then watched.

    Owns ``slice name -> EndpointSlice`` for the Service and the watch thread. Invariant: the
    published set is the union of the ready addresses of those slices as of the last event applied.

    Args:
        namespace: the Service's namespace.
        service_name: the Service whose slices to follow.
        port_name: the EndpointSlice port name of the replicas' gRPC port (e.g. "grpc").
        port: a fixed port number instead (then slice ports are ignored). With neither, a slice's
            only port is used.
        api_client: a ``kubernetes.client.ApiClient`` (default: the in-cluster configuration).
        watch_timeout_s: server-side timeout of one watch call (it is then resumed).
        backoff_max_s: cap of the retry backoff after API errors.

    Stats: ``lists`` (full lists, the first included), ``watch_events``, ``errors``.
    """

    mode = "kubernetes"

    def __init__(
        self,
        namespace: str,
        service_name: str,
        *,
        port_name: str | None = None,
        port: int | None = None,
        api_client: Any = None,
        watch_timeout_s: int = 240,
        backoff_max_s: float = 5.0,
    ):
        super().__init__()
        if not namespace or not service_name:
            raise ValueError("kubernetes discovery: namespace and service_name are required")
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"kubernetes discovery: port {port} out of range")
        self.namespace = namespace
        self.service_name = service_name
        self.port_name = port_name
        self.port = port
        self.watch_timeout_s = int(watch_timeout_s)
        self.backoff_max_s = backoff_max_s
        self.label_selector = f"{SERVICE_NAME_LABEL}={service_name}"
        self._api_client = api_client
        self._slices: dict[str, Any] = {}
        self._stop = threading.Event()
        self._listed = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: Any = None
        self._warned_ports: set[str] = set()
        self.lists = 0
        self.watch_events = 0
        self.errors = 0

    def start(self) -> None:
        """Start the list/watch thread (the first list happens there; see ``wait_listed``)."""
        if self._thread is not None:
            raise RuntimeError("KubernetesDiscovery.start: already started")
        from kubernetes import client, config  # only routers that use Kubernetes discovery pay for it

        if self._api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:  # not in a pod: the kubeconfig (KUBECONFIG or ~/.kube/config)
                config.load_kube_config()
            self._api_client = client.ApiClient()
        self._api = client.DiscoveryV1Api(self._api_client)
        self._thread = threading.Thread(target=self._run, name="k8s-discovery", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout
        while self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
            # Watch.stop() shuts the watch socket down so that a blocked read returns; it only can
            # once the response is open, and Watch.stream() clears the flag when it starts: repeat.
            w = self._watch
            if w is not None:
                w.stop()
            self._thread.join(0.05)

    def wait_listed(self, timeout: float | None = None) -> bool:
        """Block until the first list succeeded; False on timeout."""
        return self._listed.wait(timeout)

    # -- the watch thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        from kubernetes.client.rest import ApiException

        backoff = _MIN_BACKOFF_S
        resource_version: str | None = None
        while not self._stop.is_set():
            try:
                if resource_version is None:
                    resource_version = self._list()
                resource_version = self._follow(resource_version)
                backoff = _MIN_BACKOFF_S
            except ApiException as e:
                if self._stop.is_set():
                    break
                if e.status == 410:  # the watch's resourceVersion is too old: start over
                    log.info("kubernetes discovery: watch expired (410 Gone); relisting")
                    resource_version = None
                    continue
                self.errors += 1
                log.warning("kubernetes discovery: API error %s (%s); retrying in %.1fs",
                            e.status, e.reason, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
            except Exception as e:  # noqa: BLE001 - connection errors of every kind; the thread survives
                if self._stop.is_set():
                    break
                self.errors += 1
                log.warning("kubernetes discovery: %s: %s; retrying in %.1fs", type(e).__name__, e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)

    def _list(self) -> str:
        resp = self._api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=self.label_selector, _request_timeout=30.0
        )
        self._slices = {s.metadata.name: s for s in resp.items or ()}
        self.lists += 1
        self._refresh()
        self._listed.set()
        return resp.metadata.resource_version

    def _follow(self, resource_version: str) -> str:
        """One watch call from ``resource_version``; returns the last resourceVersion seen."""
        from kubernetes import watch

        w = watch.Watch()
        self._watch = w
        if self._stop.is_set():  # stop() ran before the watch existed
            return resource_version
        try:
            for event in w.stream(
                self._api.list_namespaced_endpoint_slice,
                self.namespace,
                label_selector=self.label_selector,
                resource_version=resource_version,
                timeout_seconds=self.watch_timeout_s,
                allow_watch_bookmarks=True,
                _request_timeout=(10.0, float(self.watch_timeout_s + 30)),
            ):
                kind, obj = event["type"], event["object"]
                if kind in ("ADDED", "MODIFIED"):
                    self._slices[obj.metadata.name] = obj
                elif kind == "DELETED":
                    self._slices.pop(obj.metadata.name, None)
                else:  # BOOKMARK: only a newer resourceVersion (kept by the Watch)
                    continue
                self.watch_events += 1
                self._refresh()
                if self._stop.is_set():
                    break
        finally:
            self._watch = None
        return w.resource_version or resource_version

    def _refresh(self) -> None:
        addresses: set[str] = set()
        for name, s in self._slices.items():
            addresses |= self._slice_addresses(name, s)
        self._publish(addresses)

    def _slice_addresses(self, name: str, s: Any) -> set[str]:
        port = self._slice_port(name, s)
        if port is None:
            return set()
        v6 = s.address_type == "IPv6"
        out = set()
        for ep in s.endpoints or ():
            cond = ep.conditions
            if cond is not None and (cond.ready is False or cond.terminating is True):
                continue  # unset ready means ready (the EndpointConditions contract)
            for a in ep.addresses or ():
                out.add(f"[{a}]:{port}" if v6 else f"{a}:{port}")
        return out

    def _slice_port(self, name: str, s: Any) -> int | None:
        if self.port is not None:
            return self.port
        ports = [p for p in s.ports or () if p.port]
        if self.port_name is not None:
            ports = [p for p in ports if p.name == self.port_name]
        if len(ports) == 1:
            return int(ports[0].port)
        if name not in self._warned_ports:
            self._warned_ports.add(name)
            want = f"named {self.port_name!r}" if self.port_name is not None else "(only one expected)"
            log.warning("kubernetes discovery: EndpointSlice %s has %d port(s) %s; skipping it",
                        name, len(ports), want)
        return None


__all__ = ["Discovery", "KubernetesDiscovery", "RedisDiscovery", "StaticDiscovery", "parse_address"]
