"""The ports ``kvroute up`` gives its processes: fixed ones checked free, the rest picked free, none
twice (kvroute_tools.cluster's ``LocalCluster.start`` uses the plan).

    ClusterConfig ─▶ plan_ports ─▶ PortPlan(routers, replicas, replica_http, router_http, metrics)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvroute_tools.redis_server import free_port
from kvroute_tools.supervise import port_free


class ClusterError(RuntimeError):
    """The cluster could not start (the message names the process, and its log's last lines)."""


@dataclass
class PortPlan:
    """Every port of one local cluster: the routers' gRPC ports (the first is ``--router-port``'s),
    the replicas' gRPC ports, the replicas' HTTP ports (empty: off), the routers' HTTP ports (empty:
    off) and, with ``metrics``, a Prometheus port per process name (``router``, ``router-1``, ...,
    ``replica-0``, ...)."""

    routers: list[int]
    replicas: list[int]
    replica_http: list[int] = field(default_factory=list)
    router_http: list[int] = field(default_factory=list)
    metrics: dict[str, int] = field(default_factory=dict)

    def taken(self) -> list[int]:
        return [*self.routers, *self.replicas, *self.replica_http, *self.router_http, *self.metrics.values()]

    def free(self, host: str) -> int:
        """A free port on ``host`` that the plan has not given out yet."""
        port = 0
        while not port or port in self.taken():
            port = free_port(host)
        return port


def router_names(n: int) -> list[str]:
    """The process names of ``n`` routers: ``router`` (the first, whose name and log stay those of a
    one-router cluster), then ``router-1``, ``router-2``, ..."""
    return ["router", *(f"router-{i}" for i in range(1, n))]


def plan_ports(cfg: Any) -> PortPlan:
    """The ports for ``cfg`` (a ``ClusterConfig``).

    Raises:
        ClusterError: a configured port (``--router-port``, ``--base-port``,
            ``--replica-http-base-port``, ``--router-http-port``) is taken; the message names the flag.
    """
    plan = PortPlan(*_grpc_ports(cfg))
    if cfg.replica_http_base_port:
        ports = [cfg.replica_http_base_port + i for i in range(cfg.replicas)]
        busy = [p for p in ports if p in plan.taken() or not port_free(cfg.host, p)]
        if busy:
            raise ClusterError(f"--replica-http-base-port: port(s) {', '.join(map(str, busy))} on {cfg.host} are taken")
        plan.replica_http = ports
    while len(plan.routers) < cfg.routers:
        plan.routers.append(plan.free(cfg.dial_host))
    port = cfg.router_http_port
    if port >= 0:
        if port and not port_free(cfg.host, port):
            raise ClusterError(f"router_http_port: port {port} on {cfg.host} is taken")
        plan.router_http = [port if port and port not in plan.taken() else plan.free(cfg.dial_host)]
        while len(plan.router_http) < cfg.routers:
            plan.router_http.append(plan.free(cfg.dial_host))
    if cfg.metrics:
        for name in (*router_names(cfg.routers), *(f"replica-{i}" for i in range(cfg.replicas))):
            plan.metrics[name] = plan.free(cfg.dial_host)
    return plan


def metrics_flags(name: str, ports: dict[str, int]) -> list[str]:
    """``--metrics-port N`` for process ``name`` when the plan gave it one (the endpoint listens on
    the process's --host: its metrics_host follows its host)."""
    return ["--metrics-port", str(ports[name])] if name in ports else []


def _grpc_ports(cfg: Any) -> tuple[list[int], list[int]]:
    router_port = cfg.router_port or free_port(cfg.dial_host)
    if cfg.router_port and not port_free(cfg.host, router_port):
        raise ClusterError(f"--router-port: port {router_port} on {cfg.host} is taken (another `kvroute up`?); "
                           "pass another one, or 0 for a free one")
    if cfg.base_port:
        ports = [cfg.base_port + i for i in range(cfg.replicas)]
        taken = [p for p in ports if not port_free(cfg.host, p)]
        if taken:
            raise ClusterError(f"--base-port: port(s) {', '.join(map(str, taken))} on {cfg.host} are taken")
    else:
        ports = []
        while len(ports) < cfg.replicas:
            p = free_port(cfg.dial_host)
            if p != router_port and p not in ports:
                ports.append(p)
    return [router_port], ports


__all__ = ["ClusterError", "PortPlan", "metrics_flags", "plan_ports", "router_names"]
